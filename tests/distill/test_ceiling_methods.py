"""Past the teacher's ceiling (issue #29 item 4): methods of the one loop beyond `lopd_rl`.

  * `lopd_then_grpo`: LOPD steps, then GRPO steps on the same student (no teacher pass after the switch), and a
    run resumed across the switch prints the uninterrupted run's numbers;
  * `lopd_gated_refresh`: θ̄ ← student only where the held-out check shows the student ahead (the check's
    result injected for speed), the check itself on the tiny model, the LoRA merge, the refreshed teacher in
    the checkpoint;
  * `lopd_forward_kl` / `lopd_mixed_kl`: the forward and mixed top-k losses worked by hand on a 3-token
    vocabulary; a mix with w = 0 is the reverse KL, bit for bit.
Uses the tiny fixtures of tests/conftest.py.
"""

from __future__ import annotations

import copy
import csv
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lopd_core import methods as M
from lopd_core.config import ConfigError, Params, load_params
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import loop as loop_mod
from lopd_core.distill.loop import teacher_refresh as R
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.update import step as S
from lopd_core.envs import make_tasks, run_oracle
from lopd_core.experience import format_experience
from lopd_core.model.chat import ChatCodec

LN2 = math.log(2.0)

# ---- forward and mixed KL, by hand --------------------------------------------------------------------------

# A 3-token vocabulary. Teacher p_T = (0.5, 0.3, 0.2), its top-2 ids (0, 1), tail bucket {2} of mass 0.2; student
# p_S = (0.25, 0.25, 0.5). With K + 1 = V the buckets are the tokens, so the bucketed KLs are the exact ones:
#   reverse KL(p_S ‖ p_T) = 0.25 ln(0.25/0.5) + 0.25 ln(0.25/0.3) + 0.5 ln(0.5/0.2)
#   forward KL(p_T ‖ p_S) = 0.5 ln(0.5/0.25) + 0.3 ln(0.3/0.25) + 0.2 ln(0.2/0.5)
# and the forward KL's gradient in the student's logits is p_S − p_T = (−0.25, −0.05, 0.3).
P_T = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
P_S = torch.tensor([[0.25, 0.25, 0.5]], dtype=torch.float64)
REVERSE = 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(0.25 / 0.3) + 0.5 * math.log(0.5 / 0.2)
FORWARD = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.5)


def _teacher_top(k: int):
    ids = torch.tensor([[0, 1][:k]])
    return torch.log(P_T).gather(-1, ids), ids


def test_forward_kl_by_hand_on_three_tokens():
    t_lp, ids = _teacher_top(2)
    logits = torch.log(P_S).clone().requires_grad_(True)
    fwd = L.forward_kl_topk(logits, t_lp, ids)
    torch.testing.assert_close(fwd.detach(), torch.tensor([FORWARD], dtype=torch.float64))
    assert pytest.approx(REVERSE) != FORWARD  # the two directions differ here
    torch.testing.assert_close(
        L.reverse_kl_topk(logits, t_lp, ids).detach(), torch.tensor([REVERSE], dtype=torch.float64)
    )
    fwd.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.25, -0.05, 0.3]], dtype=torch.float64))


def test_forward_kl_tail_bucket_by_hand():
    # top-1: the support is token 0; the tail merges tokens 1 and 2: teacher 0.5, student 0.75.
    # forward KL = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3)
    t_lp, ids = _teacher_top(1)
    got = L.forward_kl_topk(torch.log(P_S), t_lp, ids)
    torch.testing.assert_close(got, torch.tensor([0.5 * math.log(4.0 / 3.0)], dtype=torch.float64))


def test_mixed_kl_by_hand_and_its_ends_are_the_pure_losses_exactly():
    t_lp, ids = _teacher_top(2)
    logits = torch.log(P_S)
    mixed = L.mixed_kl_topk(logits, t_lp, ids, weight=0.25)
    torch.testing.assert_close(mixed, torch.tensor([0.75 * REVERSE + 0.25 * FORWARD], dtype=torch.float64))
    torch.manual_seed(0)
    s_logits, teacher = torch.randn(7, 13), torch.log_softmax(torch.randn(7, 13), -1)
    top = teacher.topk(4, -1)
    assert torch.equal(
        L.mixed_kl_topk(s_logits, top.values, top.indices, weight=0.0),
        L.reverse_kl_topk(s_logits, top.values, top.indices),
    )
    assert torch.equal(
        L.mixed_kl_topk(s_logits, top.values, top.indices, weight=1.0),
        L.forward_kl_topk(s_logits, top.values, top.indices),
    )
    with pytest.raises(ValueError, match="weight"):
        L.mixed_kl_topk(s_logits, top.values, top.indices, weight=1.5)


def _loss(method: str, **lopd) -> S.StudentLoss:
    params = load_params("params.yaml", [f"lopd.method={method}", *(f"lopd.{k}={v}" for k, v in lopd.items())])
    return S.StudentLoss.resolve(M.resolve_method(params.lopd, params.baselines), params.lopd, params.baselines)


def test_each_method_resolves_its_mix_and_the_step_loss_takes_it():
    assert _loss("lopd").kl_mix == 0.0 and _loss("lopd_rl").kl_mix == 0.0
    assert _loss("lopd_forward_kl").kl_mix == 1.0
    assert _loss("lopd_mixed_kl").kl_mix == 0.5  # the method's own w while lopd.kl_mix is left at 0
    assert _loss("lopd_mixed_kl", kl_mix=0.3).kl_mix == 0.3  # a w set in the section is that method's w
    assert _loss("lopd", kl_mix=0.2).kl_mix == 0.2
    assert _loss("grpo").kl_mix == 0.0
    torch.manual_seed(1)
    logits, teacher = torch.randn(5, 11), torch.log_softmax(torch.randn(5, 11), -1)
    top = teacher.topk(3, -1)
    actions = torch.randint(0, 11, (5,))
    targets = S.StudentTargets(top.values, top.indices, teacher.gather(-1, actions[:, None]).squeeze(-1))
    assert torch.equal(
        S.student_token_loss(logits, actions, targets, _loss("lopd")),
        L.reverse_kl_topk(logits, top.values, top.indices),
    )
    torch.testing.assert_close(
        S.student_token_loss(logits, actions, targets, _loss("lopd_mixed_kl")),
        L.mixed_kl_topk(logits, top.values, top.indices, weight=0.5),
    )
    torch.testing.assert_close(
        S.student_token_loss(logits, actions, targets, _loss("lopd_forward_kl")),
        L.forward_kl_topk(logits, top.values, top.indices),
    )


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["lopd.method=grpo", "lopd.kl_mix=0.5"], ["lopd.kl_mix", "GRPO"]),
        (["lopd.method=lopd_forward_kl", "lopd.student_loss=full"], ["lopd.student_loss", "'topk'"]),
        (["lopd.kl_mix=0.5", "lopd.student_loss=sampled"], ["lopd.student_loss", "top-k"]),
        (["lopd.method=lopd_forward_kl", "lopd.kl_mix=0.3"], ["lopd.kl_mix", "lopd_mixed_kl"]),
        (["lopd.kl_mix=1.5"], ["lopd.kl_mix"]),
        (["baselines.switch_fraction=1.5"], ["baselines.switch_fraction"]),
        (["baselines.refresh_metric=loss"], ["baselines.refresh_metric"]),
    ],
)
def test_meaningless_mixes_and_settings_fail_at_load(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        load_params("params.yaml", overrides)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_every_new_method_is_in_params_yaml_and_its_presets():
    params = load_params("params.yaml")
    new = {"lopd_then_grpo", "lopd_gated_refresh", "lopd_forward_kl", "lopd_mixed_kl"}
    assert new <= set(M.METHOD_NAMES)
    for preset in ("full", "smoke"):
        assert set(params.compare.presets[preset].methods) == set(M.METHOD_NAMES)
    text = Path("params.yaml").read_text()
    start = text.index("\nlopd:")
    listing = text[start : text.index("\n  steps:", start)]  # the comment listing lopd.method's values
    assert all(name in listing for name in M.METHOD_NAMES)
    b = params.baselines
    assert (
        b.switch_fraction,
        b.refresh_check_every,
        b.refresh_check_n,
        b.refresh_min_gain,
        b.refresh_metric,
        params.lopd.kl_mix,
    ) == (0.5, 16, 16, 0.0, "success", 0.0)


# ---- the trainer: tiny runs ---------------------------------------------------------------------------------


def _params(tmp_path, method: str, steps: int = 4, **baselines) -> Params:
    p = Params()
    p.seed = 0
    p.rollout = replace(p.rollout, max_new_tokens=24, max_context=640)
    p.lopd = replace(
        p.lopd,
        method=method,
        tasks_per_step=2,
        samples_per_task=2,
        steps=steps,
        checkpoint_every=1,
        out_dir=str(tmp_path / "lopd"),
        csv=str(tmp_path / "plots" / "distill.csv"),
    )
    p.baselines = replace(p.baselines, **baselines)
    return p


@pytest.fixture(scope="module")
def retriever():
    texts = []
    for t in make_tasks("toolworld", "train", 2, seed=99):
        _, _, env = run_oracle(t)
        texts.append(format_experience(t.instruction, env.episode))
    return lambda tasks: [texts for _ in tasks]


def _distiller(params, tiny_model, tiny_tokenizer, retriever):
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    return trainer_mod.Distiller(params, model, tiny_tokenizer, retriever, composer=composer, log=lambda m: None)


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def _count_teacher_passes(monkeypatch):
    """The steps (0-based: `counting.step`, set by the caller) at which a teacher pass scored rows."""
    calls: list[int] = []
    original = S.score_teacher

    def counting(*args, **kwargs):
        calls.append(counting.step)
        return original(*args, **kwargs)

    counting.step = -1
    monkeypatch.setattr(S, "score_teacher", counting)
    return calls, counting


def test_lopd_then_grpo_trains_lopd_then_grpo_without_a_teacher(
    tmp_path, tiny_model, tiny_tokenizer, retriever, monkeypatch
):
    params = _params(tmp_path, "lopd_then_grpo", steps=4, switch_fraction=0.5)
    d = _distiller(params, tiny_model, tiny_tokenizer, retriever)
    calls, counting = _count_teacher_passes(monkeypatch)
    phi, betas = [], []
    original_update = d.update

    def update(*args, **kwargs):  # record which step ran each teacher pass, and φ, β before it
        counting.step = d.state.step
        phi.append({n: p.detach().clone() for n, p in d.composer.named_parameters()})
        betas.append(d.state.beta)
        return original_update(*args, **kwargs)

    d.update = update
    loop_mod.run_distill(d)
    rows = _rows(params.lopd.csv)
    assert [int(r["phase"]) for r in rows] == [0, 0, 1, 1]
    assert sorted(set(calls)) == [0, 1]  # teacher passes in the LOPD steps only
    for r in rows[:2]:
        assert math.isfinite(float(r["kl_phi"])) and math.isfinite(float(r["teacher_entropy"]))
    for r in rows[2:]:  # no teacher from the switch on: its columns are empty
        assert math.isnan(float(r["kl_phi"])) and math.isnan(float(r["teacher_entropy"]))
    assert d.method.name == "grpo" and not d.teacher_pass and d.student_loss.kind == "grpo"
    # φ and β move in the LOPD steps and stand still in the GRPO ones
    end = {n: p.detach().clone() for n, p in d.composer.named_parameters()}
    assert any(not torch.equal(phi[0][n], phi[1][n]) for n in end)
    assert all(torch.equal(phi[2][n], phi[3][n]) and torch.equal(phi[3][n], end[n]) for n in end)
    assert betas[2] == betas[3] == d.state.beta


@pytest.mark.parametrize("stop_after", [1, 3])  # a checkpoint before the switch, and one after it
def test_lopd_then_grpo_resumes_across_the_switch(tmp_path, tiny_model, tiny_tokenizer, retriever, stop_after):
    full = _params(tmp_path / "a", "lopd_then_grpo", steps=4)
    loop_mod.run_distill(_distiller(full, tiny_model, tiny_tokenizer, retriever))
    split = _params(tmp_path / "b", "lopd_then_grpo", steps=4)
    loop_mod.run_distill(_distiller(split, tiny_model, tiny_tokenizer, retriever), stop_after=stop_after)
    resumed = _distiller(split, tiny_model, tiny_tokenizer, retriever)
    assert resumed.load_checkpoint() and resumed.state.step == stop_after
    state = loop_mod.run_distill(resumed)
    assert state.step == 4 and resumed.method.name == "grpo"
    drop = {"step_seconds"}
    a = [{k: v for k, v in r.items() if k not in drop} for r in _rows(full.lopd.csv)]
    b = [{k: v for k, v in r.items() if k not in drop} for r in _rows(split.lopd.csv)]
    assert a == b and [r["phase"] for r in b] == ["0", "0", "1", "1"]


def test_the_switch_step_is_a_share_of_lopd_steps():
    p = Params()
    spec = M.method_spec("lopd_then_grpo")
    for steps, fraction, switch in [(4, 0.5, 2), (1, 0.5, 1), (10, 0.25, 3), (8, 0.0, 0), (8, 1.0, 8)]:
        p.lopd, p.baselines = replace(p.lopd, steps=steps), replace(p.baselines, switch_fraction=fraction)
        assert M.switch_step(spec, p.lopd, p.baselines) == switch
        assert [M.phase_at(spec, s, p.lopd, p.baselines) for s in range(steps)] == [0] * switch + [1] * (steps - switch)
    assert M.switch_step(M.method_spec("lopd"), p.lopd, p.baselines) is None
    p.lopd = replace(p.lopd, method="lopd_then_grpo")
    first, second = M.method_phases(M.resolve_method(p.lopd, p.baselines), p.lopd, p.baselines)
    assert first.needs_teacher_pass and not second.needs_teacher_pass and second.name == "grpo"


def _scripted(scores: list[float], seen: list):
    """A scorer that returns success rates in the order asked, recording which model it scored."""

    def score(lm):
        seen.append(lm)
        value = scores.pop(0)
        return R.CheckScore(value, value, 4)

    return score


def _weights(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gated_refresh_refreshes_only_when_the_student_is_ahead(tmp_path, tiny_model, tiny_tokenizer, retriever):
    params = _params(tmp_path, "lopd_gated_refresh", steps=4, refresh_check_every=1)
    d = _distiller(params, tiny_model, tiny_tokenizer, retriever)
    seen: list = []
    # check 1: student .25 vs teacher .5 -> kept; check 2: .75 vs .5 -> refreshed; check 3: .75 vs the refreshed
    # teacher's .75 (the student that was scored) -> a tie, kept; check 4: 1.0 vs .75 -> refreshed
    d.refresh_scorer = _scripted([0.25, 0.5, 0.75, 0.75, 1.0], seen)
    base = _weights(d.teacher.lm)
    snapshots = []
    original_check = d._refresh_check

    def check(out):
        original_check(out)
        snapshots.append((_weights(d.teacher.lm), _weights(d.student)))

    d._refresh_check = check
    loop_mod.run_distill(d)
    assert seen[0] is d.student and seen[1] is d.teacher.lm and all(m is d.student for m in seen[2:])
    assert [c["refreshed"] for c in d.state.refresh_checks] == [False, True, False, True]
    assert [c["teacher"]["success_rate"] for c in d.state.refresh_checks] == [0.5, 0.5, 0.75, 0.75]
    assert [int(r["teacher_refreshes"]) for r in _rows(params.lopd.csv)] == [0, 1, 1, 2]
    diag = _rows(params.lopd.csv.replace("distill.csv", "distill_diagnostics.csv"))
    assert [float(r["refresh_student"]) for r in diag] == [0.25, 0.75, 0.75, 1.0]
    teacher1, student1 = snapshots[0]
    assert _same(teacher1, base) and not _same(student1, base)  # kept: θ̄ is still the start
    teacher2, student2 = snapshots[1]
    assert _same(teacher2, student2)  # refreshed: θ̄ is the student of that check
    assert not _same(snapshots[2][0], snapshots[2][1]) and _same(snapshots[2][0], teacher2)
    assert _same(snapshots[3][0], snapshots[3][1])


def test_gated_refresh_never_refreshes_a_student_behind_or_level(tmp_path, tiny_model, tiny_tokenizer, retriever):
    params = _params(tmp_path, "lopd_gated_refresh", steps=2, refresh_check_every=1, refresh_min_gain=0.1)
    d = _distiller(params, tiny_model, tiny_tokenizer, retriever)
    d.refresh_scorer = _scripted([0.5, 0.5, 0.55], [])  # level, then ahead by less than the minimum gain
    base = _weights(d.teacher.lm)
    loop_mod.run_distill(d)
    assert d.state.teacher_refreshes == 0 and _same(_weights(d.teacher.lm), base)
    assert [c["refreshed"] for c in d.state.refresh_checks] == [False, False]


def test_checks_run_every_refresh_check_every_steps(tmp_path, tiny_model, tiny_tokenizer, retriever):
    params = _params(tmp_path, "lopd_gated_refresh", steps=3, refresh_check_every=2)
    d = _distiller(params, tiny_model, tiny_tokenizer, retriever)
    d.refresh_scorer = _scripted([1.0, 0.0], [])
    loop_mod.run_distill(d)
    assert [c["step"] for c in d.state.refresh_checks] == [2]
    assert [int(r["teacher_refreshes"]) for r in _rows(params.lopd.csv)] == [0, 1, 1]


def test_a_refreshed_teacher_is_in_the_checkpoint(tmp_path, tiny_model, tiny_tokenizer, retriever):
    params = _params(tmp_path, "lopd_gated_refresh", steps=2, refresh_check_every=1)
    d = _distiller(params, tiny_model, tiny_tokenizer, retriever)
    d.refresh_scorer = _scripted([1.0, 0.0], [])
    loop_mod.run_distill(d, stop_after=1)
    assert d.state.teacher_refreshes == 1
    resumed = _distiller(params, tiny_model, tiny_tokenizer, retriever)
    assert not _same(_weights(resumed.teacher.lm), _weights(d.teacher.lm))  # rebuilt: the start's θ̄
    assert resumed.load_checkpoint()
    assert _same(_weights(resumed.teacher.lm), _weights(d.teacher.lm))
    assert resumed.state.refresh_teacher_score == {"success_rate": 1.0, "reward_mean": 1.0, "n": 4}
    resumed.refresh_scorer = _scripted([1.0], [])  # the teacher is not scored again: its score is kept
    loop_mod.run_distill(resumed)
    assert [c["refreshed"] for c in resumed.state.refresh_checks] == [True, False]


def test_lora_refresh_merges_the_adapter_and_starts_a_fresh_one(tmp_path, tiny_model, tiny_tokenizer, retriever):
    params = _params(tmp_path, "lopd_gated_refresh", steps=2, refresh_check_every=1)
    params.lopd = replace(params.lopd, student_mode="lora", lora_rank=2)
    d = _distiller(params, tiny_model, tiny_tokenizer, retriever)
    d.refresh_scorer = _scripted([1.0, 0.0, 0.5], [])
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    logits = {}
    original_check = d._refresh_check

    def check(out):
        with torch.no_grad():
            logits["before"] = d.student(ids).logits
        original_check(out)
        with torch.no_grad():
            logits["student"] = d.student(ids).logits
            with d.teacher.active() as t:
                logits["teacher"] = t(ids).logits

    d._refresh_check = check
    loop_mod.run_distill(d, stop_after=1)
    assert d.state.teacher_refreshes == 1 and not d.opt_theta.state  # the old adapter's moments are gone
    torch.testing.assert_close(logits["student"], logits["before"], atol=1e-5, rtol=1e-5)  # same function
    torch.testing.assert_close(logits["teacher"], logits["student"], atol=1e-5, rtol=1e-5)  # θ̄ is that student
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in d.trainable.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        assert not torch.allclose(logits["teacher"], tiny_model(ids).logits)  # no longer the start's base
    loop_mod.run_distill(d)  # trains on from the fresh adapter (the checkpoint holds the merged base)
    assert d.state.step == 2 and d.state.skipped_updates == 0 and d.state.teacher_refreshes == 1


# ---- the check itself, on the tiny model --------------------------------------------------------------------


def test_check_tasks_are_a_fixed_set_of_train_tasks_of_the_deployment_world():
    p = Params()
    p.baselines = replace(p.baselines, refresh_check_n=5)
    tasks = R.check_tasks(p)
    assert len(tasks) == 5 and tasks == R.check_tasks(copy.deepcopy(p))
    assert {t.split for t in tasks} == {"train"} and {t.world for t in tasks} <= set(p.envs.deploy_worlds)
    p.seed = 1
    assert R.check_tasks(p) != tasks


def test_greedy_score_plays_the_tasks_greedily(tiny_model, tiny_tokenizer):
    from lopd_core.evaluation import summarize
    from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

    p = Params()
    p.rollout = replace(p.rollout, max_new_tokens=24, max_context=640)
    tasks = make_tasks("toolworld", "train", 3, seed=7)
    codec = ChatCodec(tiny_tokenizer)
    score = R.greedy_score(tiny_model, codec, tasks, p.rollout, seed=0)
    trajs = rollout(
        tiny_model,
        codec,
        [RolloutRequest(t) for t in tasks],
        sampling=Sampling(temperature=0.0, max_new_tokens=24, max_context=640),
        seed=5,
    )
    want = summarize(trajs)
    assert score.n == 3 and score.success_rate == pytest.approx(want["success_rate"], abs=1e-4)
    assert score.reward_mean == pytest.approx(want["reward_mean"], abs=1e-4)
    assert R.greedy_score(tiny_model, codec, tasks, p.rollout, seed=1) == score  # greedy: the seed plays no part


def test_the_gate_is_strict_and_reads_the_chosen_metric():
    behind, ahead = R.CheckScore(0.5, 0.4, 8), R.CheckScore(0.5, 0.6, 8)
    assert not R.should_refresh(ahead, behind, metric="success", min_gain=0.0)  # level on success: kept
    assert R.should_refresh(ahead, behind, metric="reward", min_gain=0.0)
    assert not R.should_refresh(ahead, behind, metric="reward", min_gain=0.25)
    with pytest.raises(ValueError, match="refresh metric"):
        ahead.value("loss")


def test_the_real_check_on_the_tiny_model(tmp_path, tiny_model, tiny_tokenizer, retriever):
    params = _params(tmp_path, "lopd_gated_refresh", steps=1, refresh_check_every=1, refresh_check_n=2)
    d = _distiller(params, tiny_model, tiny_tokenizer, retriever)
    logs = []
    d.log = logs.append
    loop_mod.run_distill(d)
    (check,) = d.state.refresh_checks
    assert check["student"]["n"] == check["teacher"]["n"] == 2 and d.state.check_episodes == 4
    assert check["refreshed"] == (check["student"]["success_rate"] > check["teacher"]["success_rate"])
    assert d.state.rollouts == 4  # the check's episodes are not training rollouts
    assert any("teacher refresh check" in m for m in logs)
