"""The warm start's optimizer, side by side: step time, and what a fixed number of steps teaches.

    python probes/warmstart_optimizer.py [--steps 1000] [--demos 3000] [--seed 0]

The embedded base's build is bound by optimizer steps (docs/experiments/): bigger batches at fewer steps, or
smaller at more, both learned less. So an optimizer is judged by progress per step against its cost per step:

1. *Step time* of AdamW, `torch.optim.Muon` and `StackedMuon` (lopd_core/model/muon.py) for the layer matrices
   (AdamW for the rest), on the same warm-start batches, interleaved in rounds; medians.
2. *Progress*: the same model trained `--steps` steps from the same seed with each recipe (cosine schedule,
   the params.yaml rates), then the held-out demonstrations' action-token NLL. The context loss runs on every
   forced position here (not the build's random share), so that the optimizers are all that differs.

Prints JSON with the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import replace

import torch

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.config import WarmStartConfig, load_params
from lopd_core.model.chat import ChatCodec
from lopd_core.model.demos import build_demos, encode_demo
from lopd_core.model.drills import build_drills, encode_drill
from lopd_core.model.loading import tiny_qwen3
from lopd_core.model.tokenizer import train_tokenizer
from lopd_core.model.warmstart import collate, first_action, make_optimizers, pack_batches, train_step


def warm_start_data(params, n_demos: int, seed: int):
    ws = params.model.warmstart
    demos = build_demos(
        n=n_demos,
        experience_fraction=ws.experience_fraction,
        max_experiences=ws.max_experiences,
        convention_noise=ws.convention_noise,
        slip=ws.slip,
        seed=seed,
    )
    tokenizer = train_tokenizer((d.text() for d in demos), params.model.tiny.vocab_size)
    codec = ChatCodec(tokenizer)
    seqs = [encode_demo(d, codec) for d in demos]
    held_out, seqs = seqs[-n_demos // 10 :], seqs[: -n_demos // 10]
    train = seqs + [encode_drill(d, codec) for d in build_drills((d.text() for d in demos), n_demos, seed)]
    train += [first_action(s) for s in seqs]
    return tokenizer, codec, train, held_out


def optimizers_for(model, ws: WarmStartConfig, kind: str):
    if kind == "adamw":
        return make_optimizers(model, replace(ws, optimizer="adamw"))
    adamw, stacked = make_optimizers(model, replace(ws, optimizer="muon"))
    if kind == "stacked_muon":
        return [adamw, stacked]
    # torch_muon: the same split, torch's one-matrix-at-a-time Muon for the matrices
    muon = torch.optim.Muon(
        [p for g in stacked.param_groups for p in g["params"]],
        lr=ws.muon_lr,
        weight_decay=0.01,
        adjust_lr_fn="match_rms_adamw",
    )
    for group in muon.param_groups:
        group["initial_lr"] = ws.muon_lr
    return [adamw, muon]


def held_out_nll(model, held_out, codec) -> float:
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for idx in pack_batches(held_out, 4096, random.Random(0)):
            ids, attention, labels, _ = collate([held_out[i] for i in idx], codec.pad_id)
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
            targets = labels[:, 1:]
            where = targets != -100
            total += torch.nn.functional.cross_entropy(logits[where], targets[where], reduction="sum").item()
            count += int(where.sum())
    model.train()
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--demos", type=int, default=3000)
    ap.add_argument("--timing-steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    params = load_params(args.params)
    ws = replace(params.model.warmstart, context_loss_fraction=1.0)  # the optimizers are all that differs
    tokenizer, codec, train, held_out = warm_start_data(params, args.demos, args.seed)
    batches = pack_batches(train, ws.batch_tokens, random.Random(args.seed))

    kinds = ["adamw", "torch_muon", "stacked_muon"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for round_ in range(3):  # interleaved rounds: a busy spell of the machine hits every recipe alike
        for kind in kinds:
            torch.manual_seed(args.seed)
            model = tiny_qwen3(params.model.tiny, tokenizer)
            optimizers = optimizers_for(model, ws, kind)
            for k in range(args.timing_steps + 5):
                batch = [train[i] for i in batches[(round_ * 97 + k) % len(batches)]]
                t0 = time.perf_counter()
                train_step(model, optimizers, batch, codec.pad_id, ws, 1.0)
                if k >= 5:
                    times[kind].append(time.perf_counter() - t0)
    step_ms = {k: round(1000 * statistics.median(v), 1) for k, v in times.items()}

    nll = {}
    for kind in ("adamw", "stacked_muon"):
        torch.manual_seed(args.seed)
        model = tiny_qwen3(params.model.tiny, tokenizer)
        optimizers = optimizers_for(model, ws, kind)
        for step in range(args.steps):
            warm = min(1.0, (step + 1) / ws.warmup_steps)
            factor = warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
            train_step(model, optimizers, [train[i] for i in batches[step % len(batches)]], codec.pad_id, ws, factor)
        nll[kind] = round(held_out_nll(model, held_out, codec), 4)
        print(f"{kind}: held-out action NLL {nll[kind]} after {args.steps} steps", flush=True)

    print(
        json.dumps(
            {
                "step_ms": step_ms,
                "step_time_ratio": {
                    "torch_muon/adamw": round(step_ms["torch_muon"] / step_ms["adamw"], 2),
                    "stacked_muon/adamw": round(step_ms["stacked_muon"] / step_ms["adamw"], 2),
                    "stacked_muon/torch_muon": round(step_ms["stacked_muon"] / step_ms["torch_muon"], 2),
                },
                "held_out_action_nll": nll,
                "steps": args.steps,
                "demos": args.demos,
                "seed": args.seed,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
