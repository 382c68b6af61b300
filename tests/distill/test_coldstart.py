"""The cold start (coldstart.py): its KL is the forward one, KL(p_text ‖ p_latent), and a non-finite update is
skipped, counted in what it returns and logged, never applied silently. Tiny fixtures; a few seconds."""

import copy
import math
from collections import Counter

import torch

from lopd_core.distill.composer.coldstart import train_coldstart
from lopd_core.distill.composer.coldstart_data import oracle_trajectory, varied_count
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.scoring import losses as L
from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec


def test_forward_kl_full_is_the_teacher_weighted_divergence_by_hand():
    # p_S = (0.5, 0.5), p_T = (0.9, 0.1): KL(p_T ‖ p_S) = 0.9 ln 1.8 + 0.1 ln 0.2 = 0.36806, while the reverse
    # KL(p_S ‖ p_T) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.51083: the two directions differ here.
    student, teacher = torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.9, 0.1]]))
    forward = 0.9 * math.log(1.8) + 0.1 * math.log(0.2)
    torch.testing.assert_close(L.forward_kl_full(student, teacher), torch.tensor([forward]))
    torch.testing.assert_close(
        L.reverse_kl_full(student, teacher), torch.tensor([0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5.0)])
    )


def _coldstart(tiny_model, tiny_tokenizer, *, kl_weight, logs, steps=2):
    codec = ChatCodec(tiny_tokenizer)
    successes = [oracle_trajectory(codec, t) for t in make_tasks("toolworld", "train", 3, seed=5)]
    texts = [f"search(query) found: row {i}" for i in range(2)]
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=2, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    before = {n: p.detach().clone() for n, p in composer.named_parameters()}
    run = train_coldstart(
        model,
        tiny_tokenizer,
        composer,
        successes,
        lambda ts: [texts for _ in ts],
        steps=steps,
        batch_size=2,
        lr=1e-2,
        kl_weight=kl_weight,
        seed=0,
        log=logs.append,
    )
    moved = {n for n, p in composer.named_parameters() if not torch.equal(p, before[n])}
    return run, moved, set(before)


def test_a_non_finite_coldstart_update_is_skipped_counted_and_logged(tiny_model, tiny_tokenizer):
    logs = []
    run, moved, names = _coldstart(tiny_model, tiny_tokenizer, kl_weight=math.nan, logs=logs)
    assert run.skipped_updates == 2 and len(run.rows) == 2 and not moved
    assert sum("update skipped" in line for line in logs) == 2
    assert any("2 of 2 updates skipped as non-finite" in line for line in logs)
    logs = []
    run, moved, names = _coldstart(tiny_model, tiny_tokenizer, kl_weight=0.5, logs=logs)
    assert run.skipped_updates == 0 and not any("skipped" in line for line in logs)
    assert moved == names  # every parameter of φ learns on a finite loss


def test_varied_count_keeps_the_nearest_one_to_most_rows_seeded():
    """`coldstart.max_experiences`: each call keeps a prefix (the nearest rows first) of 1..most rows per task,
    every count in that range drawn, the same stream for the same seed; a task with fewer rows keeps what it has."""
    tasks = make_tasks("toolworld", "train", 3, seed=0)
    rows = {t.task_id: [f"{t.task_id}-{k}" for k in range(8)] for t in tasks}
    rows[tasks[2].task_id] = rows[tasks[2].task_id][:2]

    def retrieve(ts):
        return [rows[t.task_id] for t in ts]

    pick, again = varied_count(retrieve, 8, seed=5), varied_count(retrieve, 8, seed=5)
    counts = Counter()
    for _ in range(200):
        out = pick(tasks)
        assert out == again(tasks)
        for t, kept in zip(tasks, out):
            assert kept == rows[t.task_id][: len(kept)] and 1 <= len(kept) <= 8
        counts.update(len(kept) for kept in out[:2])
        assert len(out[2]) <= 2
    assert set(counts) == set(range(1, 9))  # every count from 1 to 8 is drawn
