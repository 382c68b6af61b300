"""Each stage is defined once (issue #31): `lopd compare`'s run of method lopd is the distill stage's driver
(`run_lopd`), so on the same seed, params and step count it writes the same training curve and the same student
as `lopd distill` does — its held-out probes along the way (CurveProbe) included, which must not disturb the
training they measure."""

import copy
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from lopd_core.config import load_params
from tests._tiny_cycle import TINY_CYCLE

PARAMS_FILE = str(Path(__file__).resolve().parents[2] / "params.yaml")


def test_compares_lopd_run_equals_the_distill_stage_on_the_same_seed(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    from safetensors.torch import load_file

    from lopd_core.compare.run import plan_steps, run_method
    from lopd_core.distill.composer.composer import save_composer
    from lopd_core.drivers.bank import run_bank
    from lopd_core.drivers.coldstart import new_composer
    from lopd_core.drivers.distill import run_lopd

    monkeypatch.chdir(tmp_path)
    model_dir = tmp_path / "model"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    params = load_params(
        PARAMS_FILE,
        [
            *TINY_CYCLE,
            f"model.name_or_path={model_dir}",
            "bank.seed_tasks=2",
            "bank.samples_per_task=1",
            f"bank.dir={tmp_path / 'seed_bank'}",
            f"bank.index_dir={tmp_path / 'seed_index'}",
            # every trajectory is a success, so the bank (and the teacher's retrieval) is never empty
            "bank.min_reward=0.0",
            "bank.refresh_every=1",
            "lopd.method=lopd",
        ],
    )
    seed = run_bank(params, log=lambda *_: None)
    phi0 = tmp_path / "phi0.pt"
    torch.manual_seed(0)
    save_composer(new_composer(params, tiny_model), phi0)
    per_step = params.lopd.tasks_per_step * params.lopd.samples_per_task
    budget = seed["rollouts"] + 2 * per_step
    steps, _ = plan_steps(params, "lopd", budget, seed["rollouts"])

    compared = run_method(
        params,
        "lopd",
        tmp_path / "compare",
        budget=budget,
        bank_rollouts=seed["rollouts"],
        bank_dir=params.bank.dir,
        index_dir=params.bank.index_dir,
        phi0=str(phi0),
        curve_points=2,
        curve_n=1,
        eval_n=1,
        log=lambda *_: None,
    )
    assert [p["step"] for p in compared["curve"]] == [0, 1, 2]  # a probe between the two training steps

    distill = copy.deepcopy(params)
    distill.lopd = replace(
        distill.lopd, steps=steps, out_dir=str(tmp_path / "distill"), csv=str(tmp_path / "distill" / "distill.csv")
    )
    distill.coldstart = replace(distill.coldstart, out=str(phi0), fit_out=str(phi0))  # as compare and the cycle pass it
    distilled = run_lopd(distill, log=lambda *_: None)

    assert compared["steps"] == distilled["steps"] == 2 and compared["rollouts"] == distilled["rollouts"]
    timing = ["step_seconds"]
    ours, theirs = (pd.read_csv(path).drop(columns=timing) for path in (compared["csv"], distill.lopd.csv))
    pd.testing.assert_frame_equal(ours, theirs)
    assert len(ours) == 2 and ours["distill_loss"].notna().all()
    a, b = (load_file(Path(d) / "model.safetensors") for d in (compared["student"], distilled["student"]))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    start = load_file(model_dir / "model.safetensors")
    assert any(not torch.equal(a[name], start[name]) for name in a)  # trained: equal, and not merely untouched
