"""Cost of one LOPD step against a plain on-policy policy-gradient step, on the same batch and model.

Both sides skip the rollout (identical for both) and start from the same trajectories:
  * pg    — student forward and backward only (a REINFORCE-style loss on the sampled tokens), optimizer step;
  * lopd  — `Distiller.update`, the product's own code for everything a step does after its rollout: compose
            latents, latent-teacher forward with the composer's graph, top-k, student forward and backward
            (reverse KL on top-k + tail), composer backward through the frozen teacher, both optimizer steps,
            dual ascent and the dashboard numbers.
Micro-batching: LOPD runs its forward/backward in chunks of `lopd.micro_batch` trajectories with gradients
accumulated. The PG baseline uses exactly the same chunks (`step.micro_batches`, token-mean normalised by
the whole batch, one optimizer step), so a ratio never credits LOPD with a memory or padding saving the
baseline was denied. Several settings can be measured side by side in one run (`--micro-batch 0 8`).

Two student baselines: `pg` trains all weights (the "student alone" the issue's targets are stated against)
and `pg_lora` trains only a LoRA adapter of the same rank as LOPD's LoRA mode (the like-for-like reference for
that mode, reported as well because it has no full-size gradients or optimizer state to hide behind).

Times are medians of several repetitions, the four updates interleaved round-robin so that drift in the machine's
state hits all of them alike. Peak memory is measured in fresh subprocesses (max RSS above the process's own
baseline after loading the model and the batch, sampled every 2 ms), two updates each, median of
`--memory-reps` processes (one process's figure moves by up to ±15 % with the heap's layout).

    .venv/bin/python benchmarks/step_cost.py [--model data/base] [--tasks 8] [--samples 4] \\
        [--micro-batch 0 8] [--low-memory] [--set lopd.teacher_micro_batch=4 ...]

`--vocab N` grows the model's vocabulary to N rows after the batch is rolled out (zero rows: no token of the batch
is one of them), so the update's (n, V) tensors have a real model's width while the rest of the model stays
tiny — the regime where those tensors, not the weights, decide the update's memory.

`--low-memory` (the same as `--set lopd.low_memory=true`) measures the low-memory order; add
`--set lopd.teacher_micro_batch=N` (N > 0) for teacher passes of N trajectories inside each chunk: the teacher
then holds a fraction of a student chunk's activations.
Prints JSON, one entry per micro-batch setting, with the ratios (targets: time ≤ 1.6 on CPU; LoRA memory ≤ 1.15
of the student alone).

On a GPU (`--device cuda`, optionally `--dtype bfloat16`) the times are taken after a device synchronise, and
peak memory is CUDA's allocator peak above what is allocated once the setup's model copy exists, during its
first two updates, in this process (the allocator counts exactly, so no fresh processes are needed).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataclasses import replace

import lopd_core  # noqa: F401
from lopd_core.config import load_params
from lopd_core.distill.loop.trainer import Distiller
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring.models import make_student_and_teacher
from lopd_core.distill.scoring.teacher import action_logits, build_batch
from lopd_core.distill.update.batch import chunk_group, micro_batches
from lopd_core.drivers.coldstart import new_composer
from lopd_core.envs import make_tasks, run_oracle
from lopd_core.experience import format_experience
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout


def load(model_dir: str, device: str = "cpu", dtype: str = "float32"):
    from benchmarks.rollout_throughput import load_or_build

    model, tokenizer, source = load_or_build(model_dir)
    return model.to(device=device, dtype=getattr(torch, dtype)).train(), tokenizer, source


def _sync(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def make_batch(model, tokenizer, tasks: int, samples: int, top_j: int):
    codec = ChatCodec(tokenizer)
    task_list = make_tasks("toolworld", "train", tasks, 5)
    reqs = [RolloutRequest(t, sample_index=g) for t in task_list for g in range(samples)]
    trajs = rollout(model, codec, reqs, sampling=Sampling(temperature=1.0, max_new_tokens=48), seed=0)
    pool = make_tasks("toolworld", "train", top_j * tasks, 77)
    texts = []
    for t in pool:
        _, _, env = run_oracle(t)
        texts.append(format_experience(t.instruction, env.episode))
    experiences = [texts[top_j * i : top_j * (i + 1)] for i in range(tasks)]  # J per task, distinct
    return task_list, trajs, experiences


def pad_vocabulary(model, size: int) -> None:
    """Grow the embedding and LM head to `size` rows of zeros (only for an update on a batch already rolled out:
    the new ids never occur in it, they only widen every (n, V) tensor)."""
    old = model.get_input_embeddings().weight.shape[0]
    if size <= old:
        return
    model.resize_token_embeddings(size, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[old:] = 0.0
        model.get_output_embeddings().weight[old:] = 0.0


def pg_update(student, optimizer, trajs, micro_batch: int, group: int = 1) -> None:
    """A plain on-policy policy-gradient update on the same trajectories: student forward and backward only
    (REINFORCE on the sampled tokens with the advantage 2r - 1, token mean over the batch), one optimizer step.
    Chunked exactly as `Distiller.update` chunks (same rows per chunk, gradients accumulated)."""
    ids = [t.token_ids for t in trajs]
    masks = [t.action_mask for t in trajs]
    n_tokens = max(sum(sum(1 for m in mask[1:] if m) for mask in masks), 1)
    adv_all = L.advantages(torch.tensor([t.reward for t in trajs]))
    optimizer.zero_grad(set_to_none=True)
    for chunk in micro_batches([len(i) for i in ids], micro_batch, group):
        batch = build_batch(student, [ids[i] for i in chunk], [masks[i] for i in chunk])
        logp = torch.log_softmax(action_logits(student, batch), -1)
        lp = logp.gather(-1, batch.action_ids[:, None]).squeeze(-1)
        adv = adv_all[torch.tensor(chunk)][batch.token_traj_index]
        (-(adv * lp).sum() / n_tokens).backward()
    optimizer.step()


def pg_student(model, kind: str, lora_rank: int):
    """(causal LM to score, optimizer) for the full-weight or the LoRA policy-gradient student."""
    if kind == "pg":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5)
    trainable, student, _ = make_student_and_teacher(model, mode="lora", lora_rank=lora_rank)
    return student, torch.optim.AdamW([p for p in trainable.parameters() if p.requires_grad], lr=1e-5)


def distiller(model, tokenizer, mode: str, experiences, samples: int, params) -> Distiller:
    """A Distiller of `params` (its lopd.low_memory decides the order) on the fixed experiences."""
    params = copy.deepcopy(params)
    params.lopd = replace(params.lopd, student_mode=mode, samples_per_task=samples, steps=1)
    composer = new_composer(params, model)
    composer.to(next(model.parameters()).device)
    return Distiller(
        params, model, tokenizer, lambda tasks: experiences[: len(tasks)], composer=composer, log=lambda m: None
    )


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class PeakSampler:
    """Samples the process's current RSS every few milliseconds in a thread; `peak` is the highest seen.
    (ru_maxrss cannot be used: loading and the rollout already set a higher maximum than the update.)"""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.peak, self._stop = interval_s, current_rss_mb(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_mb())
            time.sleep(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def memory_probe(args, params) -> None:
    """Child process: build one setup, report peak RSS growth over its baseline during two updates."""
    model, tokenizer, _ = load(args.model, args.device, args.dtype)
    tasks, trajs, experiences = make_batch(model, tokenizer, args.tasks, args.samples, params.bank.top_j)
    pad_vocabulary(model, args.vocab)
    torch.manual_seed(0)
    gc.collect()
    mb = args.micro_batch[0]
    before = current_rss_mb()  # the base model and the batch are loaded; everything after is the method's
    with PeakSampler() as sampler:
        if args.probe in ("pg", "pg_lora"):
            student, opt = pg_student(model, args.probe, params.lopd.lora_rank)
            for _ in range(2):
                pg_update(student, opt, trajs, mb, chunk_group(args.samples, params.lopd.share_prompt))
        else:
            params.lopd = replace(params.lopd, micro_batch=mb)
            d = distiller(model, tokenizer, args.probe, experiences, args.samples, params)
            for _ in range(2):
                d.update(tasks, trajs)
    print(json.dumps({"peak_growth_mb": sampler.peak - before}))


def measure_times(model, tokenizer, tasks, trajs, experiences, samples, params, reps: int) -> dict:
    """Median seconds of each update, the four interleaved; LOPD's median per-phase seconds too."""
    students = {
        kind: pg_student(copy.deepcopy(model).train(), kind, params.lopd.lora_rank) for kind in ("pg", "pg_lora")
    }
    lopd = {
        mode: distiller(copy.deepcopy(model), tokenizer, mode, experiences, samples, params)
        for mode in ("full", "lora")
    }
    mb, group = params.lopd.micro_batch, chunk_group(samples, params.lopd.share_prompt)
    fns = {
        "pg": lambda: pg_update(*students["pg"], trajs, mb, group),
        "pg_lora": lambda: pg_update(*students["pg_lora"], trajs, mb, group),
        "lopd_full": lambda: lopd["full"].update(tasks, trajs),
        "lopd_lora": lambda: lopd["lora"].update(tasks, trajs),
    }
    for fn in fns.values():
        fn()  # warm-up (also fills the experience-encoding cache, as in a real run after its first step)
    times = {k: [] for k in fns}
    phases = {m: {} for m in lopd}
    for _ in range(reps):
        for name, fn in fns.items():
            _sync(model)
            t = time.perf_counter()
            out = fn()
            _sync(model)
            times[name].append(time.perf_counter() - t)
            if out is not None:
                for k, v in out.diagnostics.items():
                    if k.endswith("_s") and k != "rollout_s":
                        phases[name.removeprefix("lopd_")].setdefault(k, []).append(v)
    return {
        "seconds": {k: round(statistics.median(v), 4) for k, v in times.items()},
        "phases_s": {m: {k: round(statistics.median(v), 4) for k, v in p.items()} for m, p in phases.items()},
    }


def cuda_memory_probe(model, tokenizer, kind: str, tasks, trajs, experiences, samples: int, params) -> float:
    """Peak CUDA memory (MB) above the setup's own model copy during its first two updates: the device's
    counterpart of `memory_probe` (optimizer state, gradients, a full-mode teacher copy and activations)."""
    work = copy.deepcopy(model)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    mb = params.lopd.micro_batch
    if kind in ("pg", "pg_lora"):
        student, opt = pg_student(work, kind, params.lopd.lora_rank)
        for _ in range(2):
            pg_update(student, opt, trajs, mb, chunk_group(samples, params.lopd.share_prompt))
        del student, opt
    else:
        d = distiller(work, tokenizer, kind, experiences, samples, params)
        for _ in range(2):
            d.update(tasks, trajs)
        del d
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    del work
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="data/base")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-reps", type=int, default=3, help="fresh processes per memory probe (median)")
    parser.add_argument(
        "--micro-batch",
        type=int,
        nargs="+",
        default=None,
        help="trajectories per chunk, one or more settings measured side by side "
        "(default: lopd.micro_batch of the params)",
    )
    parser.add_argument(
        "--low-memory",
        action="store_true",
        help="lopd.low_memory=true: s_old from a no-grad student forward, so a chunk's teacher "
        "and student graphs never coexist (one more student forward per chunk)",
    )
    parser.add_argument(
        "--vocab", type=int, default=0, help="grow the vocabulary to this many rows for the update (0: the model's own)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda to measure on a GPU")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--probe", choices=["pg", "pg_lora", "lora", "full"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = load_params(args.params, args.overrides + (["lopd.low_memory=true"] if args.low_memory else []))
    settings = args.micro_batch or [params.lopd.micro_batch]
    if args.probe:
        memory_probe(args, params)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("step_cost.py: --device cuda, but torch sees no CUDA device")
    model, tokenizer, source = load(args.model, args.device, args.dtype)
    tasks, trajs, experiences = make_batch(model, tokenizer, args.tasks, args.samples, params.bank.top_j)
    pad_vocabulary(model, args.vocab)
    torch.manual_seed(0)

    def probe(kind: str, mb: int) -> float:
        cmd = (
            [
                sys.executable,
                __file__,
                "--model",
                args.model,
                "--params",
                args.params,
                "--tasks",
                str(args.tasks),
                "--samples",
                str(args.samples),
                "--threads",
                str(args.threads),
                "--probe",
                kind,
                "--micro-batch",
                str(mb),
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                "--vocab",
                str(args.vocab),
            ]
            + [f"--set={o}" for o in args.overrides]
            + (["--low-memory"] if args.low_memory else [])
        )
        peaks = []
        for _ in range(args.memory_reps):  # the heap's layout varies from process to process: median of several
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"memory probe {kind} exited {out.returncode}:\n{out.stderr[-3000:]}")
            peaks.append(json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_mb"])
        return statistics.median(peaks)

    results = []
    for mb in settings:
        p = copy.deepcopy(params)
        p.lopd = replace(p.lopd, micro_batch=mb)
        timing = measure_times(model, tokenizer, tasks, trajs, experiences, args.samples, p, args.reps)
        s = timing["seconds"]
        if args.device.startswith("cuda"):
            mem = {
                kind: cuda_memory_probe(model, tokenizer, kind, tasks, trajs, experiences, args.samples, p)
                for kind in ("pg", "pg_lora", "lora", "full")
            }
        else:
            mem = {kind: probe(kind, mb) for kind in ("pg", "pg_lora", "lora", "full")}
        results.append(
            {
                "micro_batch": mb,
                "seconds": s,
                "lopd_phases_s": timing["phases_s"],
                "time_ratio_full": round(s["lopd_full"] / s["pg"], 3),
                "time_ratio_lora": round(s["lopd_lora"] / s["pg"], 3),
                "time_ratio_lora_vs_pg_lora": round(s["lopd_lora"] / s["pg_lora"], 3),
                "peak_memory_growth_mb": {k: round(v, 1) for k, v in mem.items()},
                "memory_ratio_lora": round(mem["lora"] / max(mem["pg"], 1e-6), 3),
                "memory_ratio_full": round(mem["full"] / max(mem["pg"], 1e-6), 3),
                "memory_ratio_lora_vs_pg_lora": round(mem["lora"] / max(mem["pg_lora"], 1e-6), 3),
            }
        )
    tokens = sum(t.num_action_tokens for t in trajs)
    print(
        json.dumps(
            {
                "model": source,
                "vocab": model.get_output_embeddings().weight.shape[0],
                "device": args.device,
                "dtype": args.dtype,
                "threads": args.threads,
                "overrides": args.overrides,
                "low_memory": params.lopd.low_memory,
                "trajectories": len(trajs),
                "action_tokens": tokens,
                "tokens_per_trajectory_max": max(len(t.token_ids) for t in trajs),
                "latents_per_trajectory": params.bank.top_j * params.composer.num_queries,
                "targets": {"time_ratio": 1.6, "memory_ratio_lora": 1.15},
                "memory_note": (
                    "peak CUDA allocation above the setup's model copy during its first two updates"
                    if args.device.startswith("cuda")
                    else "peak RSS above the loaded model and batch during two updates, each in a fresh process"
                )
                + "; pg = full-weight student (AdamW state included), pg_lora = LoRA student of LOPD's rank",
                "by_micro_batch": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
