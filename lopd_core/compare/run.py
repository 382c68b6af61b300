"""One run of `lopd compare`: the cycle's distillation stage for one method and seed, to a rollout budget, and
the cycle's evaluation of the student it exports.

Training is `lopd_core.drivers.distill.run_lopd`, the function `lopd distill` and the cycle's distill stage call, in
the run's own folder: checkpoints, distill.csv, the exported student, and — with `bank.refresh_every` > 0 — its own
copy of the seed bank, which the student's successes grow every N steps (one run's additions never reach
another run). The evaluation is `lopd_core.drivers.evaluate.run_evaluate`, the evaluate stage's driver, on the
exported student: every environment of `envs.mix`, eval.json shaped {env: {split: {mode: cell}}}.

The budget is counted in sampled trajectories, and a method that reads the experience bank starts with the
bank's seed rollouts already spent (they were sampled to fill it); GRPO and the other bank-free methods spend
the whole budget on training steps. The bank holds only sampled successes of the deployment worlds; the
composer's cold start reads oracle episodes of the pretraining worlds only, and OPSD's golden solutions (ground
truth by definition) are not sampled and not counted; compare.md says so.

Along the run, a hook of run_lopd evaluates the student on the held-out `test_id` tasks (`curve_n` per
environment of the mix, greedy and sampled) at `curve_points` evenly spaced steps, and the starting policy before
training: success against rollouts, the mix's environments pooled. At the end the exported student is evaluated
under the `eval` section with `eval_n` tasks per split (the report's splits `test_id`, `test_ood` and both modes
added where the section lacks them); a learning-rate tuning run (`validation_n` > 0) instead on that many
validation tasks from the train split, never on test.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

from lopd_core.config import Params
from lopd_core.drivers.distill import run_lopd
from lopd_core.drivers.evaluate import run_evaluate
from lopd_core.evaluation import evaluate, wilson_interval, write_metrics
from lopd_core.methods import method_spec
from lopd_core.model.loading import load_policy
from lopd_core.settings.run import FINAL_SPLIT

REPORT_SPLITS = ("test_id", "test_ood")
REPORT_MODES = ("greedy", "sampled")


def plan_steps(params: Params, method: str, budget: int, bank_rollouts: int) -> tuple[int, int]:
    """(training steps, rollouts already spent) for `method` at `budget` sampled trajectories."""
    spec = method_spec(method, params.baselines)
    spent = bank_rollouts if spec.uses_bank else 0
    per_step = params.lopd.tasks_per_step * params.lopd.samples_per_task
    steps = (budget - spent) // per_step
    if steps < 1:
        raise ValueError(
            f"compare budget {budget} leaves no training step for {method} (bank rollouts {spent}, "
            f"{per_step} per step): raise the budget or shrink the bank"
        )
    return steps, spent


def _with_eval(
    params: Params, splits, n: int, modes=REPORT_MODES, *, experience: bool = False, benchmarks: bool = False
) -> Params:
    """A copy of params with the `eval` section narrowed to these splits, modes and tasks per split."""
    p = copy.deepcopy(params)
    p.eval = dataclasses.replace(
        p.eval,
        splits=list(splits),
        n_per_split=n,
        modes=list(modes),
        with_experience=experience,
        benchmarks=list(params.eval.benchmarks) if benchmarks else [],
    )
    return p


def final_eval_params(params: Params, eval_n: int) -> Params:
    """The cycle's evaluation (`eval` as configured, benchmarks included) with `eval_n` tasks per split and the
    report's splits and modes added where missing, less test_final: a comparison chooses between methods, and no
    choice reads test_final (lopd_core/envs/held_out.py)."""
    ev = params.eval
    return _with_eval(
        params,
        [*[s for s in ev.splits if s != FINAL_SPLIT], *[s for s in REPORT_SPLITS if s not in ev.splits]],
        eval_n,
        [*ev.modes, *[m for m in REPORT_MODES if m not in ev.modes]],
        experience=ev.with_experience,
        benchmarks=True,
    )


class CurveProbe:
    """run_lopd's `on_step` hook: held-out test_id success at the marked steps. The points are kept in `path`
    as they come, so a resumed run keeps those it has."""

    def __init__(self, params: Params, marks: list[int], n: int, path: Path, log=print):
        self.params, self.marks, self.path, self.log = _with_eval(params, ["test_id"], n), set(marks), path, log
        self.points = {int(p["step"]): p for p in json.loads(path.read_text())} if path.exists() else {}
        self.seconds = 0.0

    def __call__(self, distiller, result) -> None:
        if distiller.state.step in self.marks:
            self.record(distiller.state.step, distiller.state.rollouts, distiller.student, distiller.tokenizer)

    def record(self, step: int, rollouts: int, model, tokenizer) -> None:
        started = time.perf_counter()
        results = evaluate(model, tokenizer, self.params, log=self.log)
        self.seconds += time.perf_counter() - started
        self.points[step] = {"step": step, "rollouts": rollouts, **_cells(pool_envs(results, self.params.envs.mix))}
        self.path.write_text(json.dumps(self.curve(), indent=2))

    def curve(self) -> list[dict]:
        return [self.points[s] for s in sorted(self.points)]


def run_method(
    params: Params,
    method: str,
    out_dir: str | Path,
    *,
    budget: int,
    bank_rollouts: int,
    bank_dir: str | None = None,
    index_dir: str | None = None,
    phi0: str | None = None,
    curve_points: int = 4,
    curve_n: int = 32,
    eval_n: int = 100,
    validation_n: int = 0,
    curve_marks: list[int] | None = None,
    log=print,
) -> dict:
    """Train `method` from params.model to `budget` through the cycle's distill stage function; returns (and
    writes to out_dir/summary.json) the run's numbers. `validation_n` > 0: a tuning run, evaluated at the end on
    that many train-split tasks only."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps, spent = plan_steps(params, method, budget, bank_rollouts)
    p = run_params(params, method, out, steps, phi0=phi0, bank_dir=bank_dir, index_dir=index_dir)
    marks = curve_steps(p, steps, spent, curve_points, curve_marks)
    probe = CurveProbe(p, marks, curve_n, out / "curve.json", log)
    if 0 not in probe.points:  # the starting policy: the student before its first step
        model, tokenizer = load_policy(p.model)
        probe.record(0, spent, model, tokenizer)
        del model
    eval_s, probe.seconds = probe.seconds, 0.0
    started = time.perf_counter()
    trained = run_lopd(p, resume=True, initial_rollouts=spent, on_step=probe, log=log)
    train_s = time.perf_counter() - started - probe.seconds
    eval_s += probe.seconds

    started = time.perf_counter()
    results = final_evaluation(p, trained["student"], out / "eval.json", eval_n, validation_n, log)
    eval_s += time.perf_counter() - started
    timing = {"train_seconds": round(train_s, 2), "eval_seconds": round(eval_s, 2)}
    summary = run_summary(p, budget, steps, spent, trained, results, probe.curve(), timing)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def curve_steps(p: Params, steps: int, spent: int, curve_points: int, curve_marks: list[int] | None) -> list[int]:
    """The steps after which the held-out curve is read: the first step whose rollouts reach each of
    `curve_marks` (the same rollout counts for every method, whatever its bank cost; a mark the bank's rollouts
    already passed is the starting point's), plus the last step; without marks, `curve_points` evenly spaced."""
    if not curve_marks:
        return sorted({max(1, round(steps * k / curve_points)) for k in range(1, curve_points + 1)})
    per_step = p.lopd.tasks_per_step * p.lopd.samples_per_task
    at = {min(steps, -(-(mark - spent) // per_step)) for mark in curve_marks if mark > spent}
    return sorted(at | {steps})


def run_params(
    params: Params, method: str, out: Path, steps: int, *, phi0: str | None, bank_dir: str | None, index_dir: str | None
) -> Params:
    """The distill stage's params for one run: the method, its steps, its own folder, φ0 and the seed bank."""
    p = copy.deepcopy(params)
    p.lopd = dataclasses.replace(p.lopd, method=method, steps=steps, out_dir=str(out), csv=str(out / "distill.csv"))
    # no φ0: a method whose teacher reads no latents gets a fresh (unused) composer
    p.coldstart = dataclasses.replace(p.coldstart, out=phi0 or "", fit_out=phi0 or "")
    if bank_dir:
        p.bank = dataclasses.replace(p.bank, dir=bank_dir, index_dir=index_dir or p.bank.index_dir)
    return p


def final_evaluation(p: Params, student: str, path: Path, eval_n: int, validation_n: int, log=print) -> dict:
    """The exported student's evaluation, written to `path`: the cycle's (final_eval_params), or for a tuning run
    (`validation_n` > 0) validation tasks of the train split, never the evaluate stage's test splits."""
    if validation_n:
        model, tokenizer = load_policy(dataclasses.replace(p.model, name_or_path=student))
        results = evaluate(model, tokenizer, _with_eval(p, ["train"], validation_n), log=log)
        del model
        write_metrics(results, path)
        return results
    final = final_eval_params(p, eval_n)
    final.model = dataclasses.replace(p.model, name_or_path=student)
    return run_evaluate(final, path, log=log)


def run_summary(
    p: Params, budget: int, steps: int, spent: int, trained: dict, results: dict, curve: list[dict], timing: dict
) -> dict:
    """The numbers of one run, as summary.json keeps them and the report reads them."""
    out = Path(p.lopd.out_dir)
    envs = [e for e in p.envs.mix if e in results]
    return {
        "method": p.lopd.method,
        "world": p.envs.deploy_worlds[0],
        "seed": p.seed,
        "lr": p.lopd.lr_student,
        "budget": budget,
        "steps": steps,
        "bank_rollouts": spent,
        "rollouts": trained["rollouts"],
        **timing,
        "final_beta": trained["beta"],
        "margin": trained["margin"],
        "csv": str(out / "distill.csv"),
        "eval": str(out / "eval.json"),
        "student": trained["student"],
        "envs": envs,
        "bank": {
            "rows": trained["bank_rows"],
            "added": trained["bank_added"],
            "refreshes": trained["bank_refreshes"],
            "dir": trained["bank_dir"],
        },
        "curve": curve,
        # the mix's environments pooled (one environment: its own cells); per environment under by_env
        "final": _final(pool_envs(results, envs)),
        "by_env": {env: _final(results[env]) for env in envs},
    }


def pool_envs(results: dict, envs) -> dict:
    """{split: {mode: cell}} of the environments `envs` of an eval.json: one environment's cells as they are,
    several pooled (their tasks together, as one sample; by_domain merged)."""
    sections = [results[e] for e in envs if e in results]
    if len(sections) == 1:
        return sections[0]
    cells: dict[str, dict[str, list[dict]]] = {}
    for section in sections:
        for split, modes in section.items():
            for mode, cell in modes.items():
                cells.setdefault(split, {}).setdefault(mode, []).append(cell)
    return {split: {mode: _pool(cs) for mode, cs in modes.items()} for split, modes in cells.items()}


def _pool(cells: list[dict]) -> dict:
    n = sum(c["n"] for c in cells)
    wins = round(sum(c["success_rate"] * c["n"] for c in cells))
    domains: dict[str, list[float]] = {}
    for c in cells:
        for domain, d in c.get("by_domain", {}).items():
            acc = domains.setdefault(domain, [0.0, 0])
            acc[0] += d["success_rate"] * d["n"]
            acc[1] += d["n"]
    return {
        "success_rate": round(wins / n, 4) if n else 0.0,
        "reward_mean": round(sum(c["reward_mean"] * c["n"] for c in cells) / n, 4) if n else 0.0,
        "n": n,
        "ci95": wilson_interval(wins, n),
        "by_domain": {d: {"success_rate": round(w / k, 4), "n": k} for d, (w, k) in sorted(domains.items())},
    }


def _final(section: dict) -> dict:
    return {
        split: {
            mode: {
                "success_rate": cell["success_rate"],
                "reward_mean": cell["reward_mean"],
                "n": cell["n"],
                "by_domain": cell.get("by_domain", {}),
            }
            for mode, cell in modes.items()
        }
        for split, modes in section.items()
    }


def _cells(pooled: dict) -> dict:
    """test_id success and reward per mode, flat: {"greedy_success": .., "sampled_reward": ..}."""
    cells = pooled["test_id"]
    return {
        f"{mode}_{k}": cells[mode][f"{k}_rate" if k == "success" else f"{k}_mean"]
        for mode in REPORT_MODES
        for k in ("success", "reward")
    }
