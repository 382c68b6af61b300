"""Where does the base go wrong? Teacher-forced accuracy on clean oracle demonstrations, by kind of token.

    python probes/warmstart_probe.py --model data/base [--tasks 60] [--split test_id]

A task is solved only if every action token is right, so the success rate hides *which* skill is missing.
This replays clean oracle demonstrations (the task's own world conventions, no slips) through the model and
reports argmax accuracy on the action tokens, split into: structural tokens (frequent JSON/call syntax),
tool names, values copied from the instruction, values copied from earlier forced context (observations,
system prompt), and the rest; plus the demonstrations the model would reproduce exactly. Prints JSON.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.envs import DOMAINS, make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.model.demos import encode_demo, play


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="data/base")
    ap.add_argument("--tasks", type=int, default=60)
    ap.add_argument("--split", default="test_id")
    ap.add_argument("--seed", type=int, default=123)
    args = ap.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    codec = ChatCodec(tokenizer)
    tasks = make_tasks("toolworld", args.split, args.tasks, args.seed)
    records, frequency, exact = [], collections.Counter(), 0
    for task in tasks:
        demo, _, _ = play(task)
        seq = encode_demo(demo, codec)
        with torch.no_grad():
            predicted = model(torch.tensor([seq.token_ids])).logits[0, :-1].argmax(-1).tolist()
        instruction = set(codec.encode(demo.user))
        forced_so_far: set[int] = set()
        all_right = True
        for i in range(1, len(seq)):
            if not seq.action_mask[i - 1]:
                forced_so_far.add(seq.token_ids[i - 1])
            if seq.action_mask[i]:
                target = seq.token_ids[i]
                right = predicted[i - 1] == target
                all_right &= right
                frequency[target] += 1
                records.append((target, right, target in instruction, target in forced_so_far))
        exact += all_right
    common = {t for t, n in frequency.items() if n >= len(tasks) / 2}
    tool_prefixes = tuple(f"{d}_" for d in DOMAINS)
    kinds: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for target, right, in_instruction, in_context in records:
        text = tokenizer.decode([target])
        kind = (
            "structural"
            if target in common
            else "tool_name"
            if text.startswith(tool_prefixes)
            else "copy_instruction"
            if in_instruction
            else "copy_context"
            if in_context
            else "other"
        )
        kinds[kind][0] += right
        kinds[kind][1] += 1
    total_right = sum(k[0] for k in kinds.values())
    total = sum(k[1] for k in kinds.values())
    print(
        json.dumps(
            {
                "model": args.model,
                "split": args.split,
                "tasks": len(tasks),
                "action_token_accuracy": round(total_right / total, 4),
                "exact_demonstrations": exact,
                "by_kind": {k: {"accuracy": round(r / n, 4), "n": n} for k, (r, n) in sorted(kinds.items())},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
