"""The verdicts of `lopd compare` over training seeds and tasks (lopd_core/compare/decide.py) against hand
computations, and the curve read at fixed rollout marks (lopd_core/compare/run.py curve_steps)."""

import math
from dataclasses import replace

import pytest
from scipy import stats

from lopd_core.compare import decide as V
from lopd_core.compare.run import curve_steps
from lopd_core.config import Params


def test_three_seeds_that_spread_cannot_tell():
    d = V.two_level_interval({"cobalt": [0.1, 0.2, 0.3]}, tasks=100)
    # mean 0.2, s = 0.1, se = 0.1/√3 = 0.05774, t(2) = 4.303: half-width 0.2484
    assert d.mean == pytest.approx(0.2)
    assert (d.low, d.high) == pytest.approx((0.2 - 0.24841, 0.2 + 0.24841), abs=1e-4)
    assert d.verdict == "cannot tell at n = 100, S = cobalt 3"


def test_five_seeds_that_agree_are_ahead_and_the_mirror_is_behind():
    ahead = V.two_level_interval({"cobalt": [0.10, 0.12, 0.14, 0.16, 0.18]}, tasks=100)
    # mean 0.14, s = 0.03162, se = 0.01414, t(4) = 2.7764: [0.1007, 0.1793]
    assert (ahead.low, ahead.high) == pytest.approx((0.10074, 0.17926), abs=1e-4) and ahead.verdict == "ahead"
    behind = V.two_level_interval({"cobalt": [-0.10, -0.12, -0.14, -0.16, -0.18]}, tasks=100)
    assert behind.verdict == "behind"


def test_worlds_are_strata_weighed_alike_with_satterthwaite_degrees_of_freedom():
    d = V.two_level_interval({"a": [0.1, 0.2], "b": [0.3, 0.5]}, tasks=48)
    # world means 0.15 and 0.40 -> 0.275; Var = (0.005/2 + 0.02/2) / 4 = 0.003125; df = 0.003125² /
    # ((0.000625)²/1 + (0.0025)²/1) = 1.4706
    half = stats.t.ppf(0.975, 1.4706) * math.sqrt(0.003125)
    assert d.mean == pytest.approx(0.275) and (d.low, d.high) == pytest.approx((0.275 - half, 0.275 + half), abs=1e-3)


def test_one_seed_in_a_world_has_no_spread_to_estimate():
    d = V.two_level_interval({"cobalt": [0.3, 0.25], "borealis": [0.2]}, tasks=100)
    assert math.isnan(d.low) and d.verdict.startswith("cannot tell") and d.seeds == 3


def test_cells_pair_by_world_and_seed_and_the_curve_is_read_at_the_first_point_past_a_mark():
    def run(world, seed, final, curve):
        return {
            "world": world,
            "seed": seed,
            "final": {"test_id": {"greedy": {"success_rate": final, "n": 100}}},
            "curve": [{"rollouts": r, "greedy_success": v} for r, v in curve],
        }

    a = [run("cobalt", 0, 0.4, [(192, 0.1), (256, 0.3), (1024, 0.4)]), run("cobalt", 1000, 0.5, [(192, 0.1)])]
    b = [run("cobalt", 0, 0.3, [(0, 0.1), (320, 0.2), (1024, 0.3)]), run("borealis", 1, 0.2, [(0, 0.0)])]
    assert V.cell_differences(V.final_values(a, "test_id", "greedy"), V.final_values(b, "test_id", "greedy")) == {
        "cobalt": [pytest.approx(0.1)]
    }
    assert V.curve_values(b, 256, "greedy") == {("cobalt", 0): 0.2}  # 320 is the first point at ≥ 256
    assert V.curve_values(a, 512, "greedy") == {("cobalt", 0): 0.4}  # the second run stops short of the mark
    assert V.rollouts_to_reach(a[:1], 0.3, "greedy") == 256 and V.rollouts_to_reach(b[:1], 0.5, "greedy") is None


def test_curve_marks_are_the_same_rollouts_whatever_the_bank_cost():
    p = Params()
    p.lopd = replace(p.lopd, tasks_per_step=8, samples_per_task=4)  # 32 rollouts a step
    assert curve_steps(p, 32, 0, 4, [256, 512, 1024]) == [8, 16, 32]  # GRPO: 256 = step 8
    # a bank method starts with 192 spent: 256 after 2 steps, 512 after 10, its last step 26 = 1024
    assert curve_steps(p, 26, 192, 4, [256, 512, 1024]) == [2, 10, 26]
    assert curve_steps(p, 8, 0, 4, []) == [2, 4, 6, 8]  # no marks: evenly spaced points


def test_reuse_by_identity_takes_a_finished_run_of_the_same_method_seed_and_budget(tmp_path):
    import json

    from flows.compare import same_run
    from lopd_core.config import Params
    from tasks.caching import DONE

    preset = Params().compare.presets["decide"]
    runs = tmp_path / "runs"
    old = runs / "final-grpo-cobalt-s0-lr0.0003-aaaaaaaaaa"  # the same run under an older code's key
    old.mkdir(parents=True)
    final = {"test_id": {"greedy": {"n": preset.eval_n}}}
    (old / DONE).write_text(json.dumps({"budget": 1024, "final": final}))
    other = runs / "final-grpo-cobalt-s1000-lr0.0003-bbbbbbbbbb"  # another training seed: never taken
    other.mkdir()
    (other / DONE).write_text(json.dumps({"budget": 1024, "final": final}))
    job = {"work": str(runs / "final-grpo-cobalt-s0-lr0.0003-cccccccccc"), "budget": 1024, "validation_n": 0}
    assert same_run(job, preset) == str(old)
    assert same_run({**job, "budget": 512}, preset) is None  # another budget is another run
    seed_1000 = {**job, "work": str(runs / "final-grpo-cobalt-s1-lr0.0003-cccccccccc")}
    assert same_run(seed_1000, preset) is None


def test_seeds_that_agree_by_chance_still_carry_their_tasks_noise():
    # two seeds, both −0.021: their spread is 0, but each difference carries the noise of 48 tasks
    a = {("cobalt", 0): 0.29, ("cobalt", 1000): 0.29}
    b = {("cobalt", 0): 0.311, ("cobalt", 1000): 0.311}
    d = V._compare(a, b, 48)
    # floor (0.29·0.71 + 0.311·0.689) / 48 = 0.008754; se = √(0.008754 / 2) = 0.06616; t(1) = 12.706
    assert d.high - d.low == pytest.approx(2 * 12.706 * 0.06616, rel=1e-3)
    assert d.verdict.startswith("cannot tell")
