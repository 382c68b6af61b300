"""The training step's corrections (issue #21, item 8), each against what the step used to do:

  a. the importance weight exists only where it corrects something (the sampled-token estimator);
  b. GRPO's ratio is taken against the rollout's sampling log-probs, not the current ones detached;
  c. δ̄ is the mean of δ(τ) over trajectories, not a token mean;
  d. a teacher without experience reads the plain conversation, not an empty experience block;
  e. a run asked for more steps than lopd.steps draws fresh tasks instead of empty batches;
  f. the dashboard draws the margin the run trained with (the resolved method's).
Uses the tiny fixtures of tests/conftest.py; a few seconds on 2 cores.
"""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from _batches import oracle_texts, six_trajectories, step_params

from lopd_core import methods as M
from lopd_core.config import ConfigError, Params, load_params
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import loop as loop_mod
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring import pg_losses as PG
from lopd_core.distill.scoring.prefix import score_actions_shared
from lopd_core.distill.scoring.teacher import Framing, action_logits, build_batch
from lopd_core.distill.update import step as S
from lopd_core.distill.update.dashboard import CSV_COLUMNS


@pytest.fixture(scope="module")
def batch(tiny_model, tiny_tokenizer):
    """Six trajectories (3 tasks × 2 samples) of different lengths and rewards, two experiences per task."""
    tasks, trajs = six_trajectories(tiny_model, tiny_tokenizer)
    texts = oracle_texts(3)
    return tasks, trajs, lambda ts: [texts[:2] for _ in ts]


def _params(tmp_path, **lopd) -> Params:
    return step_params(tmp_path, **lopd)


def _distiller(params, tiny_model, tiny_tokenizer, retriever):
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    d = trainer_mod.Distiller(params, model, tiny_tokenizer, retriever, composer=composer, log=lambda m: None)
    g = torch.Generator().manual_seed(1)  # a student that differs from the sampler and the base
    with torch.no_grad():
        for q in d.trainable.parameters():
            q.add_(torch.randn(q.shape, generator=g) * 0.05)
    return d


# --- a. the importance weight --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["lopd.importance_weight=true"], ["lopd.importance_weight", "lopd.student_loss='topk'", "sampled"]),
        (["lopd.importance_weight=true", "lopd.student_loss=full"], ["lopd.importance_weight", "'full'"]),
        (["lopd.importance_weight=true", "lopd.method=grpo"], ["lopd.importance_weight", "GRPO's clipped ratio"]),
        (["lopd.teacher_micro_batch=2"], ["lopd.teacher_micro_batch", "lopd.low_memory"]),
    ],
)
def test_meaningless_combinations_fail_at_load_naming_the_keys(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        load_params("params.yaml", overrides)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_importance_weight_loads_where_it_weighs_a_sampled_token():
    ok = load_params("params.yaml", ["lopd.importance_weight=true", "lopd.student_loss=sampled"])
    assert ok.lopd.importance_weight
    assert load_params("params.yaml", ["lopd.importance_weight=true", "lopd.method=skill_sd"]).lopd.method == "skill_sd"
    assert load_params("params.yaml", ["lopd.low_memory=true", "lopd.teacher_micro_batch=2"]).lopd.low_memory


def test_the_trainer_rejects_a_section_built_by_hand(tmp_path, tiny_model, tiny_tokenizer, batch):
    with pytest.raises(ConfigError, match="lopd.importance_weight"):
        _distiller(_params(tmp_path, importance_weight=True), tiny_model, tiny_tokenizer, batch[2])


def test_importance_weight_scales_the_sampled_estimator_by_hand():
    # s = log p_S(a), t = log p_T(a), q = log p_sample(a); w = min(exp(s − q), 2):
    # token 0: s − q = 0 -> w 1, d = −1 − (−2) = 1 -> 1; token 1: s − q = ln 4 -> w capped at 2, d = 0.5 -> 1.0
    s_logits = torch.log(torch.tensor([[0.5, 0.5], [0.8, 0.2]]))  # log p_S of tokens 0, 0: ln 0.5, ln 0.8
    action = torch.tensor([0, 0])
    teacher = S.StudentTargets(
        torch.zeros(2, 1), torch.zeros(2, 1, dtype=torch.long), torch.tensor([math.log(0.5) - 1.0, math.log(0.8) - 0.5])
    )
    sample = torch.tensor([math.log(0.5), math.log(0.2)])
    weighted = S.student_token_loss(
        s_logits, action, teacher, S.StudentLoss("sampled", importance_cap=2.0), sample_logprobs=sample
    )
    assert weighted.tolist() == pytest.approx([1.0, 1.0], abs=1e-6)
    plain = S.student_token_loss(s_logits, action, teacher, S.StudentLoss("sampled"))
    assert plain.tolist() == pytest.approx([1.0, 0.5], abs=1e-6)


# --- b. GRPO's ratio -----------------------------------------------------------------------------------------


def test_grpo_ratio_is_against_the_sampling_logprobs(tmp_path, tiny_model, tiny_tokenizer, batch):
    tasks, trajs, retriever = batch
    shifted = [copy.copy(t) for t in trajs]
    for t in shifted:  # as if sampled at a flatter temperature: every action 0.5 nats less likely to the sampler
        t.sample_logprobs = [lp - 0.5 if m else lp for lp, m in zip(t.sample_logprobs, t.action_mask)]
    d = _distiller(_params(tmp_path, method="grpo"), tiny_model, tiny_tokenizer, retriever)
    ids, masks = [t.token_ids for t in shifted], [t.action_mask for t in shifted]
    with torch.no_grad():
        sb = build_batch(d.student, ids, masks)
        current = torch.log_softmax(action_logits(d.student, sb), -1).gather(-1, sb.action_ids[:, None]).squeeze(-1)
    sampled = torch.tensor([lp for t in shifted for lp, m in zip(t.sample_logprobs[1:], t.action_mask[1:]) if m])
    assert float((current - sampled).mean()) > 0.3  # the ratio is far from 1 (≈ e^0.5): the clip acts
    groups = torch.tensor([i // 2 for i in range(len(shifted))])
    adv = PG.group_relative_advantages(torch.tensor([t.reward for t in shifted]), groups, eps=1e-4)
    expected = PG.clipped_policy_loss(current, sampled, adv[sb.token_traj_index], clip=0.2).sum() / len(sampled)
    ratio_one = PG.clipped_policy_loss(current, current, adv[sb.token_traj_index], clip=0.2).sum() / len(sampled)
    assert abs(float(expected - ratio_one)) > 1e-3  # what the step used to compute differs
    row = d.update(tasks, shifted).row
    assert row.distill_loss == pytest.approx(float(expected), rel=1e-4, abs=1e-6)


# --- c. δ̄ over trajectories ----------------------------------------------------------------------------------


def _with_lengths(trajs, lengths):
    """Copies whose action masks keep only the first `lengths[i]` action tokens (the rest read as forced)."""
    out = []
    for t, keep in zip(trajs, lengths):
        c = copy.copy(t)
        positions = [i for i, m in enumerate(t.action_mask) if m]
        c.action_mask = [1 if m and i in positions[:keep] else 0 for i, m in enumerate(t.action_mask)]
        out.append(c)
    return out


def test_delta_bar_is_the_mean_over_trajectories(tmp_path, tiny_model, tiny_tokenizer, batch):
    tasks, trajs, retriever = batch
    trajs = _with_lengths(trajs, [3, 20, 8, 5, 16, 0])  # long and short, one without action tokens
    out = _distiller(_params(tmp_path), tiny_model, tiny_tokenizer, retriever).update(tasks, trajs)
    gaps = torch.tensor(out.trajectory_gaps, dtype=torch.float64)  # mean gap over each trajectory's tokens
    n = torch.tensor([sum(t.action_mask[1:]) for t in trajs], dtype=torch.float64)
    adv = L.advantages(torch.tensor([t.reward for t in trajs])).double()
    per_trajectory = float((adv * gaps)[n > 0].mean())  # one vote per trajectory
    token_mean = float((n * adv * gaps).sum() / n.sum())  # what the step used to log
    assert len(set(n.tolist())) > 1 and abs(per_trajectory - token_mean) > 1e-4  # the two differ here
    assert out.row.delta == pytest.approx(per_trajectory, rel=1e-4, abs=1e-7)


# --- d. no experience, no block ------------------------------------------------------------------------------


def test_a_teacher_without_experience_reads_the_plain_conversation(tiny_model, tiny_tokenizer, batch):
    _, trajs, _ = batch
    framing = Framing.from_tokenizer(tiny_tokenizer)
    ids, masks = [t.token_ids for t in trajs[:2]], [t.action_mask for t in trajs[:2]]
    empty = [torch.zeros((0, tiny_model.config.hidden_size)) for _ in ids]
    with torch.no_grad():
        plain = action_logits(tiny_model, build_batch(tiny_model, ids, masks))
        spliced = action_logits(tiny_model, build_batch(tiny_model, ids, masks, empty, framing))
        shared = score_actions_shared(
            tiny_model, ids, masks, context=empty, framing=framing, context_keys=[(), ()]
        ).logits
    torch.testing.assert_close(spliced, plain)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-4)


# --- e. more steps than lopd.steps ---------------------------------------------------------------------------


def test_a_longer_run_draws_fresh_tasks(tmp_path, tiny_model, tiny_tokenizer, batch, monkeypatch):
    params = _params(tmp_path, steps=1)
    d = _distiller(params, tiny_model, tiny_tokenizer, batch[2])
    played = []
    real = trainer_mod.rollout

    def counted(model, codec, requests, **kw):
        played.append(len(requests))
        return real(model, codec, requests, **kw)

    monkeypatch.setattr(trainer_mod, "rollout", counted)
    loop_mod.run_distill(d, steps=3)
    assert played == [6, 6, 6]  # 3 tasks × 2 samples every step, none past the end of the stream
    rows = d.state.history
    assert [h["row"]["step"] for h in rows] == [1, 2, 3]
    assert all(math.isfinite(h["row"]["reward_mean"]) for h in rows)
    # the next block is other tasks, and a block is the same whoever asks first (a resumed run draws the same)
    assert [t.instruction for t in d.step_tasks(1)] != [t.instruction for t in d.step_tasks(0)]
    fresh = _distiller(params, tiny_model, tiny_tokenizer, batch[2])
    assert fresh.step_tasks(2) == d.step_tasks(2) and fresh.step_tasks(0) == d.step_tasks(0)


# --- f. the margin the run trained with ----------------------------------------------------------------------


def test_the_report_draws_the_margin_the_run_trained_with(tmp_path, tiny_model, tiny_tokenizer, batch, monkeypatch):
    params = _params(tmp_path, method="lopd_no_margin")
    assert params.lopd.margin == 0.05
    d = _distiller(params, tiny_model, tiny_tokenizer, batch[2])
    assert d.method.margin == 0.0 and d.margin == 0.0 and d.method.composer.anchor_weight == params.lopd.anchor_weight
    assert M.resolve_method(params.lopd, params.baselines).margin == 0.0

    from lopd_cli.pipeline import cmd_report
    from lopd_core import run_report as report

    csv = tmp_path / "distill.csv"
    csv.write_text(",".join(CSV_COLUMNS) + "\n" + ",".join(["1"] * len(CSV_COLUMNS)) + "\n")
    drawn = []
    monkeypatch.setattr(report, "write_report", lambda runs, evals, out, title, **_: drawn.extend(runs) or out)
    args = SimpleNamespace(cycles=False, csv=str(csv), eval=None, base_eval=None, out=str(tmp_path / "r"))
    assert cmd_report(params, args) == 0
    assert [r.margin for r in drawn] == [0.0]
