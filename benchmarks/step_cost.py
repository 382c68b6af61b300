"""Cost of one LOPD step against a plain on-policy policy-gradient step, on the same batch and model.

Both sides skip the rollout (identical for both) and start from the same trajectories:
  * pg    — student forward and backward only (a REINFORCE-style loss on the sampled tokens), optimizer step;
  * lopd  — compose latents, latent-teacher forward with the composer's graph, top-k, student forward and
            backward (reverse KL on top-k + tail), composer backward through the frozen teacher, both
            optimizer steps and dual ascent — everything `Distiller.step` does after its rollout.
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
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopd_core  # noqa: F401
from lopd_core.envs import make_tasks, run_oracle
from lopd_core.experience import format_experience
from lopd_core.lopd import losses as L
from lopd_core.lopd.composer import Composer, ExperienceEncoder, compose_latents, mean_embedding_norm
from lopd_core.lopd.models import make_student_and_teacher
from lopd_core.lopd.teacher import Framing, action_logits, build_batch, teacher_topk
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout


def load(model_dir: str):
    from benchmarks.rollout_throughput import load_or_build

    model, tokenizer, source = load_or_build(model_dir)
    return model.train(), tokenizer, source


def make_batch(model, tokenizer, tasks: int, samples: int):
    codec = ChatCodec(tokenizer)
    reqs = [RolloutRequest(t, sample_index=g) for t in make_tasks("toolworld", "train", tasks, 5) for g in range(samples)]
    trajs = rollout(model, codec, reqs, sampling=Sampling(temperature=1.0, max_new_tokens=48), seed=0)
    pool = make_tasks("toolworld", "train", 12, 77)
    texts = []
    for t in pool:
        _, _, env = run_oracle(t)
        texts.append(format_experience(t.instruction, env.episode))
    experiences = [texts[(i // samples) % 4 * 3:(i // samples) % 4 * 3 + 3] for i in range(len(trajs))]
    return trajs, experiences


class Setup:
    def __init__(self, model, tokenizer, mode: str, trajs, experiences):
        self.trainable, self.student, self.teacher = make_student_and_teacher(model, mode=mode, lora_rank=8)
        self.framing = Framing.from_tokenizer(tokenizer)
        self.encoder = ExperienceEncoder(self.teacher, tokenizer)
        self.composer = Composer(model.config.hidden_size, num_queries=32, num_layers=2, num_heads=4,
                                 embedding_norm=mean_embedding_norm(self.student))
        self.anchor = copy.deepcopy(self.composer).requires_grad_(False)
        self.opt_theta = torch.optim.AdamW([p for p in self.trainable.parameters() if p.requires_grad], lr=1e-5)
        self.opt_phi = torch.optim.AdamW(self.composer.parameters(), lr=1e-5)
        self.ids = [t.token_ids for t in trajs]
        self.masks = [t.action_mask for t in trajs]
        self.rewards = torch.tensor([t.reward for t in trajs])
        self.experiences = experiences
        self.beta = 0.0

    def pg_step(self) -> None:
        batch = build_batch(self.student, self.ids, self.masks)
        logp = torch.log_softmax(action_logits(self.student, batch), -1)
        lp = logp.gather(-1, batch.action_ids[:, None]).squeeze(-1)
        adv = (2 * self.rewards - 1)[batch.token_traj_index]
        loss = -(adv * lp).mean()
        self.opt_theta.zero_grad()
        loss.backward()
        self.opt_theta.step()

    def lopd_step(self) -> None:
        latents = compose_latents(self.composer, self.encoder, self.experiences)
        with self.teacher.active() as t:
            tb = build_batch(t, self.ids, self.masks, latents, self.framing)
            t_logits = action_logits(t, tb)
        top = teacher_topk(t_logits, tb.action_ids, 20)
        sb = build_batch(self.student, self.ids, self.masks)
        s_logits = action_logits(self.student, sb)
        loss = L.reverse_kl_topk(s_logits, top.logprobs, top.ids).mean()
        self.opt_theta.zero_grad()
        loss.backward()
        self.opt_theta.step()
        s_old = s_logits.detach()
        p, pt = L.topk_support_logprobs(s_old, top.ids)
        q, qt = L.topk_support_logprobs(t_logits, top.ids)
        kl = L.support_kl(p, pt, q, qt).mean()
        t_lp = torch.log_softmax(t_logits, -1).gather(-1, tb.action_ids[:, None]).squeeze(-1)
        s_lp = torch.log_softmax(s_old, -1).gather(-1, sb.action_ids[:, None]).squeeze(-1)
        n = len(self.ids)
        delta = L.privileged_margin_delta(t_lp, s_lp, L.advantages(self.rewards), tb.token_traj_index, n)
        d_bar = L.token_weighted_mean(delta, torch.bincount(tb.token_traj_index, minlength=n))
        with torch.no_grad():
            anchor_latents = compose_latents(self.anchor, self.encoder, self.experiences)
        anchor = L.anchor_loss(torch.cat(latents), torch.cat(anchor_latents))
        loss_phi = L.composer_loss(kl, d_bar, beta=self.beta, margin=0.05, anchor=anchor, anchor_weight=0.2)
        self.opt_phi.zero_grad()
        loss_phi.backward()
        self.opt_phi.step()
        self.beta = L.dual_ascent(self.beta, margin=0.05, delta_bar=float(d_bar.detach()), lr=0.5)


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up (also fills the experience-encoding cache, as in a real run after its first step)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_probe(args) -> None:
    """Child process: build one setup, report peak RSS growth over its baseline during two steps."""
    model, tokenizer, _ = load(args.model)
    trajs, experiences = make_batch(model, tokenizer, args.tasks, args.samples)
    torch.manual_seed(0)
    before = max_rss_mb()
    setup = Setup(model, tokenizer, "lora" if args.probe == "lora" else "full", trajs, experiences)
    step = setup.pg_step if args.probe == "student" else setup.lopd_step
    step()
    step()
    print(json.dumps({"peak_growth_mb": max_rss_mb() - before}))


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
    trajs, experiences = make_batch(model, tokenizer, args.tasks, args.samples)
    torch.manual_seed(0)
    pg = Setup(copy.deepcopy(model), tokenizer, "full", trajs, experiences)
    lopd_full = Setup(copy.deepcopy(model), tokenizer, "full", trajs, experiences)
    lopd_lora = Setup(copy.deepcopy(model), tokenizer, "lora", trajs, experiences)
    t_pg = median_seconds(pg.pg_step, args.reps)
    t_full = median_seconds(lopd_full.lopd_step, args.reps)
    t_lora = median_seconds(lopd_lora.lopd_step, args.reps)

    def probe(kind: str) -> float:
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--tasks", str(args.tasks),
                              "--samples", str(args.samples), "--threads", str(args.threads), "--probe", kind],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_mb"]

    mem = {kind: probe(kind) for kind in ("student", "lora", "full")}
    tokens = sum(sum(m) for m in pg.masks)
    print(json.dumps({
        "model": source, "trajectories": len(trajs), "action_tokens": tokens,
        "latents_per_trajectory": 3 * 32,
        "seconds": {"pg_step": round(t_pg, 4), "lopd_step_full": round(t_full, 4), "lopd_step_lora": round(t_lora, 4)},
        "time_ratio_full": round(t_full / t_pg, 3), "time_ratio_lora": round(t_lora / t_pg, 3),
        "peak_memory_growth_mb": {k: round(v, 1) for k, v in mem.items()},
        "memory_ratio_lora": round(mem["lora"] / max(mem["student"], 1e-6), 3),
        "memory_ratio_full": round(mem["full"] / max(mem["student"], 1e-6), 3),
    }, indent=2))


if __name__ == "__main__":
    main()
