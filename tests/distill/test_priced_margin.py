"""The margin priced, not assumed (issue #29 item 2; lopd_core/distill/update/margin.py):

  * `lopd.margin: auto` prices m = margin_fraction × the initial teacher's gap on successes — on stored seed
    successes before step 1, else on step 1's own — and 0 where the gap is ≤ 0 or there is no success;
  * a resumed run keeps the priced m (never re-prices); a method's own margin still wins;
  * plots/distill.csv carries `margin`, `delta_success`, `delta_failure`; δ̄ is their trajectory-weighted mix;
  * δ̄'s parts under each `lopd.advantage` on a hand-built, mostly-failed batch;
  * `beta_unbounded`'s rule; the config's checks; the report draws the CSV's margin column.
Uses the tiny fixtures of tests/conftest.py and the six-trajectory batch of tests/_batches.py.
"""

import copy
import csv
import dataclasses
import math
from dataclasses import replace
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from _batches import oracle_texts, six_trajectories, step_params

from lopd_core import methods as M
from lopd_core.config import ConfigError, Params, load_params
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import loop as loop_mod
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.update import margin as MG
from lopd_core.distill.update import margin_pricing
from lopd_core.distill.update.dashboard import CSV_COLUMNS

SUCCESSES = (0, 3)  # six_trajectories: rewards 1, 0, .5, 1, 0, .25


@pytest.fixture(scope="module")
def batch(tiny_model, tiny_tokenizer):
    tasks, trajs = six_trajectories(tiny_model, tiny_tokenizer)
    texts = oracle_texts(3)
    return tasks, trajs, lambda ts: [texts[:2] for _ in ts]


def _params(tmp_path, **lopd) -> Params:
    return step_params(tmp_path, **{"margin": "auto", **lopd})


def _distiller(params, tiny_model, tiny_tokenizer, retriever, *, pricing=None, log=None):
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    d = trainer_mod.Distiller(
        params, model, tiny_tokenizer, retriever, composer=composer, pricing=pricing, log=log or (lambda m: None)
    )
    # a student well off the base that sampled the batch and teaches: the teacher's gap on successes is > 0
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for q in d.trainable.parameters():
            q.add_(torch.randn(q.shape, generator=g) * 0.2)
    return d


def _pricing(trajs, retriever):
    return MG.PricingSource(
        [MG.PricingTrajectory(t.task, t.token_ids, t.action_mask) for t in trajs if t.success], retriever
    )


def _success_gap(out) -> float:
    return sum(out.trajectory_gaps[i] for i in SUCCESSES) / len(SUCCESSES)


# --- pricing ---------------------------------------------------------------------------------------------------


def test_price_is_the_fraction_of_the_success_gap_and_zero_when_privilege_shows_none():
    gaps = torch.tensor([0.04, -0.30, 0.02, 9.0, -0.10])  # per trajectory: mean log p_T,φ0 − log p_S
    counts = torch.tensor([5, 7, 3, 0, 4])  # the fourth has no action token: no vote
    ok = torch.tensor([True, False, True, True, False])
    gap, n = MG.mean_over_successes(gaps, counts, ok)
    assert (gap, n) == (pytest.approx(0.03), 2)  # one vote per trajectory, failures left out
    priced = MG.price(gap, n, 0.5, "bank seed successes")
    assert priced.margin == pytest.approx(0.015) and "m = 0.5 × gap" in priced.message()
    below = MG.price(-0.004, 3, 0.5, "bank seed successes")
    assert below.margin == 0.0 and "cannot be met by privilege" in below.message()
    none = MG.price(*MG.mean_over_successes(gaps, counts, torch.zeros(5, dtype=torch.bool)), 0.5, "step 1 successes")
    assert none.margin == 0.0 and none.trajectories == 0 and "no successful trajectory" in none.message()
    assert none.summary()["gap"] is None  # plain data: no NaN in a JSON summary


def test_auto_prices_on_stored_successes_before_step_one(tmp_path, tiny_model, tiny_tokenizer, batch):
    tasks, trajs, retriever = batch
    logs = []
    d = _distiller(
        _params(tmp_path, margin_fraction=0.5),
        tiny_model,
        tiny_tokenizer,
        retriever,
        pricing=_pricing(trajs, retriever),
        log=logs.append,
    )
    assert d.margin is None and M.resolve_method(d.cfg, d.params.baselines).margin is None
    d.price_margin()
    pricing = d.state.margin_pricing
    # the same gap as the training step's own teacher pass finds on those successes (φ0, the initial student)
    reference = _distiller(_params(tmp_path, margin=0.05), tiny_model, tiny_tokenizer, retriever)
    gap = _success_gap(reference.update(tasks, trajs))
    assert gap > 0 and pricing["gap"] == pytest.approx(gap, abs=1e-5)
    assert pricing["trajectories"] == 2 and pricing["source"] == "bank seed successes"
    assert d.margin == pytest.approx(0.5 * max(gap, 0.0), abs=1e-6)
    assert any("margin: auto" in line for line in logs)
    d.price_margin()  # priced once: a second call changes nothing
    assert d.state.margin_pricing == pricing and sum("margin: auto" in line for line in logs) == 1


def test_auto_prices_on_the_first_steps_successes_without_stored_ones(tmp_path, tiny_model, tiny_tokenizer, batch):
    tasks, trajs, retriever = batch
    d = _distiller(_params(tmp_path, margin_fraction=1.0), tiny_model, tiny_tokenizer, retriever)
    d.price_margin()  # nothing stored: left to step 1
    assert d.margin is None
    out = d.update(tasks, trajs)
    gap = _success_gap(out)
    assert gap > 0 and d.margin == pytest.approx(gap, abs=1e-6) and out.row.margin == d.margin
    assert d.state.margin_pricing["source"] == "step 1 successes"
    # the step's dual ascent used the priced m
    assert d.state.beta == pytest.approx(max(0.0, 0.5 + 0.5 * (d.margin - out.row.delta)), abs=1e-6)


def test_a_gap_at_or_below_zero_prices_zero_and_says_so(tmp_path, tiny_model, tiny_tokenizer, batch, monkeypatch):
    tasks, trajs, retriever = batch
    logs = []
    d = _distiller(
        _params(tmp_path), tiny_model, tiny_tokenizer, retriever, pricing=_pricing(trajs, retriever), log=logs.append
    )
    monkeypatch.setattr(margin_pricing, "seed_gap", lambda setup, models, rows, retriever: (-0.004, len(rows)))
    d.price_margin()
    assert d.margin == 0.0 and any("cannot be met by privilege" in line for line in logs)
    failed = [copy.copy(t) for t in trajs]
    for t in failed:
        t.success = False
    e = _distiller(_params(tmp_path), tiny_model, tiny_tokenizer, retriever, log=logs.append)
    out = e.update(tasks, failed)  # step 1 has no success to price on
    assert e.margin == 0.0 and out.row.margin == 0.0 and math.isnan(out.row.delta_success)
    assert any("no successful trajectory" in line for line in logs)


def test_the_methods_own_margin_wins_over_auto(tmp_path, tiny_model, tiny_tokenizer, batch):
    _, trajs, retriever = batch
    params = _params(tmp_path, method="lopd_no_margin")
    assert M.resolve_method(params.lopd, params.baselines).margin == 0.0
    d = _distiller(params, tiny_model, tiny_tokenizer, retriever, pricing=_pricing(trajs, retriever))
    d.price_margin()
    assert d.margin == 0.0 and d.state.margin is None and not d.state.margin_pricing
    text = _distiller(_params(tmp_path, method="text_experience"), tiny_model, tiny_tokenizer, retriever)
    text.price_margin()  # no latent teacher: nothing to price, m = 0
    assert text.margin == 0.0


def test_a_resumed_run_keeps_the_priced_margin(tmp_path, tiny_model, tiny_tokenizer, batch, monkeypatch):
    _, trajs, retriever = batch
    params = _params(tmp_path)
    d = _distiller(params, tiny_model, tiny_tokenizer, retriever, pricing=_pricing(trajs, retriever))
    monkeypatch.setattr(margin_pricing, "seed_gap", lambda setup, models, rows, retriever: (0.03, len(rows)))
    loop_mod.run_distill(d)
    assert d.margin == pytest.approx(0.015)
    resumed = _distiller(params, tiny_model, tiny_tokenizer, retriever, pricing=_pricing(trajs, retriever))

    def reprice(*_a):
        raise AssertionError("a resumed run re-priced its margin")

    monkeypatch.setattr(margin_pricing, "seed_gap", reprice)
    loop_mod.run_distill(resumed, steps=2)
    assert resumed.state.step == 2 and resumed.margin == pytest.approx(0.015)
    assert resumed.state.margin_pricing == d.state.margin_pricing
    with open(params.lopd.csv) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["margin"]) for r in rows] == pytest.approx([0.015, 0.015])


# --- the dashboard ---------------------------------------------------------------------------------------------


def test_the_csv_has_the_margin_and_deltas_parts(tmp_path, tiny_model, tiny_tokenizer, batch):
    cols = CSV_COLUMNS
    assert cols[cols.index("beta") + 1 : cols.index("beta") + 4] == ["margin", "delta_success", "delta_failure"]
    tasks, trajs, retriever = batch
    d = _distiller(_params(tmp_path, margin=0.05), tiny_model, tiny_tokenizer, retriever)
    out = d.update(tasks, trajs)
    row = out.row
    assert row.margin == 0.05
    # continuous A = 2r − 1 is 1 on a success: δ's success part is the successes' mean gap
    assert row.delta_success == pytest.approx(_success_gap(out), abs=1e-6)
    advantage = [2 * r - 1 for r in (1.0, 0.0, 0.5, 1.0, 0.0, 0.25)]
    failures = [i for i in range(6) if i not in SUCCESSES]
    assert row.delta_failure == pytest.approx(
        sum(advantage[i] * out.trajectory_gaps[i] for i in failures) / len(failures), abs=1e-6
    )
    # δ̄ is one vote per trajectory: the parts mixed by their trajectory counts
    assert row.delta == pytest.approx((2 * row.delta_success + 4 * row.delta_failure) / 6, abs=1e-6)
    loop_mod.write_rows(tmp_path / "d.csv", cols, [{**dataclasses.asdict(row), "delta_success": math.nan}])
    frame = pd.read_csv(tmp_path / "d.csv")
    assert list(frame.columns) == cols and math.isnan(frame["delta_success"][0])


# --- the advantage on mostly-failed batches ------------------------------------------------------------------


def test_delta_parts_under_each_advantage_on_a_mostly_failed_batch():
    # Two tasks × 2 samples: one success (r = 1), three failures (r = 0, 0.5 | r = 0, 0: an all-failed task).
    # Per trajectory: 2 action tokens; the teacher is a little above the student on the success (+0.01) and
    # well below it on the failures (−0.2): a teacher pushed away from the student.
    rewards = torch.tensor([1.0, 0.5, 0.0, 0.0])
    successes = torch.tensor([True, False, False, False])
    groups = torch.tensor([0, 0, 1, 1])
    per_traj_gap = torch.tensor([0.01, -0.2, -0.2, -0.2])
    index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    student = torch.full((8,), -1.0)
    counts = torch.full((4,), 2)

    def parts(kind: str, shift: float = 0.0):
        a = L.advantages(rewards, kind=kind, successes=successes, group_ids=groups)
        teacher = student + per_traj_gap[index] + shift
        delta = L.privileged_margin_delta(teacher, student, a, index, 4)
        return float(delta.mean()), *MG.delta_parts(delta, counts, successes)

    bar, ok, fail = parts("continuous")  # A = 1, 0, −1, −1
    assert (ok, fail) == (pytest.approx(0.01), pytest.approx((0.0 + 0.2 + 0.2) / 3))
    assert bar == pytest.approx(0.1025) and bar >= 0.05 > ok  # m = 0.05 met by the failures alone
    bar, ok, fail = parts("binary")  # A = 1, −1, −1, −1
    assert (ok, fail, bar) == (pytest.approx(0.01), pytest.approx(0.2), pytest.approx(0.1525))
    bar, ok, fail = parts("group")  # A = 0.25, −0.25, 0, 0: the all-failed task adds nothing
    assert (ok, fail) == (pytest.approx(0.0025), pytest.approx((0.05 + 0 + 0) / 3))
    # pushing the teacher away from every sample alike raises δ̄ under continuous / binary, not under group
    for kind, moves in (("continuous", True), ("binary", True), ("group", False)):
        assert (parts(kind, shift=-0.5)[0] > parts(kind)[0] + 0.1) == moves, kind
        if not moves:
            assert parts(kind, shift=-0.5)[0] == pytest.approx(parts(kind)[0], abs=1e-7)
    assert all(math.isnan(v) for v in MG.delta_parts(torch.ones(2), torch.tensor([0, 0]), torch.tensor([True, False])))


# --- β bounded -------------------------------------------------------------------------------------------------


def test_beta_unbounded_when_it_rose_to_the_end_and_ended_high():
    climbing = [0.025 * i for i in range(65)]  # δ̄ ≈ 0 < m every step: ends at 1.6
    assert MG.beta_unbounded(climbing)
    assert not MG.beta_unbounded([0.01 * i for i in range(65)])  # rising, but ends at 0.64: still bounded
    assert not MG.beta_unbounded(climbing[:48] + [climbing[47]] * 17)  # flat over the last quarter
    noisy = climbing[:49] + [climbing[48] + 0.05 * i - (0.06 if i == 8 else 0) for i in range(1, 17)]
    assert MG.beta_unbounded(noisy)  # one fall in sixteen still counts as growing
    assert not MG.beta_unbounded([0.0, 2.0, 4.0])  # too few steps to say
    assert "kept growing" in MG.beta_warning(climbing)


# --- settings --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, ok",
    [
        ("lopd.margin=auto", True),
        ("lopd.margin=0", True),
        ("lopd.margin=0.2", True),
        ("lopd.margin=-0.1", False),
        ("lopd.margin=.nan", False),
        ("lopd.margin=.inf", False),
        ("lopd.margin=automatic", False),
        ("lopd.margin=true", False),
        ("lopd.margin=1e9", False),
        ("lopd.margin_fraction=1", True),
        ("lopd.margin_fraction=0", False),
        ("lopd.margin_fraction=1.5", False),
    ],
)
def test_the_margin_settings_are_checked_at_load(override, ok):
    if ok:
        load_params("params.yaml", [override])
        return
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        load_params("params.yaml", [override])


def test_defaults_and_a_section_built_by_hand(tmp_path, tiny_model, tiny_tokenizer, batch):
    loaded = load_params("params.yaml")
    assert loaded.lopd.margin == "auto" and loaded.lopd.margin_fraction == 0.5
    with pytest.raises(ConfigError, match="lopd.margin"):
        _distiller(_params(tmp_path, margin="sometimes"), tiny_model, tiny_tokenizer, batch[2])


# --- the report ------------------------------------------------------------------------------------------------


def test_the_report_draws_the_margin_the_csv_says(tmp_path, monkeypatch):
    from lopd_cli.pipeline import cmd_report
    from lopd_core import run_report as report

    cols = CSV_COLUMNS
    csv_path = tmp_path / "distill.csv"
    rows = [{c: 0.1 for c in cols} | {"step": s, "margin": 0.0123} for s in (1, 2, 3)]
    pd.DataFrame(rows, columns=cols).to_csv(csv_path, index=False)
    params = load_params("params.yaml", ["lopd.margin=auto"])
    drawn = []
    monkeypatch.setattr(report, "write_report", lambda runs, evals, out, title, **_: drawn.extend(runs) or out)
    args = SimpleNamespace(cycles=False, csv=str(csv_path), eval=None, base_eval=None, out=str(tmp_path / "r"))
    assert cmd_report(params, args) == 0 and [r.margin for r in drawn] == [None]  # priced: read from the CSV
    monkeypatch.undo()
    report.write_report(drawn, [], tmp_path / "report")
    table = pd.read_csv(tmp_path / "report" / "delta_margin.csv")
    assert set(table["margin"]) == {0.0123}


def test_the_stage_prices_on_the_banks_stored_seed_successes(tmp_path, batch):
    from lopd_core.drivers.distill import bank_paths, pricing_source, seed_successes
    from lopd_core.rollout.table import trajectories_to_frame, write_trajectories

    _, trajs, _ = batch
    params = Params()
    params.seed, params.bank = 0, replace(params.bank, dir=str(tmp_path / "bank"))
    assert seed_successes(params) == []  # no seed table: step 1 prices
    write_trajectories(trajectories_to_frame(trajs), bank_paths(params)[1])
    rows = seed_successes(params)
    assert [r.token_ids for r in rows] == [trajs[i].token_ids for i in SUCCESSES]
    assert [r.task for r in rows] == [trajs[i].task for i in SUCCESSES]
    assert pricing_source(M.method_spec("lopd"), None, params, rows) is None  # no bank to read: step 1 prices
