"""Does the base know each world's conventions, and does experience in context help? Teacher-forced, clean oracle.

    python benchmarks/convention_probe.py --model data/base [--tasks 300] [--split test_id]

Two measurements on the same held-out tasks (their own world's conventions, no slips):

* **conventions** — at every convention decision (the first action token where the task's oracle and the oracle
  under another world's conventions part ways: which payment tool, `/notes` or `notes`, `OSL` or `oslo`, an extra
  confirmation step), the probability the base puts on its own world's choice (`p_right`) and on the other
  world's (`p_other`), per world. A base that reads the `[world]` tag would approach the warm start's ≈ 0.8 /
  0.2 (convention noise 0.3); one that ignores it splits its mass between the two.
* **log-likelihood** — the oracle's action tokens' total log-probability per task (nats; higher is better, and
  comparable across tokenizers since it is the probability of the same text), `p_seq` its mean exp (the chance
  that sampling at temperature 1 reproduces the oracle exactly) and `exact` the share of tasks whose every
  action token is the argmax; without and with three same-world successes in context (the evaluation's pool).

These are the smooth numbers the warm-start recipe was tuned on: greedy success over 200 tasks moves by a few
tasks between equally good bases, while the log-likelihood over 300 separates recipes (seed-to-seed spread of a
build ≈ 0.6 nats). Prints JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.envs import WORLDS, make_tasks
from lopd_core.evaluation import EVAL_SEED_OFFSET
from lopd_core.model.chat import ChatCodec
from lopd_core.model.demos import Demo, ExperiencePool, encode_demo, play


def _logprobs(model, seq) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([seq.token_ids])).logits[0, :-1].float(), -1)  # (T-1, V)


def convention_choices(model, codec, tasks) -> dict:
    stats: dict = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for task in tasks:
        demo, _, _ = play(task)
        seq = encode_demo(demo, codec)
        lp = _logprobs(model, seq)
        for world in WORLDS:
            if world == task.world:
                continue
            other = encode_demo(play(task, conventions_world=world)[0], codec)
            j = next((j for j in range(min(len(seq), len(other))) if seq.token_ids[j] != other.token_ids[j]), None)
            if j is None or not seq.action_mask[j]:
                continue  # the two worlds agree on this task (or part ways only in an observation)
            row = stats[task.world]
            row[0] += math.exp(lp[j - 1, seq.token_ids[j]])
            row[1] += math.exp(lp[j - 1, other.token_ids[j]])
            row[2] += 1
    return {w: {"p_right": round(r / n, 3), "p_other": round(o / n, 3), "decisions": n}
            for w, (r, o, n) in sorted(stats.items())}


def oracle_likelihood(model, codec, tasks, pool: ExperiencePool | None, rng: random.Random) -> dict:
    ll_sum = p_sum = exact = 0.0
    for task in tasks:
        demo, _, _ = play(task)
        if pool is not None:
            demo = Demo(demo.system, demo.user, tuple(pool.sample(task, 3, rng)), demo.actions, demo.observations,
                        demo.world_followed)
        seq = encode_demo(demo, codec)
        lp = _logprobs(model, seq)
        target = torch.tensor(seq.token_ids[1:])
        mask = torch.tensor(seq.action_mask[1:], dtype=torch.bool)
        ll = float(lp.gather(-1, target[:, None]).squeeze(-1)[mask].sum())
        ll_sum += ll
        p_sum += math.exp(ll)
        exact += bool((lp.argmax(-1) == target)[mask].all())
    n = len(tasks)
    return {"loglik": round(ll_sum / n, 3), "p_seq": round(p_sum / n, 4), "exact": round(exact / n, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="data/base")
    ap.add_argument("--tasks", type=int, default=300)
    ap.add_argument("--split", default="test_id")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    codec = ChatCodec(tokenizer)
    tasks = make_tasks("toolworld", args.split, args.tasks, args.seed + EVAL_SEED_OFFSET)
    pool = ExperiencePool(make_tasks("toolworld", "train", 400, args.seed + 2 * EVAL_SEED_OFFSET))
    print(json.dumps({
        "model": args.model, "split": args.split, "tasks": len(tasks),
        "conventions": convention_choices(model, codec, tasks),
        "oracle_actions": {
            "without_experience": oracle_likelihood(model, codec, tasks, None, random.Random(args.seed)),
            "with_experience": oracle_likelihood(model, codec, tasks, pool, random.Random(args.seed)),
        },
    }, indent=2))


if __name__ == "__main__":
    main()
