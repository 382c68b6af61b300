"""Sharded (FSDP2) against replicated LOPD updates, side by side in one run: seconds per update and each rank's
bytes of parameters, gradients and optimizer state (lopd_core/sharding.py).

Launch with the processes to compare (2 CPU processes on gloo here):

    torchrun --nproc_per_node 2 benchmarks/sharded_update.py [--mode full|lora] [--hidden 256] [--layers 4]
    torchrun --nproc_per_node N benchmarks/sharded_update.py --device cuda    # N GPUs (scripts/gpu_check.sh)

Both arms run the same `Distiller.update`s on the same tiny batch (benchmarks/update_fingerprint.py's: 3 tasks ×
2 samples, each rank its contiguous slice of the tasks), once with `lopd.sharding: none` and once with `fsdp2`;
rank 0 prints JSON with both arms' figures and the ratios sharded / replicated, plus the largest difference of
the dashboard rows and final weights between the arms (the sharded update is the replicated one, up to float
summation order). With one process it still runs FSDP2 (a one-rank group), which checks the code path, not the
saving. Memory is counted from the tensors each rank holds (a DTensor's local shard), after an update, not from the
allocator (on CUDA its peak is printed too): on a CPU the process's resident size says little about one model's
tensors. During an update the weights are gathered whole on every rank (sharding.py says why), so the peak is not
divided by N; what is divided is what a rank keeps between steps: the weights, their gradient and the optimizer's
state. The model is built larger than the tests' (--hidden, --layers) so that the weights, not the fixed overheads,
dominate the timings.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopd_core  # noqa: F401  (offline defaults)
from benchmarks.update_fingerprint import setup
from lopd_core import distributed as D
from lopd_core import sharding as SH
from lopd_core.config import Params, TinyModelConfig
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.model.loading import tiny_qwen3

TASKS, SAMPLES = 3, 2


def distiller(base, tokenizer, texts, *, sharding: str, mode: str, method: str = "lopd", out_dir: str = "/tmp"):
    """A Distiller over a copy of `base` with the settings both arms share (those of update_fingerprint.py)."""
    p = Params()
    p.seed = 0
    p.rollout = replace(p.rollout, max_new_tokens=24, max_context=640)
    p.lopd = replace(
        p.lopd,
        tasks_per_step=TASKS,
        samples_per_task=SAMPLES,
        steps=3,
        out_dir=f"{out_dir}/lopd",
        csv=f"{out_dir}/distill.csv",
        beta_init=0.5,
        student_mode=mode,
        method=method,
        sharding=sharding,
        margin=0.05,
    )
    torch.manual_seed(0)
    composer = Composer(
        base.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(base)
    ).to(next(base.parameters()).device)
    return trainer_mod.Distiller(
        p, copy.deepcopy(base), tokenizer, lambda ts: [texts for _ in ts], composer=composer, log=lambda m: None
    )


def my_slice(tasks, trajs):
    """This rank's contiguous slice of the tasks and their trajectories, as `Distiller.step` takes it."""
    mine = D.shard_range(len(tasks))
    return tasks[mine.start : mine.stop], trajs[mine.start * SAMPLES : mine.stop * SAMPLES]


def run_updates(d, tasks, trajs, n: int) -> tuple[list[dict], list[float]]:
    rows, seconds = [], []
    for _ in range(n):
        D.barrier()
        started = time.perf_counter()
        r = d.update(tasks, trajs)
        D.barrier()
        seconds.append(time.perf_counter() - started)
        rows.append({k: v for k, v in asdict(r.row).items() if k != "step_seconds"})
    return rows, seconds


def largest_row_difference(a: list[dict], b: list[dict]) -> float:
    return max(abs(x[k] - y[k]) for x, y in zip(a, b) for k in x if isinstance(x[k], float))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("full", "lora"), default="full")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the base's weights (a LoRA adapter stays float32 beside a bf16 base)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    SH.setup()  # on CUDA this pins each rank to its LOCAL_RANK's GPU first (distributed.setup)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    small, tokenizer, tasks, trajs, texts = setup()
    torch.manual_seed(0)
    shape = TinyModelConfig(
        hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2, intermediate_size=2 * args.hidden
    )
    base = tiny_qwen3(shape, tokenizer).eval().to(device, getattr(torch, args.dtype))
    del small
    tasks, trajs = my_slice(tasks, trajs)
    arms = {}
    for sharding in ("none", "fsdp2"):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        d = distiller(base, tokenizer, texts, sharding=sharding, mode=args.mode)
        rows, seconds = run_updates(d, tasks, trajs, args.updates)
        held = SH.state_bytes(d.trainable, d.opt_theta)
        if device.type == "cuda":  # the allocator's peak, the base's copy included (a real peak on a GPU)
            held["cuda_peak_allocated"] = torch.cuda.max_memory_allocated()
        if d.teacher.adapter_owner is None:  # full mode: the frozen teacher is a second copy, sharded alike
            held["teacher_params"] = SH.local_bytes(d.teacher.lm.parameters())
        whole = SH.whole_state_dict(d.trainable) if sharding == "fsdp2" else d.trainable.state_dict()
        arms[sharding] = {
            "seconds_per_update": seconds[1:] or seconds,
            "rank_bytes": held,
            "rows": rows,
            "weights": {k: v.detach().cpu().clone() for k, v in whole.items()},
        }
        del d, whole  # the next arm's peak starts without this one's tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if D.is_main():
        rep, sh = arms["none"], arms["fsdp2"]
        weights_diff = max(float((rep["weights"][k] - sh["weights"][k]).abs().max()) for k in rep["weights"])
        mean = {k: sum(a["seconds_per_update"]) / len(a["seconds_per_update"]) for k, a in arms.items()}
        print(
            json.dumps(
                {
                    "processes": D.world_size(),
                    "backend": torch.distributed.get_backend(),
                    "device": str(device),
                    "mode": args.mode,
                    "dtype": args.dtype,
                    "hidden": args.hidden,
                    "layers": args.layers,
                    "updates": args.updates,
                    "replicated": {"seconds_per_update": mean["none"], "rank0_bytes": rep["rank_bytes"]},
                    "sharded": {"seconds_per_update": mean["fsdp2"], "rank0_bytes": sh["rank_bytes"]},
                    "ratio_sharded_over_replicated": {
                        "seconds": mean["fsdp2"] / mean["none"],
                        **{k: sh["rank_bytes"][k] / max(rep["rank_bytes"][k], 1) for k in rep["rank_bytes"]},
                    },
                    "largest_difference": {
                        "dashboard_rows": largest_row_difference(rep["rows"], sh["rows"]),
                        "weights": weights_diff,
                    },
                },
                indent=2,
            )
        )
    D.barrier()


if __name__ == "__main__":
    main()
