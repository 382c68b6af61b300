"""Micro-batching changes memory and speed, not the mathematics: one `Distiller.update` over the batch in chunks
of 2 trajectories must apply the same student and composer parameters, and log the same row, as one update over
the whole batch (every loss is normalised by the whole batch's token count, so chunk gradients add up to the
whole-batch gradient). Uses the tiny fixtures and the Distiller construction of tests/distill/test_trainer.py."""

import copy
from dataclasses import asdict, replace

import pytest
import torch
from _batches import oracle_texts, six_trajectories

from lopd_core.config import Params
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.update import step as step_mod
from lopd_core.distill.update.batch import chunk_group, composer_chunks, micro_batches


@pytest.fixture(scope="module")
def batch(tiny_model, tiny_tokenizer):
    """Six trajectories (3 tasks × 2 samples) of different lengths, and two experiences per task."""
    tasks, trajs = six_trajectories(tiny_model, tiny_tokenizer)
    texts = oracle_texts(4)
    per_task = {t.instruction: texts[i % 3 : i % 3 + 2] for i, t in enumerate(tasks)}  # shared rows across tasks
    return tasks, trajs, lambda ts: [per_task[t.instruction] for t in ts]


def _distiller(tiny_model, tiny_tokenizer, retriever, tmp_path, **lopd):
    p = Params()
    p.seed = 0
    # the paper's LOPD, φ trained (the default method keeps φ = φ0); β > 0, so the δ̄ term reaches the composer's
    # gradient
    p.lopd = replace(
        p.lopd,
        **{
            "method": "lopd",
            "tasks_per_step": 3,
            "samples_per_task": 2,
            "steps": 1,
            "out_dir": str(tmp_path / "lopd"),
            "csv": str(tmp_path / "distill.csv"),
            "beta_init": 0.7,
            **lopd,
        },
    )
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    d = trainer_mod.Distiller(p, model, tiny_tokenizer, retriever, composer=composer, log=lambda m: None)
    # A student that already differs from the teacher (as after some training): with student == base the KL is
    # ~1e-6, pure float32 rounding, and no comparison of it would mean anything.
    # The composer is moved off φ0 too, so the anchor term has a gradient.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, q in [*d.trainable.named_parameters(), *d.composer.named_parameters()]:
            if q.requires_grad:
                q.add_(torch.randn(q.shape, generator=g) * (0.5 if "lora_B" in n else 0.05))
    # AdamW's first step is ≈ lr·sign(g) for |g| ≫ eps: a gradient component that is zero up to rounding would
    # move by ±lr on either side by chance. A larger eps makes the step proportional to the gradient, so equal
    # parameters mean equal accumulated gradients.
    for opt in (d.opt_theta, d.opt_phi):
        for group in opt.param_groups:
            group["eps"] = 1e-3
    return d


@pytest.mark.parametrize(
    "mode, loss, separate",
    [
        ("full", "topk", False),
        ("lora", "topk", False),
        ("full", "sampled", False),
        ("lora", "full", False),
        ("lora", "topk", True),
        ("lora", "topk", 1),
        ("full", "full", 1),
    ],
)
def test_micro_batches_give_the_whole_batch_update(tiny_model, tiny_tokenizer, batch, tmp_path, mode, loss, separate):
    """`separate`: True — low memory (s_old from a no-grad student forward, the teacher's graph consumed by the
    composer before the student's is built); 1 — also teacher passes of one trajectory (lopd.teacher_micro_batch),
    so a task's two samples no longer share one prompt pass."""
    tasks, trajs, retriever = batch
    kw = {"student_mode": mode, "student_loss": loss, "importance_weight": loss == "sampled"}
    whole = _distiller(tiny_model, tiny_tokenizer, retriever, tmp_path / "a", micro_batch=0, **kw)
    chunked = _distiller(
        tiny_model,
        tiny_tokenizer,
        retriever,
        tmp_path / "b",
        micro_batch=2,
        low_memory=separate is not False,
        teacher_micro_batch=0 if isinstance(separate, bool) else separate,
        **kw,
    )
    assert chunked.setup.low_memory == (separate is not False)  # lopd.low_memory, read at construction
    group = chunk_group(chunked.setup.samples_per_task, chunked.setup.share_prompt)  # as update.py cuts the batch
    assert len(micro_batches([len(t.token_ids) for t in trajs], chunked.setup.micro_batch, group)) == 3
    theta0 = {n: p.detach().clone() for n, p in whole.trainable.named_parameters() if p.requires_grad}
    out_a, out_b = whole.update(tasks, trajs), chunked.update(tasks, trajs)

    for name in ("trainable", "composer"):
        a = dict(getattr(whole, name).named_parameters())
        for n, p in getattr(chunked, name).named_parameters():
            torch.testing.assert_close(p, a[n], atol=1e-7, rtol=1e-5, msg=f"{name}.{n}")
    assert any(not torch.equal(p, theta0[n]) for n, p in chunked.trainable.named_parameters() if n in theta0)
    ra, rb = asdict(out_a.row), asdict(out_b.row)
    assert ra["anchor"] > 0 and ra["kl_phi"] > 1e-4 and ra["delta"] != 0
    assert ra.keys() == rb.keys()
    for k in ra:
        if k != "step_seconds":
            assert rb[k] == pytest.approx(ra[k], rel=2e-5, abs=1e-7, nan_ok=True), k  # replay_kl: NaN without replay
    assert chunked.state.beta == pytest.approx(whole.state.beta, rel=1e-6)
    for k in ("margin_success", "margin_failure", "latent_norm"):
        assert out_b.diagnostics[k] == pytest.approx(out_a.diagnostics[k], rel=1e-5, abs=1e-6), k


def test_tail_logsumexp_is_the_tail_of_topk_support_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(5, 40) * 3
    ids = logits.topk(6, dim=-1).indices
    support, tail = L.topk_support_logprobs(logits, ids)
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp.gather(-1, ids), support)
    torch.testing.assert_close(L.tail_logsumexp(lp, ids), tail)


def test_composer_fraction_trains_phi_on_a_subset_and_keeps_the_dual_ascent_whole(
    tiny_model, tiny_tokenizer, batch, tmp_path
):
    """`lopd.composer_fraction` < 1: only the picked chunks back-propagate into φ (rescaled to the batch), so φ
    moves differently from the full-batch update, while the student, δ̄ and β — computed on every chunk — do
    not change at all."""
    tasks, trajs, retriever = batch
    full = _distiller(tiny_model, tiny_tokenizer, retriever, tmp_path / "a", micro_batch=2)
    part = _distiller(tiny_model, tiny_tokenizer, retriever, tmp_path / "b", micro_batch=2, composer_fraction=0.34)
    seed = part.setup.seed * 1_000_003 + part.state.step  # as update.py picks this step's chunks
    picks = composer_chunks(3, part.setup.composer_fraction, seed)
    assert len(picks) == 1 and picks == composer_chunks(3, part.setup.composer_fraction, seed)
    phi0 = {n: p.detach().clone() for n, p in part.composer.named_parameters()}
    out_a, out_b = full.update(tasks, trajs), part.update(tasks, trajs)
    a = dict(full.trainable.named_parameters())
    for n, p in part.trainable.named_parameters():
        torch.testing.assert_close(p, a[n], atol=1e-7, rtol=1e-5, msg=n)
    for k in ("delta", "kl_phi", "distill_loss"):
        assert getattr(out_b.row, k) == pytest.approx(getattr(out_a.row, k), rel=2e-5, abs=1e-7), k
    assert part.state.beta == pytest.approx(full.state.beta, rel=1e-6)
    moved = [n for n, p in part.composer.named_parameters() if not torch.equal(p, phi0[n])]
    assert moved, "the picked chunk must still train the composer"
    fa = dict(full.composer.named_parameters())
    assert any(not torch.allclose(p, fa[n], atol=1e-7) for n, p in part.composer.named_parameters())


@pytest.mark.parametrize(
    "mode, method", [("lora", "lopd"), ("full", "lopd"), ("full", "text_experience"), ("full", "sdpo")]
)
def test_sharing_the_prompt_changes_no_update(tiny_model, tiny_tokenizer, batch, tmp_path, mode, method, monkeypatch):
    """lopd.share_prompt runs each task's prompt (and its latents or text) once for its samples: the update,
    β and every logged number must equal scoring every row from its first token."""
    tasks, trajs, retriever = batch
    prompts = []

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        prompts.append(out.prompts)
        return out

    real = step_mod.score_actions_shared
    monkeypatch.setattr(step_mod, "score_actions_shared", counted)
    kw = {"student_mode": mode, "method": method, "micro_batch": 4}
    plain = _distiller(tiny_model, tiny_tokenizer, retriever, tmp_path / "a", share_prompt=False, **kw)
    shared = _distiller(tiny_model, tiny_tokenizer, retriever, tmp_path / "b", share_prompt=True, **kw)
    out_a = plain.update(tasks, trajs)
    assert not prompts  # the plain distiller never takes the shared path
    out_b = shared.update(tasks, trajs)
    assert prompts and sum(prompts) < len(trajs)  # fewer prompts run than rows scored
    for name in ("trainable", "composer"):
        a = dict(getattr(plain, name).named_parameters())
        for n, p in getattr(shared, name).named_parameters():
            torch.testing.assert_close(p, a[n], atol=1e-6, rtol=1e-4, msg=f"{name}.{n}")
    ra, rb = asdict(out_a.row), asdict(out_b.row)
    assert ra["kl_phi"] > 1e-4
    for k in ra:
        if k != "step_seconds":
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6, nan_ok=True), k
    assert shared.state.beta == pytest.approx(plain.state.beta, rel=1e-5, abs=1e-7)
