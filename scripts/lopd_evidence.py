"""Base vs LOPD vs its controls at one step count and several seeds: held-out success, δ̄ and β, side by side.

    .venv/bin/python scripts/lopd_evidence.py [--steps 200] [--seeds 0 1] \\
        [--methods lopd lopd_no_margin sharpened_teacher] [--n 200] [--set lopd.advantage=group ...]

Needs the base, the bank and φ0 at the params' paths (`lopd base`, `lopd bank`, `lopd coldstart`). Each run is
`lopd distill --fresh` into data/exp/<name>/ with its curve in plots/exp/distill_<name>.csv, then `lopd
evaluate` of its student on the same `--n` test_id tasks (the evaluation seed stays the params' seed, so every
run and the base face the same tasks) into metrics/exp/<name>_eval.json (the base's under its content hash, so a
rebuilt base is evaluated again). Runs whose evaluation exists are not redone. Prints one JSON line per run and
a markdown table: greedy and sampled success with their 95 % intervals, mean reward, rollouts, δ̄ over the run
and over its last half, β at the end and its maximum, and the student's distillation loss at its maximum (a
teacher pushed away from the student shows there).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lopd_core.config import load_params
from lopd_core.model.loading import model_path
from tasks.caching import content_hash

LOPD = str(Path(sys.executable).parent / "lopd")  # the console script of this environment


def lopd(params: str | None, command: str, sets: list[str], *args: str) -> None:
    """Run `lopd COMMAND [--params FILE] ARGS --set S ...` from the project root."""
    cmd = [LOPD, command, *(["--params", params] if params else []), *args, *[a for s in sets for a in ("--set", s)]]
    print("+ lopd", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def evaluate(params: str | None, model_dir: str | None, out: Path, n: int) -> dict:
    if not out.exists():
        sets = [f"eval.n_per_split={n}", "eval.splits=[test_id]", "eval.with_experience=false"]
        if model_dir:
            sets.append(f"model.name_or_path={model_dir}")
        lopd(params, "evaluate", sets, "--out", str(out.relative_to(ROOT)))
    cell = json.loads(out.read_text())["toolworld"]["test_id"]
    return {
        mode: {"success": c["success_rate"], "ci95": c["ci95"], "reward": round(c["reward_mean"], 3)}
        for mode, c in cell.items()
    }


def curve_summary(path: Path) -> dict:
    rows = list(csv.DictReader(path.open()))
    delta = [float(r["delta"]) for r in rows]
    beta = [float(r["beta"]) for r in rows]
    loss = [float(r["distill_loss"]) for r in rows]
    half = delta[len(delta) // 2 :]
    return {
        "steps": len(rows),
        "rollouts": int(rows[-1]["rollouts"]),
        "delta_mean": round(statistics.fmean(delta), 4),
        "delta_last_half": round(statistics.fmean(half), 4),
        "beta_final": round(beta[-1], 2),
        "beta_max": round(max(beta), 2),
        "loss_max": round(max(loss), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default=None, help="the runs' configuration (default: params.yaml)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--methods", nargs="+", default=["lopd", "lopd_no_margin", "sharpened_teacher"])
    parser.add_argument("--n", type=int, default=200, help="test_id tasks per evaluation")
    parser.add_argument("--tag", default="", help="suffix of the run names (to keep variants apart)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="passed to `lopd distill` (e.g. lopd.advantage=group)",
    )
    args = parser.parse_args()
    exp = ROOT / "data" / "exp"
    # The base's evaluation is cached under its content hash: a rebuilt base is evaluated again.
    base = model_path(load_params(args.params or str(ROOT / "params.yaml")).model)
    base_eval = ROOT / f"metrics/exp/base_{content_hash(ROOT / base)[:12]}_eval.json"
    results = [{"run": "base", "test_id": evaluate(args.params, None, base_eval, args.n)}]
    for seed in args.seeds:
        for method in args.methods:
            name = f"{method}{args.tag}_s{seed}"
            out_dir, curve = exp / name, ROOT / f"plots/exp/distill_{name}.csv"
            evaluation = ROOT / f"metrics/exp/{name}_eval.json"
            if not evaluation.exists():
                sets = [
                    f"seed={seed}",
                    f"lopd.method={method}",
                    f"lopd.steps={args.steps}",
                    f"lopd.checkpoint_every={args.steps}",
                    f"lopd.out_dir={out_dir.relative_to(ROOT)}",
                    f"lopd.csv={curve.relative_to(ROOT)}",
                    *args.overrides,
                ]
                lopd(args.params, "distill", sets, "--fresh")
            results.append(
                {
                    "run": name,
                    "test_id": evaluate(args.params, str(out_dir.relative_to(ROOT) / "student"), evaluation, args.n),
                    **curve_summary(curve),
                }
            )
    for r in results:
        print(json.dumps(r))
    print("\n| run | greedy | sampled | reward (greedy) | rollouts | δ̄ | δ̄ last half | β end / max | loss max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        g, s = r["test_id"]["greedy"], r["test_id"]["sampled"]
        cells = [f"{100 * g['success']:.1f} %", f"{100 * s['success']:.1f} %", f"{g['reward']:.3f}"]
        if "steps" in r:
            cells += [
                str(r["rollouts"]),
                f"{r['delta_mean']:+.4f}",
                f"{r['delta_last_half']:+.4f}",
                f"{r['beta_final']:.2f} / {r['beta_max']:.2f}",
                f"{r['loss_max']:.3f}",
            ]
        else:
            cells += ["—"] * 5
        print(f"| {r['run']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
