"""Can LOPD's student update teach the conventions at all? The trainer's own update on oracle trajectories.

    python probes/oracle_distill_probe.py [--steps 50] [--tasks-per-step 32] [--lr 3e-4] [--set K=V ...]

On-policy LOPD was seen to leave the student's choices at convention decisions where they were
(docs/experiments/). That could be the student's own samples (states the teacher knows little about) or the
update itself. This probe removes the first cause: it feeds `Distiller.update` — reverse KL to the latent teacher,
composer step, dual ascent, exactly as `lopd distill` runs them — the clean oracle trajectories of training
tasks (reward 1, one per task), on which the latent teacher is known to be better than the student at the
decisions (convention_probe.py: p_right 0.74 with φ0's latents against 0.60). It then measures the student
without experience on held-out test_id tasks, before and after: p_right at convention decisions and the
oracle's log-likelihood and exact reproduction (convention_probe.py's measurements). Needs the base, the bank
and φ0 at the params' paths. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import types
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.config import load_params
from lopd_core.distill.loop.build import load_composer
from lopd_core.distill.loop.trainer import Distiller
from lopd_core.drivers.distill import make_retriever, open_bank
from lopd_core.envs import make_tasks
from lopd_core.envs.mix import mixed_tasks
from lopd_core.evaluation import EVAL_SEED_OFFSET
from lopd_core.model.chat import ChatCodec
from lopd_core.model.demos import encode_demo, play
from lopd_core.model.loading import load_policy
from probes.convention_probe import convention_choices, oracle_likelihood


def held_out(model, codec, tasks) -> dict:
    """p_right (mean over decisions) and the oracle's likelihood, without experience."""
    model.eval()
    per_world = convention_choices(model, codec, tasks)
    n = sum(w["decisions"] for w in per_world.values())
    out = {
        "p_right": round(sum(w["p_right"] * w["decisions"] for w in per_world.values()) / max(n, 1), 3),
        "decisions": n,
        **oracle_likelihood(model, codec, tasks, None, random.Random(0)),
    }
    model.train()
    return out


def oracle_trajectories(tasks, codec) -> list:
    """What `Distiller.update` reads from a trajectory, for each task's clean oracle demonstration."""
    out = []
    for task in tasks:
        ids = encode_demo(play(task)[0], codec)
        out.append(
            types.SimpleNamespace(token_ids=ids.token_ids, action_mask=ids.action_mask, reward=1.0, success=True)
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--tasks-per-step", type=int, default=32)
    ap.add_argument("--lr", type=float, default=None, help="lopd.lr_student (default: the params')")
    ap.add_argument("--eval-tasks", type=int, default=200)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = ap.parse_args()
    sets = [*args.overrides, "lopd.samples_per_task=1", f"lopd.tasks_per_step={args.tasks_per_step}"]
    if args.lr is not None:
        sets.append(f"lopd.lr_student={args.lr}")
    params = load_params(args.params, sets)
    torch.manual_seed(params.seed)
    model, tokenizer = load_policy(params.model)
    codec = ChatCodec(tokenizer)
    evaluation = make_tasks("toolworld", "test_id", args.eval_tasks, params.seed + EVAL_SEED_OFFSET)
    before = held_out(model, codec, evaluation)
    composer = load_composer(params.coldstart.out, model, params.composer)
    retriever = make_retriever(open_bank(params), params.bank.retrieval)
    distiller = Distiller(params, model, tokenizer, retriever, composer=composer, log=lambda *_: None)
    train = mixed_tasks(params.envs.mix, "train", args.steps * args.tasks_per_step, params.seed + 99)
    curve = []
    for s in range(args.steps):
        batch = train[s * args.tasks_per_step : (s + 1) * args.tasks_per_step]
        row = asdict(distiller.update(batch, oracle_trajectories(batch, codec)).row)
        curve.append({k: round(row[k], 4) for k in ("step", "distill_loss", "delta", "beta")})
        print(json.dumps(curve[-1]), file=sys.stderr, flush=True)
    after = held_out(distiller.student, codec, evaluation)
    print(
        json.dumps(
            {
                "steps": args.steps,
                "oracle_trajectories": args.steps * args.tasks_per_step,
                "lr_student": params.lopd.lr_student,
                "lr_composer": params.lopd.lr_composer,
                "before": before,
                "after": after,
                "first": curve[0],
                "last": curve[-1],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
