"""Cost of one LOPD step against a plain on-policy policy-gradient step, on the same batch and model.

Both sides skip the rollout (identical for both) and start from the same trajectories:
  * pg    — student forward and backward only (a REINFORCE-style loss on the sampled tokens), optimizer step;
  * lopd  — `Distiller.update`, the product's own code for everything a step does after its rollout: compose
            latents, latent-teacher forward with the composer's graph, top-k, student forward and backward
            (reverse KL on top-k + tail), composer backward through the frozen teacher, both optimizer steps,
            dual ascent and the dashboard numbers.
Times are the median of several repetitions, measured one after the other in this run. Peak memory is
measured in fresh subprocesses (max RSS above the process's own baseline after loading, so the Python and
library footprint cancels): the student alone (pg) against LOPD in LoRA mode (teacher = the same weights with
the adapter disabled) and in full mode (a second frozen copy).

    .venv/bin/python benchmarks/step_cost.py [--model data/base] [--tasks 8] [--samples 4]
Prints JSON with both ratios (targets: time ≤ 1.6 on CPU; LoRA memory ≤ 1.15).
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

import lopd_core  # noqa: F401
from lopd_core.config import Params
from lopd_core.envs import make_tasks, run_oracle
from lopd_core.experience import format_experience
from lopd_core.lopd import losses as L
from lopd_core.lopd.composer import Composer, mean_embedding_norm
from lopd_core.lopd.teacher import action_logits, build_batch
from lopd_core.lopd.trainer import Distiller
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout


def load(model_dir: str):
    from benchmarks.rollout_throughput import load_or_build

    model, tokenizer, source = load_or_build(model_dir)
    return model.train(), tokenizer, source


def make_batch(model, tokenizer, tasks: int, samples: int):
    codec = ChatCodec(tokenizer)
    task_list = make_tasks("toolworld", "train", tasks, 5)
    reqs = [RolloutRequest(t, sample_index=g) for t in task_list for g in range(samples)]
    trajs = rollout(model, codec, reqs, sampling=Sampling(temperature=1.0, max_new_tokens=48), seed=0)
    pool = make_tasks("toolworld", "train", 3 * tasks, 77)
    texts = []
    for t in pool:
        _, _, env = run_oracle(t)
        texts.append(format_experience(t.instruction, env.episode))
    experiences = [texts[3 * i:3 * i + 3] for i in range(tasks)]  # J = 3 per task
    return task_list, trajs, experiences


def pg_update(student, optimizer, trajs) -> None:
    """A plain on-policy policy-gradient update on the same trajectories: student forward and backward only
    (REINFORCE on the sampled tokens with the advantage 2r - 1), one optimizer step."""
    batch = build_batch(student, [t.token_ids for t in trajs], [t.action_mask for t in trajs])
    logp = torch.log_softmax(action_logits(student, batch), -1)
    lp = logp.gather(-1, batch.action_ids[:, None]).squeeze(-1)
    adv = L.advantages(torch.tensor([t.reward for t in trajs]))[batch.token_traj_index]
    loss = -(adv * lp).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def distiller(model, tokenizer, mode: str, experiences, samples: int) -> Distiller:
    params = Params()
    params.lopd.student_mode = mode
    params.lopd.samples_per_task = samples
    params.lopd.steps = 1
    composer = Composer(model.config.hidden_size, num_queries=32, num_layers=2, num_heads=4,
                        embedding_norm=mean_embedding_norm(model))
    return Distiller(params, model, tokenizer, lambda tasks: experiences[: len(tasks)], composer=composer,
                     log=lambda m: None)


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up (also fills the experience-encoding cache, as in a real run after its first step)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


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


def memory_probe(args) -> None:
    """Child process: build one setup, report peak RSS growth over its baseline during two updates."""
    model, tokenizer, _ = load(args.model)
    tasks, trajs, experiences = make_batch(model, tokenizer, args.tasks, args.samples)
    torch.manual_seed(0)
    gc.collect()
    before = current_rss_mb()  # the base model and the batch are loaded; everything after is the method's
    with PeakSampler() as sampler:
        if args.probe == "student":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            for _ in range(2):
                pg_update(model, opt, trajs)
        else:
            d = distiller(model, tokenizer, args.probe, experiences, args.samples)
            for _ in range(2):
                d.update(tasks, trajs)
    print(json.dumps({"peak_growth_mb": sampler.peak - before}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="data/base")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--probe", choices=["student", "lora", "full"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.probe:
        memory_probe(args)
        return
    model, tokenizer, source = load(args.model)
    tasks, trajs, experiences = make_batch(model, tokenizer, args.tasks, args.samples)
    torch.manual_seed(0)
    student = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5)
    full = distiller(copy.deepcopy(model), tokenizer, "full", experiences, args.samples)
    lora = distiller(copy.deepcopy(model), tokenizer, "lora", experiences, args.samples)
    t_pg = median_seconds(lambda: pg_update(student, opt, trajs), args.reps)
    t_full = median_seconds(lambda: full.update(tasks, trajs), args.reps)
    t_lora = median_seconds(lambda: lora.update(tasks, trajs), args.reps)
    phases = {k: round(v, 4) for k, v in full.update(tasks, trajs)["diagnostics"].items() if k.endswith("_s")}

    def probe(kind: str) -> float:
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--tasks", str(args.tasks),
                              "--samples", str(args.samples), "--threads", str(args.threads), "--probe", kind],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_mb"]

    mem = {kind: probe(kind) for kind in ("student", "lora", "full")}
    tokens = sum(t.num_action_tokens for t in trajs)
    print(json.dumps({
        "model": source, "trajectories": len(trajs), "action_tokens": tokens,
        "latents_per_trajectory": 3 * 32,
        "seconds": {"pg_step": round(t_pg, 4), "lopd_step_full": round(t_full, 4), "lopd_step_lora": round(t_lora, 4)},
        "lopd_full_phases_s": phases,
        "time_ratio_full": round(t_full / t_pg, 3), "time_ratio_lora": round(t_lora / t_pg, 3),
        "peak_memory_growth_mb": {k: round(v, 1) for k, v in mem.items()},
        "memory_note": "peak RSS above the loaded model and batch during two updates, each in a fresh process",
        "memory_ratio_lora": round(mem["lora"] / max(mem["student"], 1e-6), 3),
        "memory_ratio_full": round(mem["full"] / max(mem["student"], 1e-6), 3),
    }, indent=2))


if __name__ == "__main__":
    main()
