"""The optimised update (update.py: micro-batches, one teacher pass shared by steps 2 and 4, a task's prompt
shared by its samples, latents composed once per distinct text, loss_φ back-propagated in pieces) equals the
reference (reference.py: the same update read top to bottom) on the same batch, for every method of the methods
table, in the default tier: θ and φ after the step, β, and every numeric field of the dashboard row but the time.
Both run through `Distiller.update`: the reference because its distiller is in the simple configuration
(lopd.micro_batch 0, no shared prompt, one process), which is what the trainer runs there.

Both run on copies of one tiny model, composer and batch (tests/_batches.py), in float64 so that the
differences left are summation order, far below the 1e-5 asked. Each method says what the comparison covers
(`COMPARED`): the policy-gradient methods run the same reference with their own loss (student_token_loss), so
their student step is compared like LOPD's; what differs is which parts have nothing to compare.
"""

import copy
import math
from dataclasses import asdict

import pytest
import torch
from _batches import oracle_texts, six_trajectories, step_params

from lopd_core import methods as M
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import trainer as trainer_mod

LATENT = "latent teacher, φ learns: θ, φ, β and the whole row"
COMPARED = {
    "lopd": LATENT,
    "lopd_no_margin": LATENT + " (m = 0)",
    "lopd_no_anchor": LATENT + " (λ = 0: the anchor is reported, not trained)",
    "lopd_random_retrieval": LATENT + " (the retriever is the test's, as for lopd)",
    "lopd_rl": LATENT + "; the student loss adds the GRPO term",
    "lopd_then_grpo": LATENT + " (step 1 is in the LOPD phase)",
    "lopd_gated_refresh": LATENT + " (the refresh check runs in step(), after the update)",
    "lopd_forward_kl": LATENT + "; the student loss is the forward KL",
    "lopd_mixed_kl": LATENT + "; the student loss is the mixed KL",
    "lopd_rl_silent": LATENT + "; the KL term only on groups whose rewards are all equal, plus the GRPO term",
    "lopd_rlsd": LATENT + "; the student loss is GRPO's with RLSD's teacher-sized advantages",
    "lopd_rl_annealed": LATENT + "; lopd_rl with the distillation weight of a teacher never measured (1)",
    "lopd_frozen_composer": "latent teacher, φ = φ0: θ and the row; φ and β must stay where they were",
    "grpo": "no teacher pass: θ by GRPO's clipped loss; φ and β unchanged; the teacher's columns NaN in both",
    "opsd": "text teacher (the oracle's solution): θ and the row (KL, δ̄ of the text teacher); φ, β unchanged",
    "sdpo": "text teacher (a sibling success), EMA weights: θ, the EMA and the row; a group without success "
    "gives no signal in both",
    "skill_sd": "text teacher (a skill), the live student's weights: θ by GRPO + its KL, and the row",
    "text_experience": "text teacher (the retrieved texts): θ and the row; φ, β unchanged",
    "sharpened_teacher": "teacher without context at temperature 0.5: θ and the row; φ, β unchanged",
}
TOL = 1e-5


def test_every_method_says_what_is_compared():
    assert set(COMPARED) == set(M.METHOD_NAMES)


@pytest.fixture(scope="module")
def batch(tiny_model, tiny_tokenizer):
    tasks, trajs = six_trajectories(tiny_model, tiny_tokenizer)
    texts = oracle_texts(3)
    return tasks, trajs, lambda ts: [texts[:2] for _ in ts]


def _distiller(tmp_path, method, tiny_model, tiny_tokenizer, retriever, *, simple: bool):
    """`simple`: the configuration the trainer runs reference.py in; else the optimised path, in chunks of 2."""
    knobs = {"micro_batch": 0, "share_prompt": False} if simple else {"micro_batch": 2}
    params = step_params(tmp_path, method=method, **knobs)
    model = copy.deepcopy(tiny_model).double()
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    ).double()
    d = trainer_mod.Distiller(params, model, tiny_tokenizer, retriever, composer=composer, log=lambda m: None)
    # A student that differs from the teacher and the sampler, and a composer away from φ0 (as after some
    # training), so that the anchor term has a gradient to compare.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for q in list(d.trainable.parameters()) + list(d.composer.parameters()):
            q.add_(torch.randn(q.shape, generator=g, dtype=q.dtype) * 0.05)
    return d


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= TOL * max(1.0, abs(b))


@pytest.mark.parametrize("method", M.METHOD_NAMES, ids=str)
def test_the_optimised_update_equals_the_reference(tmp_path, tiny_model, tiny_tokenizer, batch, method):
    tasks, trajs, retriever = batch
    fast = _distiller(tmp_path / "fast", method, tiny_model, tiny_tokenizer, retriever, simple=False)
    slow = _distiller(tmp_path / "slow", method, tiny_model, tiny_tokenizer, retriever, simple=True)
    assert slow.setup.runs_reference and not fast.setup.runs_reference
    theta0 = {n: p.detach().clone() for n, p in fast.trainable.named_parameters() if p.requires_grad}
    phi0 = {n: p.detach().clone() for n, p in fast.composer.named_parameters()}
    beta0 = fast.state.beta
    got = asdict(fast.update(tasks, trajs).row)
    want = asdict(slow.update(tasks, trajs).row)
    assert fast.state.skipped_updates == slow.state.skipped_updates == 0
    different = {k: (got[k], want[k]) for k in got if k != "step_seconds" and not _close(got[k], want[k])}
    assert not different, different
    for name in ("trainable", "composer") + (("ema_lm",) if fast.ema_lm is not None else ()):
        reference = dict(getattr(slow, name).named_parameters())
        for n, p in getattr(fast, name).named_parameters():
            torch.testing.assert_close(p, reference[n], atol=TOL, rtol=TOL, msg=f"{name}.{n}")
    assert fast.state.beta == pytest.approx(slow.state.beta, abs=TOL)
    # the comparison is not of two updates that did nothing: every θ moved, and φ and β moved where they learn
    assert all(not torch.equal(p, theta0[n]) for n, p in fast.trainable.named_parameters() if n in theta0)
    learns = fast.method.composer.trainable
    assert all(torch.equal(p, phi0[n]) != learns for n, p in fast.composer.named_parameters()), COMPARED[method]
    assert (fast.state.beta != beta0) == learns, COMPARED[method]
    # the reading term (lopd.text_kl_weight, on by default) is part of what is compared where φ learns
    assert (got["kl_text"] > 0) == learns, got["kl_text"]


# Retrieval that reads nothing for some tasks, or for every task: the step must run (no NaN from a mean over no
# latents, no skipped update) and the two updates must still agree (#45: a batch without experience made the
# reference's anchor NaN and stopped small runs as diverged). `replayed`: every task finds experience, but task 1
# is a replay task (lopd.replay_share, replay.py), which reads none; its KL to the teacher is `replay_kl`.
PARTIAL_READS = {"none": lambda i: False, "some": lambda i: i % 2 == 1, "replayed": lambda i: True}


@pytest.mark.parametrize("reads", sorted(PARTIAL_READS), ids=str)
@pytest.mark.parametrize("method", M.METHOD_NAMES, ids=str)
def test_batches_that_read_little_or_no_experience(tmp_path, tiny_model, tiny_tokenizer, batch, method, reads):
    tasks, trajs, _ = batch
    texts = oracle_texts(3)
    keep = PARTIAL_READS[reads]

    def retriever(ts):
        return [texts[:2] if keep(i) else [] for i, _ in enumerate(ts)]

    fast = _distiller(tmp_path / "fast", method, tiny_model, tiny_tokenizer, retriever, simple=False)
    slow = _distiller(tmp_path / "slow", method, tiny_model, tiny_tokenizer, retriever, simple=True)
    if reads == "replayed":
        for d in (fast, slow):
            d.models.is_replay = lambda t: t == tasks[1]
    got = asdict(fast.update(tasks, trajs).row)
    want = asdict(slow.update(tasks, trajs).row)
    assert fast.state.skipped_updates == slow.state.skipped_updates == 0
    different = {k: (got[k], want[k]) for k in got if k != "step_seconds" and not _close(got[k], want[k])}
    assert not different, different
    assert math.isfinite(got["replay_kl"]) == (reads == "replayed" and fast.setup.teacher_pass), got["replay_kl"]
    for name in ("trainable", "composer"):
        reference = dict(getattr(slow, name).named_parameters())
        for n, p in getattr(fast, name).named_parameters():
            torch.testing.assert_close(p, reference[n], atol=TOL, rtol=TOL, msg=f"{name}.{n}")
    assert fast.state.beta == pytest.approx(slow.state.beta, abs=TOL)
    assert math.isfinite(got["distill_loss"]) and math.isfinite(got["anchor"])
