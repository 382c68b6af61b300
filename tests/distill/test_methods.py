"""Baselines and ablations share the LOPD loop (lopd_core/methods.py): their losses on hand-worked
tensors, their text contexts, and one update per method on the tiny fixtures — the student moves, the
composer moves only where φ learns, β only where it acts, and a group without a success gives SDPO nothing."""

import copy
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lopd_core import methods as M
from lopd_core.config import Params
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring import pg_losses as PG
from lopd_core.distill.teacher import baselines as B
from lopd_core.envs import make_tasks, run_oracle
from lopd_core.experience import format_experience
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout


def test_group_relative_advantages_by_hand():
    # group 0: r = [1, 0] -> mean 0.5, std 0.5 -> ±1; group 1: r = [0.5, 0.5] -> 0 (no signal)
    adv = PG.group_relative_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_clipped_policy_loss_clips_and_has_the_policy_gradient():
    lp = torch.tensor([math.log(0.5), math.log(0.5)], requires_grad=True)
    old = torch.log(torch.tensor([0.25, 0.5]))  # ratios 2 and 1
    loss = PG.clipped_policy_loss(lp, old, torch.tensor([1.0, 1.0]), clip=0.2)
    # token 0: min(2·1, 1.2·1) = 1.2, clipped: no gradient; token 1: ratio 1 -> −1, gradient −ratio·A = −1
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.2, -1.0]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, -1.0]))


def test_reference_kl_k3_is_zero_at_equality_and_positive_elsewhere():
    s = torch.tensor([-1.0, -1.0])
    q = torch.tensor([-1.0, -2.0])  # d = −1: e^−1 + 1 − 1 = 0.3679
    torch.testing.assert_close(PG.reference_kl_k3(s, q), torch.tensor([0.0, math.exp(-1.0)]))


def test_every_method_is_a_spec_and_the_controls_say_what_they_are():
    assert set(M.METHOD_NAMES) == {
        "lopd",
        "grpo",
        "opsd",
        "sdpo",
        "skill_sd",
        "text_experience",
        "lopd_frozen_composer",
        "lopd_no_margin",
        "lopd_no_anchor",
        "sharpened_teacher",
        "lopd_random_retrieval",
        "lopd_rl",
        "lopd_then_grpo",
        "lopd_gated_refresh",
        "lopd_forward_kl",
        "lopd_mixed_kl",
        "lopd_rl_silent",
        "lopd_rlsd",
        "lopd_rl_annealed",
    }
    p = Params()
    assert M.method_spec("sharpened_teacher", p.baselines).teacher.temperature == 0.5
    assert M.method_spec("sdpo", p.baselines).teacher.weights == "ema"
    assert not M.method_spec("grpo").needs_teacher_pass and not M.method_spec("grpo").uses_bank
    with pytest.raises(ValueError, match="unknown method"):
        M.method_spec("ppo")


def test_the_methods_table_is_a_leaf_the_configuration_can_import():
    # lopd_core.config validates lopd.method against METHOD_NAMES: importing the table must not load the
    # configuration (a cycle), torch or the trainer
    code = (
        "import sys, lopd_core.methods as m; "
        "print(sorted(k for k in sys.modules if k.startswith(('lopd_core.', 'torch'))))"
    )
    root = Path(__file__).resolve().parents[2]  # `python -c` puts its working folder on the path
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.strip() == "['lopd_core.methods', 'lopd_core.offline']"


def test_every_text_context_has_one_builder():
    text = {c for c in M.TEACHER_CONTEXTS if c not in ("latent", "none")}
    assert set(B.CONTEXT_BUILDERS) == text
    assert {s.teacher.context for s in M.METHODS.values()} <= set(M.TEACHER_CONTEXTS)


def test_skill_text_keeps_the_tool_sequence_only():
    exp = [
        (
            '[aurora] pay Bob 5\nlookup_contact {"name": "Bob"} -> {"id": "c1"}\n'
            'bank_transfer {"to": "c1"} -> ok\nanswer: done'
        )
    ]
    assert B.skill_text(exp * 2) == "skill: lookup_contact -> bank_transfer -> answer"
    assert B.skill_text([]) == ""


def test_random_retrieval_is_seeded_per_task():
    tasks = make_tasks("toolworld", "train", 3, seed=5)
    r = B.random_retriever([f"row {i}" for i in range(20)], 3, seed=1)
    assert r(tasks) == r(list(tasks)) and len(r(tasks)[0]) == 3
    assert r(tasks) != B.random_retriever([f"row {i}" for i in range(20)], 3, seed=2)(tasks)


@pytest.fixture(scope="module")
def batch(tiny_model, tiny_tokenizer):
    """Four trajectories (2 tasks × 2 samples): group 0 has a success and a failure, group 1 two failures."""
    tasks = make_tasks("toolworld", "train", 2, seed=11)
    reqs = [RolloutRequest(t, sample_index=g) for t in tasks for g in range(2)]
    trajs = rollout(
        tiny_model,
        ChatCodec(tiny_tokenizer),
        reqs,
        sampling=Sampling(temperature=1.0, max_new_tokens=16, max_context=640),
        seed=3,
    )
    for i, t in enumerate(trajs):
        t.reward, t.success = [1.0, 0.0, 0.25, 0.0][i], i == 0
    texts = []
    for t in make_tasks("toolworld", "train", 3, seed=99):
        _, _, env = run_oracle(t)
        texts.append(format_experience(t.instruction, env.episode))
    return tasks, trajs, lambda ts: [texts[:2] for _ in ts]


def _distiller(tiny_model, tiny_tokenizer, retriever, tmp_path, method):
    p = Params()
    p.seed = 0
    p.lopd = replace(
        p.lopd,
        method=method,
        tasks_per_step=2,
        samples_per_task=2,
        steps=1,
        out_dir=str(tmp_path / "lopd"),
        csv=str(tmp_path / "distill.csv"),
        beta_init=0.5,
    )
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    d = trainer_mod.Distiller(p, model, tiny_tokenizer, retriever, composer=composer, log=lambda m: None)
    g = torch.Generator().manual_seed(1)  # a student that differs from the base, as after some training
    with torch.no_grad():
        for q in d.trainable.parameters():
            q.add_(torch.randn(q.shape, generator=g) * 0.05)
    return d


def _moved(module, before: dict) -> set[str]:
    return {n for n, p in module.named_parameters() if n in before and not torch.equal(p, before[n])}


def _unmoved(module, before: dict) -> set[str]:
    return set(before) - _moved(module, before)


@pytest.mark.parametrize("method", M.METHOD_NAMES)
def test_one_update_per_method(tiny_model, tiny_tokenizer, batch, tmp_path, method):
    tasks, trajs, retriever = batch
    d = _distiller(tiny_model, tiny_tokenizer, retriever, tmp_path, method)
    spec = d.method
    theta0 = {n: p.detach().clone() for n, p in d.trainable.named_parameters() if p.requires_grad}
    frozen0 = {n: p.detach().clone() for n, p in d.teacher.lm.named_parameters() if not p.requires_grad}
    phi0 = {n: p.detach().clone() for n, p in d.composer.named_parameters()}
    ema0 = {n: p.detach().clone() for n, p in d.ema_lm.named_parameters()} if d.ema_lm is not None else {}
    out = d.update(tasks, trajs)
    row = out.row
    assert math.isfinite(row.distill_loss) and d.state.skipped_updates == 0
    # every parameter that learns moved (every method has a signal here), and none that is frozen did
    assert theta0 and _unmoved(d.trainable, theta0) == set(), "student parameters that did not move"
    assert _moved(d.teacher.lm, frozen0) == set(), "the frozen teacher's weights moved"
    phi_unmoved = _unmoved(d.composer, phi0)
    assert phi_unmoved == (set(phi0) if not spec.composer.trainable else set()), phi_unmoved
    assert _unmoved(d.ema_lm, ema0) == set() if ema0 else d.ema_lm is None
    assert (d.state.beta != 0.5) == spec.composer.trainable or row.delta == pytest.approx(d.margin)
    if spec.teacher.context == "latent":
        assert row.latent_norm_ratio == pytest.approx(1.0, rel=1e-3)
    if not d.teacher_pass:
        assert math.isnan(row.delta)
    else:  # δ̄ = mean over trajectories of A(τ) g(τ), from the per-trajectory gaps the update returns
        gaps = torch.tensor(out.trajectory_gaps, dtype=torch.float64)
        n = torch.tensor([sum(t.action_mask[1:]) for t in trajs], dtype=torch.float64)
        adv = L.advantages(torch.tensor([t.reward for t in trajs])).double()
        assert len(gaps) == len(trajs) and gaps.abs().sum() > 0
        assert row.delta == pytest.approx(float((adv * gaps)[n > 0].mean()), rel=1e-4, abs=1e-7)


def test_a_new_method_is_one_row(tiny_model, tiny_tokenizer, batch, tmp_path, monkeypatch):
    """Adding a method is one row of the methods table: here a control that reads the retrieved experiences as
    text at a sharpened temperature. Nothing else is written for it, yet the trainer trains it (its teacher reads
    text, φ stays φ0, β stays put), and the compare report lists it with the controls and sets the reference
    method against it."""
    from lopd_core.compare.report import _verdict, by_role

    row = M.MethodSpec("sharpened_text", "control", M.TeacherSetup("text_experience", temperature=0.5))
    monkeypatch.setitem(M.METHODS, row.name, row)
    tasks, trajs, retriever = batch
    d = _distiller(tiny_model, tiny_tokenizer, retriever, tmp_path, row.name)
    assert d.method.name == row.name and d.method.teacher == row.teacher  # resolved from the row
    theta0 = {n: p.detach().clone() for n, p in d.trainable.named_parameters() if p.requires_grad}
    phi0 = {n: p.detach().clone() for n, p in d.composer.named_parameters()}
    out = d.update(tasks, trajs)
    assert math.isfinite(out.row.distill_loss) and math.isfinite(out.row.kl_phi) and out.row.teacher_entropy > 0
    assert _unmoved(d.trainable, theta0) == set() and _moved(d.composer, phi0) == set() and d.state.beta == 0.5
    assert by_role(["sharpened_text", "lopd_no_margin", "grpo", "lopd"]) == [
        "lopd",
        "grpo",
        "lopd_no_margin",
        "sharpened_text",
    ]
    cell = {"success_rate": 0.5, "reward_mean": 0.5, "n": 10}
    run = {"final": {s: {"greedy": cell, "sampled": cell} for s in ("test_id", "test_ood")}}
    lines = _verdict({"lopd": [run], "sharpened_text": [run]})
    assert lines[0].startswith("- LOPD − sharpened_text") and "controls (sharpened_text)" in lines[-1]


def test_sdpo_takes_no_signal_from_a_group_without_success(tiny_model, tiny_tokenizer, batch, tmp_path):
    tasks, trajs, retriever = batch
    failed = [copy.copy(t) for t in trajs]
    for t in failed:
        t.success = False
    d = _distiller(tiny_model, tiny_tokenizer, retriever, tmp_path, "sdpo")
    theta0 = {n: p.detach().clone() for n, p in d.trainable.named_parameters()}
    row = d.update(tasks, failed).row
    assert row.distill_loss == 0.0
    assert all(torch.equal(p, theta0[n]) for n, p in d.trainable.named_parameters())


def test_text_experience_teacher_reads_the_retrieved_text(tiny_model, tiny_tokenizer, batch, tmp_path):
    # The text-experience teacher's input is the conversation with the retrieved experiences in its first user
    # turn, so its log-probs equal a plain forward of the frozen base over that conversation.
    tasks, trajs, retriever = batch
    spec = M.method_spec("text_experience")
    contexts = B.text_contexts(spec, tasks, trajs, retriever(tasks), 2)
    assert contexts[0] == "\n".join(retriever(tasks)[0])
    golden = B.text_contexts(M.method_spec("opsd"), tasks, trajs, retriever(tasks), 2)
    assert golden[0] == golden[1] and golden[0].startswith(tasks[0].instruction)
    sib = B.sibling_texts(trajs, 2)
    assert sib[0] == sib[1] and sib[2] is None and sib[3] is None  # group 0's success, group 1 has none
