"""`lopd evaluate`: success rate, mean reward, n and a 95% interval per environment, split and decoding mode.

Both decoding modes are always reported: for a small model, sampled success at temperature 1 mostly measures
how sharp the policy is (any sharper policy raises it), while greedy success measures what it knows. With
`eval.with_experience`, each split is also played with same-world oracle successes as text in the first user
turn (reported as `<split>+experience`): that measures whether the policy can use experience in context,
which the latent teacher depends on.

Output (DESIGN §5): {env: {split: {mode: {success_rate, reward_mean, n, ci95}}}}; ci95 is the Wilson score
interval [low, high] of the success rate.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from lopd_core.config import Params
from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.model.demos import ExperiencePool
from lopd_core.rollout.engine import RolloutRequest, Sampling, Trajectory, rollout

EVAL_SEED_OFFSET = 1_000_003  # evaluation tasks come from their own seed stream, apart from training's


def wilson_interval(successes: int, n: int, z: float = 1.96) -> list[float]:
    if n == 0:
        return [0.0, 1.0]
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def summarize(trajectories: list[Trajectory]) -> dict:
    n = len(trajectories)
    wins = sum(t.success for t in trajectories)
    return {
        "success_rate": round(wins / n, 4) if n else 0.0,
        "reward_mean": round(sum(t.reward for t in trajectories) / n, 4) if n else 0.0,
        "n": n,
        "ci95": wilson_interval(wins, n),
    }


def evaluate(model, tokenizer, params: Params, log=print) -> dict:
    codec = ChatCodec(tokenizer)
    ev, ro = params.eval, params.rollout
    results: dict = {}
    for env_name in params.envs.mix:
        results[env_name] = {}
        pool = None
        for split in ev.splits:
            tasks = make_tasks(env_name, split, ev.n_per_split, params.seed + EVAL_SEED_OFFSET)
            variants = [(split, [RolloutRequest(t) for t in tasks])]
            if ev.with_experience:
                if pool is None:
                    pool = ExperiencePool(make_tasks(env_name, "train", 400, params.seed + 2 * EVAL_SEED_OFFSET))
                rng = random.Random(params.seed)
                variants.append((f"{split}+experience", [
                    RolloutRequest(t, experiences=tuple(pool.sample(t, ev.num_experiences, rng))) for t in tasks
                ]))
            for name, requests in variants:
                results[env_name][name] = {}
                for mode in ev.modes:
                    temperature = 0.0 if mode == "greedy" else ev.temperature
                    sampling = Sampling(temperature=temperature, top_p=ro.top_p,
                                        max_new_tokens=ro.max_new_tokens, max_context=ro.max_context)
                    trajs = rollout(model, codec, requests, sampling=sampling, batch_size=ro.batch_size,
                                    seed=params.seed)
                    results[env_name][name][mode] = summary = summarize(trajs)
                    log(f"eval {env_name}/{name}/{mode}: success {summary['success_rate']:.3f} "
                        f"{summary['ci95']} reward {summary['reward_mean']:.3f} (n={summary['n']})")
    return results


def write_metrics(results: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True))
    tmp.replace(path)
    return path
