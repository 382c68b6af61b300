"""φ fitted in the deployment world (lopd_core/distill/composer/world_fit.py): the text teacher's trajectory seen as the
student sees it, retrieval that never reads a task's own rows, and a fit that moves the latent reading toward the
text reading (KL falls, NLL plays no part). Tiny fixtures; seconds."""

import copy

import pytest
import torch

from lopd_core.distill.composer.coldstart import train_coldstart
from lopd_core.distill.composer.coldstart_data import Success
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.composer.world_fit import cached_retriever, strip_experience_block, text_teacher_targets
from lopd_core.distill.scoring.teacher import Framing
from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout


def test_the_text_teachers_trajectory_is_the_students_without_its_block(tiny_model, tiny_tokenizer):
    """The same task played greedily with and without experiences: cutting the block out of the text teacher's
    ids leaves a student-view trajectory whose prompt is exactly the plain one."""
    codec = ChatCodec(tiny_tokenizer)
    task = make_tasks("toolworld", "train", 1, seed=3)[0]
    sampling = Sampling(temperature=0.0, max_new_tokens=8, max_context=512)
    plain = rollout(tiny_model, codec, [RolloutRequest(task)], sampling=sampling)[0]
    read = rollout(tiny_model, codec, [RolloutRequest(task, experiences=("a row", "b row"))], sampling=sampling)[0]
    ids, mask = strip_experience_block(
        list(read.token_ids), list(read.action_mask), Framing.from_tokenizer(tiny_tokenizer)
    )
    assert len(ids) == len(mask) < len(read.token_ids)
    assert ids[: plain.prompt_length] == list(plain.token_ids[: plain.prompt_length])
    assert sum(mask) == sum(read.action_mask)  # every sampled token kept, none added
    framing = Framing.from_tokenizer(tiny_tokenizer)
    assert framing.exp_start not in ids and framing.exp_end not in ids
    assert strip_experience_block(ids, mask, framing) == (ids, mask)  # no block: unchanged


def test_a_block_holding_sampled_tokens_is_refused(tiny_tokenizer):
    framing = Framing.from_tokenizer(tiny_tokenizer)
    ids = [1, framing.exp_start, 5, framing.exp_end, framing.newline, 7]
    with pytest.raises(ValueError, match="sampled tokens"):
        strip_experience_block(ids, [0, 0, 1, 0, 0, 1], framing)


def test_targets_that_read_nothing_are_dropped_and_retrieval_runs_once_per_task():
    tasks = make_tasks("toolworld", "train", 3, seed=1)
    targets = [Success([1], [1], t) for t in tasks for _ in range(2)]
    calls = []

    def retrieve(ts):
        calls.append([t.task_id for t in ts])
        return [[] if t is tasks[1] else [f"row of another task than {t.task_id}"] for t in ts]

    lookup, kept = cached_retriever(retrieve, targets)
    assert len(calls) == 1 and sorted(calls[0]) == sorted(t.task_id for t in tasks)
    assert [t.task.task_id for t in kept] == [tasks[0].task_id] * 2 + [tasks[2].task_id] * 2
    assert lookup([tasks[2]]) == [[f"row of another task than {tasks[2].task_id}"]]


def test_the_fit_moves_the_latent_reading_toward_the_text_reading(tiny_model, tiny_tokenizer):
    """KL(p_text ‖ p_latent) on the policy's own sampled trajectories falls over a short fit from a fresh φ, and
    with nll_weight 0 the loss is the KL alone (failures are read, never imitated)."""
    tasks = make_tasks("toolworld", "train", 4, seed=7)
    texts = {t.task_id: [f"{t.instruction[:40]} -> done"] for t in tasks}
    sampling = Sampling(temperature=1.0, max_new_tokens=12, max_context=512)
    targets = text_teacher_targets(
        tiny_model,
        tiny_tokenizer,
        tasks,
        [texts[t.task_id] for t in tasks],
        sampling=sampling,
        batch_size=4,
        seed=0,
        log=lambda *_: None,
    )
    assert len(targets) == 4
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=2, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    run = train_coldstart(
        model,
        tiny_tokenizer,
        composer,
        targets,
        lambda ts: [texts[t.task_id] for t in ts],
        steps=30,
        batch_size=4,
        lr=3e-3,
        kl_weight=1.0,
        nll_weight=0.0,
        seed=0,
        label="fit",
        log=lambda *_: None,
    )
    first, last = run.rows[0], run.rows[-1]
    assert all(abs(r["loss"] - r["kl"]) < 1e-6 for r in run.rows)  # the NLL is logged, not trained on
    assert last["kl"] < 0.8 * first["kl"], (first["kl"], last["kl"])
