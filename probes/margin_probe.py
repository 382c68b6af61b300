"""What privileged margin δ̄ can a teacher hold on this base's own rollouts, and under which advantage?

    python probes/margin_probe.py [--tasks 96] [--samples 4] [--methods lopd text_experience ...]
        [--set lopd.margin=0.05 ...]

Needs the bank and φ0 of the params' paths (`lopd bank`, `lopd coldstart`). The base rolls out `--tasks`
training tasks × `--samples` at the distillation temperature, once; then every teacher of the listed methods
scores those same trajectories through `Distiller.update` — the product's own code path, with both learning
rates at 0 so that no weight moves and every teacher sees the step-0 student (the base). Each update returns,
per trajectory, g(τ) = mean over its action tokens of log p_T(a) − log p_S(a). From the g(τ) and the rewards:

* δ̄ under each advantage (`continuous` 2r − 1, `binary` ±1 on success, `group` r − group mean):
  δ̄ = Σ_τ n_τ A(τ) g(τ) / Σ_τ n_τ, with a 95 % interval from resampling tasks;
* the mean g on successes and on failures (token-weighted), whose difference is what experience should buy;
* the same under `centred`, for the centred gap g + KL(p_S ‖ p_T), which a teacher that is merely different
  from the student cannot raise (a probe-only figure: the trainer has no such option).

Why: the method asks the composer to keep δ̄ ≥ m (DESIGN §3, m = 0.05 nats per action token). If no teacher —
not the base reading the same experiences as text, not the base reading the task's golden solution — reaches m
on these rollouts, the constraint cannot hold here and β rises without end by construction. And a teacher that
is merely sharper than the student (the sharpened-teacher control) earns δ̄ under `continuous`, where most
trajectories carry A > 0, but little under `group`, whose advantages sum to zero within a task. Prints JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dataclasses import replace

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.config import load_params
from lopd_core.distill.loop.build import load_composer
from lopd_core.distill.loop.trainer import Distiller
from lopd_core.distill.scoring import losses as L
from lopd_core.drivers.distill import method_retriever, new_composer, open_bank
from lopd_core.envs.mix import mixed_tasks
from lopd_core.methods import METHOD_NAMES, method_spec
from lopd_core.model.chat import ChatCodec
from lopd_core.model.loading import load_policy, model_path
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

DEFAULT_METHODS = ("lopd", "lopd_random_retrieval", "text_experience", "opsd", "skill_sd", "sharpened_teacher")
ADVANTAGES = ("continuous", "binary", "group")
PROBE_SEED_OFFSET = 909  # tasks apart from the bank's (seed + 101, + 202) and the trainer's (seed + 17)


def teacher_gaps(params, method: str, tasks, trajs, log) -> tuple[list[float], list[float]]:
    """g(τ) and the mean KL(p_S ‖ p_T) over τ's action tokens, for every trajectory under `method`'s teacher at
    step 0 (learning rates 0: nothing moves). g + KL is the centred gap (probe only)."""
    p = copy.deepcopy(params)
    p.lopd = replace(p.lopd, method=method)
    spec = method_spec(method, p.baselines)
    torch.manual_seed(p.seed)
    model, tokenizer = load_policy(p.model)
    composer = load_composer(p.coldstart.out, model, p.composer) if spec.needs_composer else new_composer(p, model)
    bank = open_bank(p) if spec.uses_bank else None
    try:
        d = Distiller(p, model, tokenizer, method_retriever(spec, bank, p), composer=composer, log=log)
        for opt in (d.opt_theta, d.opt_phi):  # learning rates 0 (no setting takes it): nothing moves
            for group in opt.param_groups:
                group["lr"] = 0.0
        g, kl, per = [], [], p.lopd.tasks_per_step
        for s in range(0, len(tasks), per):
            out = d.update(tasks[s : s + per], trajs[s * p.lopd.samples_per_task : (s + per) * p.lopd.samples_per_task])
            g += out.trajectory_gaps
            kl += out["trajectory_kl"]
    finally:
        if bank is not None:
            bank.close()
    return g, kl


def delta_bar(gaps: torch.Tensor, counts: torch.Tensor, adv: torch.Tensor) -> float:
    return float((counts * adv * gaps).sum() / counts.sum())


def summarize(gaps: list[float], trajs, samples: int, boot: int, seed: int) -> dict:
    g = torch.tensor(gaps, dtype=torch.float64)
    n = torch.tensor([t.num_action_tokens for t in trajs], dtype=torch.float64)
    r = torch.tensor([t.reward for t in trajs])
    ok = torch.tensor([t.success for t in trajs])
    groups = torch.arange(len(trajs)) // samples
    adv = {k: L.advantages(r, kind=k, successes=ok, group_ids=groups).double() for k in ADVANTAGES}
    rng = random.Random(seed)
    n_tasks = len(trajs) // samples
    out = {}
    for k in ADVANTAGES:
        point = delta_bar(g, n, adv[k])
        draws = []
        for _ in range(boot):  # resample tasks (a task's samples stay together, as `group` needs)
            pick = torch.tensor(
                [t * samples + j for t in (rng.randrange(n_tasks) for _ in range(n_tasks)) for j in range(samples)]
            )
            draws.append(delta_bar(g[pick], n[pick], adv[k][pick]))
        draws.sort()
        out[f"delta_{k}"] = round(point, 4)
        out[f"delta_{k}_ci95"] = [round(draws[int(0.025 * boot)], 4), round(draws[int(0.975 * boot) - 1], 4)]

    def weighted(mask):
        return round(float((n[mask] * g[mask]).sum() / n[mask].sum()), 4) if mask.any() else None

    out["gap_success"], out["gap_failure"] = weighted(ok), weighted(~ok)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--tasks", type=int, default=96, help="training tasks rolled out (× --samples)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHOD_NAMES)
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = load_params(args.params, args.overrides)
    params.lopd = replace(params.lopd, samples_per_task=args.samples)
    for method in args.methods:
        if method_spec(method, params.baselines).needs_composer and not Path(params.coldstart.out).exists():
            raise SystemExit(
                f"no cold-start composer at {params.coldstart.out}: run `lopd bank` and `lopd coldstart` first"
            )

    def log(message: str) -> None:
        print(message, file=sys.stderr)

    started = time.perf_counter()
    model, tokenizer = load_policy(params.model)
    tasks = mixed_tasks(params.envs.mix, "train", args.tasks, params.seed + PROBE_SEED_OFFSET)
    ro = params.rollout
    sampling = Sampling(
        temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens, max_context=ro.max_context
    )
    requests = [RolloutRequest(t, sample_index=g) for t in tasks for g in range(args.samples)]
    trajs = rollout(
        model, ChatCodec(tokenizer), requests, sampling=sampling, batch_size=ro.batch_size, seed=params.seed
    )
    del model
    log(
        f"margin probe: {len(trajs)} rollouts, {sum(t.success for t in trajs)} successes "
        f"({time.perf_counter() - started:.0f}s)"
    )
    teachers = {}
    for method in args.methods:
        t = time.perf_counter()
        gaps, kls = teacher_gaps(params, method, tasks, trajs, log=lambda m: None)
        teachers[method] = summarize(gaps, trajs, args.samples, args.bootstrap, params.seed)
        teachers[method]["centred"] = summarize(
            [g + k for g, k in zip(gaps, kls)], trajs, args.samples, args.bootstrap, params.seed
        )
        log(f"margin probe: {method}: {teachers[method]} ({time.perf_counter() - t:.0f}s)")
    rewards = [t.reward for t in trajs]
    print(
        json.dumps(
            {
                "model": str(model_path(params.model)),
                "composer": params.coldstart.out,
                "margin_m": params.lopd.margin,
                "tasks": args.tasks,
                "samples": args.samples,
                "rollouts": len(trajs),
                "success_rate": round(sum(t.success for t in trajs) / len(trajs), 4),
                "share_positive_continuous_advantage": round(sum(r > 0.5 for r in rewards) / len(rewards), 4),
                "reward_mean": round(sum(rewards) / len(rewards), 4),
                "teachers": teachers,
                "seconds": round(time.perf_counter() - started, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
