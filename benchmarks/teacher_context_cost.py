"""Why latents at all: the teacher's pass reading J·K latents against the same pass reading the experiences as text.

On the same trajectories (the bank's seed rollouts) and the same retrieved rows, side by side in one run:
  * latents — compose J·K latents (the frozen encoder's states cached per experience, as in training) and run the
              frozen teacher over the student's ids with them spliced in (step 2's scoring pass, no graph);
  * text    — the same teacher over the same ids with the rows as plain text in the same slot.
Encoding a row into the composer's states happens once per row for a whole run (cached); it is printed apart.
Printed per condition: positions the teacher reads per row (mean), seconds per pass (median over `--reps`,
interleaved), and the pass's peak memory above what the process held before it, in a fresh process per condition
(RSS sampled every 2 ms, benchmarks/step_cost.py's sampler).

`--experience-tokens N` pads each retrieved row to N tokens (its own text repeated) to stand for a realistic
experience — an agent's real trajectory runs to thousands of tokens, the embedded worlds' rows to about a
hundred: the text's cost grows with N, the latents' does not (the composer reads at most
composer.max_experience_tokens per row, once, and its states are cached).

    .venv/bin/python benchmarks/teacher_context_cost.py [--rows 16] [--experience-tokens 0 1000] [--reps 5]

Needs `lopd base`, `lopd bank` and `lopd coldstart` (φ0; the fitted φ costs the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopd_core  # noqa: F401  (offline defaults)
from benchmarks.step_cost import PeakSampler, current_rss_mb
from lopd_core.config import load_params
from lopd_core.distill.composer.composer import ExperienceEncoder, compose_latents
from lopd_core.distill.composer.reading import text_embeddings
from lopd_core.distill.composer.world_fit import seed_targets
from lopd_core.distill.scoring.models import TeacherView
from lopd_core.distill.scoring.teacher import Framing, action_logits, build_batch
from lopd_core.drivers.bank import bank_paths, make_retriever, open_bank
from lopd_core.drivers.coldstart import load_phi
from lopd_core.model.loading import load_policy
from lopd_core.rollout.table import read_trajectories


def setup(args):
    params = load_params(args.params, args.overrides)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(params.model)
    composer = load_phi(params, model, params.coldstart.out)
    targets = seed_targets(read_trajectories(bank_paths(params)[1]))[: args.rows]
    with open_bank(params) as bank:
        retrieve = make_retriever(bank, dataclasses.replace(params.bank.retrieval, allow_self_retrieval=False))
        texts = retrieve([t.task for t in targets])
    return params, model, tokenizer, composer, targets, texts


def padded(tokenizer, texts: list[list[str]], n: int) -> list[list[str]]:
    """Each row's text repeated until it holds at least `n` tokens, then cut to `n` (0: as it is)."""
    if not n:
        return texts
    out = []
    for row in texts:
        new = []
        for text in row:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] or [0]
            ids = (ids * (n // len(ids) + 1))[:n]
            new.append(tokenizer.decode(ids))
        out.append(new)
    return out


def pass_once(kind: str, params, model, tokenizer, composer, encoder, targets, texts) -> int:
    """One teacher pass of `kind` over the rows; returns the positions read per row (mean)."""
    framing = Framing.from_tokenizer(tokenizer)
    ids, masks = [t.token_ids for t in targets], [t.action_mask for t in targets]
    with torch.no_grad():  # the teacher's scoring pass (step 2), as the default frozen composer runs it
        if kind == "latents":
            ctx = compose_latents(composer, encoder, texts)  # the resampler over cached encoder states
        else:
            ctx = text_embeddings(model, tokenizer, texts, [10**9] * len(ids))
        batch = build_batch(model, ids, masks, ctx, framing)
        action_logits(model, batch)
    return int(batch.attention_mask.sum()) // len(ids)


def probe(args) -> None:
    """A fresh process: load, one warm-up pass, then the max RSS of a second pass above what loading left."""
    params, model, tokenizer, composer, targets, texts = setup(args)
    texts = padded(tokenizer, texts, args.experience_tokens[0])
    encoder = ExperienceEncoder(TeacherView(model), tokenizer, max_tokens=params.composer.max_experience_tokens)
    encoder.encode([t for row in texts for t in row])  # cached, as after the first steps of a run
    gc.collect()
    before = current_rss_mb()
    with PeakSampler() as sampler:  # (ru_maxrss cannot be used: loading set a higher maximum than one pass)
        pass_once(args.probe, params, model, tokenizer, composer, encoder, targets, texts)
    print(json.dumps({"peak_mb": sampler.peak - before}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--rows", type=int, default=16, help="trajectories per pass")
    parser.add_argument("--experience-tokens", type=int, nargs="+", default=[0, 1000])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--probe", choices=["latents", "text"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        return probe(args)
    params, model, tokenizer, composer, targets, texts0 = setup(args)
    report = {"rows": len(targets), "top_j": params.bank.top_j, "num_queries": params.composer.num_queries}
    for n in args.experience_tokens:
        texts = padded(tokenizer, texts0, n)
        encoder = ExperienceEncoder(TeacherView(model), tokenizer, max_tokens=params.composer.max_experience_tokens)
        started = time.perf_counter()
        encoder.encode([t for row in texts for t in row])
        encode_s = time.perf_counter() - started
        seconds: dict[str, list[float]] = {"latents": [], "text": []}
        positions = {}
        for _ in range(args.reps):  # interleaved: drift in the machine hits both alike
            for kind in seconds:
                started = time.perf_counter()
                positions[kind] = pass_once(kind, params, model, tokenizer, composer, encoder, targets, texts)
                seconds[kind].append(time.perf_counter() - started)
        peak = {}
        for kind in seconds:
            cmd = [sys.executable, __file__, "--params", args.params, "--rows", str(args.rows), "--probe", kind]
            cmd += ["--experience-tokens", str(n), "--threads", str(args.threads)]
            for o in args.overrides:
                cmd += ["--set", o]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            peak[kind] = json.loads(out.strip().splitlines()[-1])["peak_mb"]
        median = {k: statistics.median(v) for k, v in seconds.items()}
        report[f"experience_tokens={n or 'as banked'}"] = {
            "positions_per_row": positions,
            "pass_seconds": {k: round(v, 4) for k, v in median.items()},
            "peak_mb": {k: round(v, 1) for k, v in peak.items()},
            "text_over_latents": {
                "positions": round(positions["text"] / positions["latents"], 2),
                "seconds": round(median["text"] / median["latents"], 2),
                "peak_mb": round(peak["text"] / peak["latents"], 2) if peak["latents"] >= 1 else None,
            },
            "encode_once_seconds": round(encode_s, 3),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
