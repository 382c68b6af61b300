"""What the official composer's options cost per step: query-conditioned encoding and the encoder LoRA, beside the
default, side by side in one run on the same rows.

Two figures per composer, each the median over `--reps` interleaved repetitions:
  * fit step — one step of the in-world fit (`lopd fit`: KL(p_text ‖ p_latent) on `--rows` of the bank's seed
    rollouts with their retrieved rows, backward and optimizer step), the encoder's cache warm as after the first
    steps of a fit (a LoRA that trains is never cached: it encodes every step);
  * latents per distillation step — composing the latents for `--rows` trajectories of new tasks, as the teacher's
    context does each step (`teacher_context`). Bank rows recur across steps, so the default's and a fixed LoRA's
    encoder states are cached (warm); a query-conditioned composer reads every row anew with each new task in front
    (cold: new tasks every step). Both are printed; the line says which applies.

    .venv/bin/python benchmarks/composer_options_cost.py [--rows 16] [--reps 5] [--lora-rank 8]

Needs `lopd base`, `lopd bank` and `lopd coldstart` (or --set bank.dir=… coldstart.out=… of a cycle's work folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.config import load_params
from lopd_core.distill.composer.coldstart import _coldstart_step, _frozen_reader
from lopd_core.distill.composer.composer import ExperienceEncoder, compose_latents
from lopd_core.distill.composer.world_fit import seed_targets
from lopd_core.distill.scoring.models import TeacherView
from lopd_core.drivers.bank import bank_paths, make_retriever, open_bank
from lopd_core.drivers.coldstart import load_phi
from lopd_core.model.loading import load_policy
from lopd_core.rollout.table import read_trajectories

OPTIONS = {"default": {}, "query-conditioned": {"query_conditioned": True}, "encoder LoRA": {"encoder_lora_rank": 8}}


def composers(params, model, lora_rank: int) -> dict:
    out = {}
    for name, change in OPTIONS.items():
        if "encoder_lora_rank" in change:
            change = {"encoder_lora_rank": lora_rank}
        p = dataclasses.replace(params, composer=dataclasses.replace(params.composer, **change))
        out[name] = load_phi(p, model, params.coldstart.out, refit=True)  # from φ0, as `lopd fit` starts
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--rows", type=int, default=16, help="trajectories per step")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    params = load_params(args.params, args.overrides)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(params.model)
    targets = seed_targets(read_trajectories(bank_paths(params)[1]))
    with open_bank(params) as bank:
        retrieve = make_retriever(bank, dataclasses.replace(params.bank.retrieval, allow_self_retrieval=False))
        texts = retrieve([t.task for t in targets])
    targets, texts = zip(*[(t, x) for t, x in zip(targets, texts) if x])
    found = {t.task.task_id: x for t, x in zip(targets, texts)}
    phis = composers(params, model, args.lora_rank)
    reader, _ = _frozen_reader(model, tokenizer, params.composer.max_experience_tokens, "none")
    opts = {name: torch.optim.AdamW(phi.parameters(), lr=1e-6) for name, phi in phis.items()}
    fit: dict[str, list[float]] = {name: [] for name in phis}
    cold: dict[str, list[float]] = {name: [] for name in phis}
    warm: dict[str, list[float]] = {name: [] for name in phis}
    batch = list(targets[: args.rows])
    tasks = [t.task for t in batch]
    for rep in range(args.reps + 1):  # the first repetition warms caches and allocators: not counted
        for name, phi in phis.items():  # interleaved: drift in the machine hits every composer alike
            started = time.perf_counter()
            phi.train()
            _coldstart_step(
                reader, phi, opts[name], batch, lambda ts: [found[t.task_id] for t in ts], kl_weight=1.0, nll_weight=0.0
            )
            fit_s = time.perf_counter() - started
            phi.eval()
            encoder = ExperienceEncoder(TeacherView(model), tokenizer, max_tokens=params.composer.max_experience_tokens)
            rows, queries = [found[t.task_id] for t in tasks], [t.instruction for t in tasks]
            with torch.no_grad():
                started = time.perf_counter()
                compose_latents(phi, encoder, rows, queries)  # new tasks: the encoder's cache is cold
                cold_s = time.perf_counter() - started
                started = time.perf_counter()
                compose_latents(phi, encoder, rows, queries)  # the same rows again: warm
                warm_s = time.perf_counter() - started
            if rep:
                fit[name].append(fit_s)
                cold[name].append(cold_s)
                warm[name].append(warm_s)
    base = statistics.median(fit["default"])
    print(f"{args.rows} trajectories a step, top_j {params.bank.top_j}, {args.reps} interleaved repetitions (medians)")
    print("| composer | fit step s | × default | latents a distillation step, s (steady state) |")
    print("|---|---|---|---|")
    for name in phis:
        f = statistics.median(fit[name])
        steady = cold[name] if name == "query-conditioned" else warm[name]
        kind = "cold: new tasks every step" if name == "query-conditioned" else "warm: cached rows"
        print(f"| {name} | {f:.3f} | {f / base:.2f}× | {statistics.median(steady):.4f} ({kind}) |")
    print(
        "latents cold / warm, s: "
        + ", ".join(f"{n} {statistics.median(cold[n]):.4f} / {statistics.median(warm[n]):.4f}" for n in phis)
    )


if __name__ == "__main__":
    main()
