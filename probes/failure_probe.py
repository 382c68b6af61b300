"""Why does the base fail a task? The first wrong action token of each clean oracle demonstration, by kind.

    python probes/failure_probe.py --model data/base [--tasks 200] [--split test_id]

Each held-out task's oracle demonstration (its own world's conventions, no slips) is replayed through the model
teacher-forced. A task is reproduced exactly when every action token is the argmax, which tracks greedy success
closely. For the others the first wrong token is classed as:

* `convention` — where the oracle under another world's conventions parts ways (which payment tool, `/notes` or
  `notes`, an extra confirmation): what experience is meant to fix;
* `copy_observation` / `copy_instruction` — a value that appears earlier in an observation / the instruction
  (an id, a balance, a name): what a pretrained LLM copies without thinking, and a tiny base must learn;
* `other` — anything else (a date rewritten in the world's format, a computed total, call syntax).

Also counted over all action tokens: tasks with no wrong token at a convention decision (`no_convention_error`)
and tasks with no wrong token anywhere else (`no_other_error`), i.e. the success rate the base would have if it
knew every convention / if it copied and computed perfectly. And, as a check on the skill itself, the share of
held-out copy and lookup drills (`lopd_core/model/drills.py`, the kinds the warm start mixes in) whose answer is
reproduced exactly. Prints JSON, with a few examples per kind.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.envs import WORLDS, make_tasks
from lopd_core.evaluation import EVAL_SEED_OFFSET
from lopd_core.model.chat import ChatCodec
from lopd_core.model.demos import build_demos, encode_demo, play
from lopd_core.model.drills import build_drills, encode_drill


def convention_positions(task, seq, codec) -> set[int]:
    """Token positions where the demonstration under some other world's conventions first differs."""
    positions = set()
    for world in WORLDS:
        if world == task.world:
            continue
        other = encode_demo(play(task, conventions_world=world)[0], codec).token_ids
        first = next((k for k in range(min(len(seq.token_ids), len(other))) if seq.token_ids[k] != other[k]), None)
        if first is not None and seq.action_mask[first]:
            positions.add(first)
    return positions


def argmax_misses(model, seq) -> tuple[list[int], torch.Tensor]:
    """Teacher-forced: the action positions whose token is not the model's argmax, and the argmax row by row
    (row i predicts token i + 1)."""
    ids = seq.token_ids
    with torch.no_grad():
        predicted = model(torch.tensor([ids])).logits[0, :-1].argmax(-1)
    return [j for j in range(1, len(ids)) if seq.action_mask[j] and int(predicted[j - 1]) != ids[j]], predicted


def classify(tokenizer, ids: list[int], j: int, conventions: set[int]) -> str:
    if j in conventions:
        return "convention"
    value = tokenizer.decode([ids[j]]).strip().strip('" ,:{}[]')
    before = tokenizer.decode(ids[:j])
    cut = before.find("<|im_start|>assistant")
    instruction, later = before[:cut], before[cut:]
    if value and value in instruction:
        return "copy_instruction"
    if value and value in later:
        return "copy_observation"
    return "other"


def probe(model, tokenizer, tasks, examples_per_kind: int = 3) -> dict:
    codec = ChatCodec(tokenizer)
    first = collections.Counter()
    counts = collections.Counter()
    examples = collections.defaultdict(list)
    wrong_tokens = action_tokens = 0
    for task in tasks:
        seq = encode_demo(play(task)[0], codec)
        ids = seq.token_ids
        wrong, predicted = argmax_misses(model, seq)
        action_tokens += sum(seq.action_mask)
        wrong_tokens += len(wrong)
        if not wrong:  # exact: no error of either kind, and no need to replay the other worlds
            counts.update(("exact", "no_convention_error", "no_other_error"))
            continue
        conventions = convention_positions(task, seq, codec)
        counts["no_convention_error"] += not any(j in conventions for j in wrong)
        counts["no_other_error"] += not any(j not in conventions for j in wrong)
        kind = classify(tokenizer, ids, wrong[0], conventions)
        first[kind] += 1
        if len(examples[kind]) < examples_per_kind:
            examples[kind].append(
                {
                    "template": task.template,
                    "want": tokenizer.decode([ids[wrong[0]]]),
                    "got": tokenizer.decode([int(predicted[wrong[0] - 1])]),
                }
            )
    n = len(tasks)
    return {
        "tasks": n,
        "exact": round(counts["exact"] / n, 3),
        "no_convention_error": round(counts["no_convention_error"] / n, 3),
        "no_other_error": round(counts["no_other_error"] / n, 3),
        "first_error": dict(first.most_common()),
        "wrong_tokens_per_task": round(wrong_tokens / n, 2),
        "action_tokens_per_task": round(action_tokens / n, 1),
        "examples": examples,
    }


def drill_kind(drill: tuple[str, str, str]) -> str:
    kind, user, _ = drill
    if kind == "copy":
        return "copy"
    return "lookup_id" if user.rsplit("\n", 1)[-1].startswith("id of") else "lookup_value"


def drill_exact_share(model, tokenizer, n: int = 300, seed: int = 99) -> dict[str, float]:
    """Share of fresh drills whose every answer token is the argmax (teacher-forced), by kind."""
    codec = ChatCodec(tokenizer)
    texts = [
        d.text()
        for d in build_demos(
            n=300, experience_fraction=0.0, max_experiences=1, convention_noise=0.0, slip=0.0, seed=seed
        )
    ]
    hits: dict[str, list[int]] = {}
    for drill in build_drills(texts, n, seed):
        row = hits.setdefault(drill_kind(drill), [0, 0])
        row[0] += not argmax_misses(model, encode_drill(drill, codec))[0]
        row[1] += 1
    return {kind: round(a / b, 3) for kind, (a, b) in sorted(hits.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="data/base")
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--split", default="test_id")
    ap.add_argument("--seed", type=int, default=0, help="the evaluation's task seed (same tasks as lopd evaluate)")
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tasks = make_tasks("toolworld", args.split, args.tasks, args.seed + EVAL_SEED_OFFSET)
    out = {
        "model": args.model,
        "split": args.split,
        **probe(model, tokenizer, tasks),
        "drills_exact": drill_exact_share(model, tokenizer),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
