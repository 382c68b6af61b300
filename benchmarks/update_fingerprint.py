"""Fingerprint of deterministic LOPD updates, to show that a change to the update computes the same bits.

Builds a tiny seeded model and batch (3 tasks × 2 samples, rewards of both signs, two oracle experiences per task),
then runs three `Distiller.update`s in each of several configurations (default; micro-batches; the low-memory
order with and without teacher passes; no prompt sharing; the full and sampled student losses; GRPO; lopd_rl;
composer_fraction; LoRA) and saves every dashboard row, diagnostic, per-trajectory gap and KL, and the final
student and composer weights. Run it in each checkout, then compare:

    .venv/bin/python benchmarks/update_fingerprint.py before.pt          # in the old checkout
    .venv/bin/python benchmarks/update_fingerprint.py after.pt           # in the new one
    .venv/bin/python benchmarks/update_fingerprint.py --compare before.pt after.pt

The comparison prints JSON: per configuration, the largest absolute difference of anything saved (0.0 = the same
bits). Timings are left out (they differ run to run). One CPU thread, so float summation order is fixed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataclasses import replace

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.config import Params, TinyModelConfig
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.distill.loop.checkpoints import plain_data
from lopd_core.envs import make_tasks, run_oracle
from lopd_core.experience import format_experience
from lopd_core.model.chat import ChatCodec
from lopd_core.model.demos import build_demos
from lopd_core.model.loading import tiny_qwen3
from lopd_core.model.tokenizer import train_tokenizer
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

CONFIGS = {
    "default": {},
    "micro_batch_2": {"micro_batch": 2},
    "low_memory": {"low_memory": True, "micro_batch": 4},
    "low_memory_teacher_passes": {"low_memory": True, "teacher_micro_batch": 1, "micro_batch": 4},
    "no_prompt_sharing": {"share_prompt": False},
    "full_loss": {"student_loss": "full"},
    "sampled_loss": {"student_loss": "sampled"},
    "grpo": {"method": "grpo"},
    "lopd_rl": {"method": "lopd_rl"},
    "composer_fraction": {"composer_fraction": 0.5, "micro_batch": 2},
    "lora": {"student_mode": "lora"},
}


def setup():
    demos = build_demos(n=120, experience_fraction=0.4, max_experiences=2, convention_noise=0.5, slip=0.1, seed=0)
    tokenizer = train_tokenizer((d.text() for d in demos), vocab_size=600)
    torch.manual_seed(0)
    base = tiny_qwen3(
        TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64), tokenizer
    ).eval()
    tasks = make_tasks("toolworld", "train", 3, seed=11)
    trajs = rollout(
        base,
        ChatCodec(tokenizer),
        [RolloutRequest(t, sample_index=g) for t in tasks for g in range(2)],
        sampling=Sampling(temperature=1.0, max_new_tokens=24, max_context=640),
        seed=3,
    )
    for i, t in enumerate(trajs):
        t.reward, t.success = [1.0, 0.0, 0.5, 1.0, 0.0, 0.25][i], i in (0, 3)
    texts = []
    for t in make_tasks("toolworld", "train", 2, seed=99):
        _, _, env = run_oracle(t)
        texts.append(format_experience(t.instruction, env.episode))
    return base, tokenizer, tasks, trajs, texts


def fingerprint(out_dir: str) -> dict:
    base, tokenizer, tasks, trajs, texts = setup()
    out = {}
    for name, overrides in CONFIGS.items():
        p = Params()
        p.seed = 0
        p.rollout = replace(p.rollout, max_new_tokens=24, max_context=640)
        p.lopd = replace(
            p.lopd,
            **{
                "tasks_per_step": 3,
                "samples_per_task": 2,
                "steps": 3,
                "out_dir": f"{out_dir}/lopd",
                "csv": f"{out_dir}/distill.csv",
                "beta_init": 0.5,
                **overrides,
            },
        )
        model = copy.deepcopy(base)
        torch.manual_seed(0)
        composer = Composer(
            model.config.hidden_size,
            num_queries=4,
            num_layers=1,
            num_heads=2,
            embedding_norm=mean_embedding_norm(model),
        )
        d = trainer_mod.Distiller(
            p, model, tokenizer, lambda ts: [texts for _ in ts], composer=composer, log=lambda m: None
        )
        g = torch.Generator().manual_seed(1)  # a student that differs from the sampler and the base
        with torch.no_grad():
            for q in d.trainable.parameters():
                q.add_(torch.randn(q.shape, generator=g) * 0.05)
        steps = []
        for _ in range(3):
            r = d.update(tasks, trajs)
            steps.append(
                {
                    "row": {k: v for k, v in asdict(r.row).items() if k != "step_seconds"},
                    "diagnostics": {k: v for k, v in r.diagnostics.items() if not k.endswith("_s")},
                    "gaps": r.trajectory_gaps,
                    "kl": r.trajectory_kl,
                }
            )
        out[name] = {
            "steps": steps,
            "beta": d.state.beta,
            "student": {n: t.detach().clone() for n, t in d.trainable.named_parameters()},
            "composer": {n: t.detach().clone() for n, t in d.composer.named_parameters()},
        }
        print(f"update_fingerprint: {name}", file=sys.stderr)
    return out


def largest_difference(a, b) -> float:
    """Largest absolute difference between two saved structures (inf where their shapes or keys differ)."""
    if isinstance(a, torch.Tensor):
        return 0.0 if torch.equal(a, b) else (float((a - b).abs().max()) if a.shape == b.shape else math.inf)
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return math.inf
        return max([largest_difference(a[k], b[k]) for k in a] + [0.0])
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return math.inf
        return max([largest_difference(x, y) for x, y in zip(a, b)] + [0.0])
    if isinstance(a, float) and isinstance(b, float):
        return 0.0 if (a == b or (math.isnan(a) and math.isnan(b))) else abs(a - b)
    return 0.0 if a == b else math.inf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", help="where to save this checkout's fingerprint (.pt)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two saved fingerprints")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.compare:
        a, b = (torch.load(f, weights_only=True) for f in args.compare)  # plain data: nothing is unpickled
        diffs = {name: largest_difference(a[name], b.get(name)) if name in b else None for name in a}
        print(json.dumps({"largest_difference": diffs, "same_bits": all(v == 0.0 for v in diffs.values())}, indent=2))
        return
    if not args.out:
        parser.error("give a file to save the fingerprint to, or --compare A B")
    with tempfile.TemporaryDirectory(prefix="lopd-fingerprint-") as tmp:
        torch.save(plain_data(fingerprint(tmp), "fingerprint"), args.out)


if __name__ == "__main__":
    main()
