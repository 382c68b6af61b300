"""The margin probe's arithmetic (probes/margin_probe.py): δ̄ from per-trajectory gaps under each advantage.

The property the README's reading of the probe rests on: a teacher that is merely *different* from the student
(the same negative gap on every trajectory of a task) earns a positive δ̄ under `continuous` when most
trajectories have A < 0, and nothing under `group`, whose advantages sum to zero within a task.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from probes.margin_probe import summarize


def _trajs(rewards, tokens=10):
    return [SimpleNamespace(reward=r, success=r == 1.0, num_action_tokens=tokens) for r in rewards]


def test_uniform_divergence_pays_under_continuous_not_under_group():
    rewards = [0.0, 0.25, 0.5, 1.0, 0.0, 0.0, 0.25, 0.25]  # two tasks × four samples; mean A (2r − 1) < 0
    out = summarize([-0.1] * 8, _trajs(rewards), samples=4, boot=50, seed=0)
    mean_adv = sum(2 * r - 1 for r in rewards) / len(rewards)  # equal token counts: δ̄ = gap · mean A
    assert out["delta_continuous"] == pytest.approx(-0.1 * mean_adv, abs=1e-4) and out["delta_continuous"] > 0
    assert out["delta_binary"] == pytest.approx(-0.1 * (1 - 7) / 8, abs=1e-4)  # one success, seven failures
    assert out["delta_group"] == pytest.approx(0.0, abs=1e-9)
    assert out["gap_success"] == pytest.approx(-0.1) and out["gap_failure"] == pytest.approx(-0.1)
    lo, hi = out["delta_continuous_ci95"]
    assert lo <= out["delta_continuous"] <= hi


def test_a_teacher_that_prefers_the_successes_earns_group_margin():
    rewards = [1.0, 0.0, 0.0, 0.0]
    gaps = [0.3, -0.1, -0.1, -0.1]  # above the student on the success, below it on the failures
    out = summarize(gaps, _trajs(rewards), samples=4, boot=50, seed=0)
    # group A = r − 0.25: (0.75, −0.25, −0.25, −0.25) → δ̄ = (0.75·0.3 + 3·0.25·0.1) / 4
    assert out["delta_group"] == pytest.approx((0.75 * 0.3 + 3 * 0.25 * 0.1) / 4, abs=1e-4)
    assert out["gap_success"] == pytest.approx(0.3) and out["gap_failure"] == pytest.approx(-0.1)


def test_divergence_alert_fires_on_a_kl_jump_that_meets_the_margin():
    """run_distill's warning: δ̄ ≥ m reached while the reverse KL jumps far above its recent median."""
    from lopd_core.distill.loop.loop import DIVERGENCE_WINDOW, margin_by_divergence

    calm = [0.008, 0.012, 0.006, 0.01] * (DIVERGENCE_WINDOW // 4)
    assert margin_by_divergence(calm, kl=0.19, delta=0.19, margin=0.05)  # seed 0's step 71, in small
    assert not margin_by_divergence(calm, kl=0.19, delta=0.03, margin=0.05)  # margin not met: no alert
    assert not margin_by_divergence(calm, kl=0.02, delta=0.06, margin=0.05)  # met without a KL jump
    assert not margin_by_divergence(calm, kl=0.19, delta=0.19, margin=0.0)  # no margin, nothing to game
    assert not margin_by_divergence(calm[:5], kl=0.19, delta=0.19, margin=0.05)  # too little history
    assert not margin_by_divergence(calm, kl=float("nan"), delta=0.19, margin=0.05)
