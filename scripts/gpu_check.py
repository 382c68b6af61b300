"""The GPU check's in-process part: what needs a CUDA device, run once and written as JSON.

`scripts/gpu_check.sh` runs this after building a tiny base, then the benchmarks on the device. Each check is
recorded as {"ok": true, ...figures} or {"ok": false, "error": ...}, so one failure does not hide the rest:

  env                 torch and CUDA versions, the device, its memory, bf16 support
  rollout_cuda        a greedy float32 rollout on the device plays the CPU's ids
  rollout_bf16        a bf16 model on the device: greedy first actions against float32, a sampled G-sample
                      rollout (time, tokens, log-probs finite and ≤ 0), the float32 head's error on bf16 states
  lopd_step_full      one `Distiller.update` (float32, all weights): seconds of a second update after a first,
  lopd_step_lora      peak CUDA memory above the model copy, every trainable tensor moved, losses finite
  lopd_step_lora_bf16 the same in LoRA mode on a bf16 base

`--cpu` runs the same code on the CPU with small sizes: a dry run that checks everything except CUDA itself.

    .venv/bin/python scripts/gpu_check.py --model DIR --out DIR [--cpu]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lopd_core  # noqa: F401  (offline defaults)
from benchmarks.rollout_throughput import load_or_build
from benchmarks.step_cost import distiller, make_batch
from lopd_core.config import load_params
from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.model.head import head_logits
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


PROCESS_PEAK_MB = [0.0]  # the highest allocator peak seen before any per-check reset


def _peak_start(device: str) -> int:
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    PROCESS_PEAK_MB[0] = max(PROCESS_PEAK_MB[0], torch.cuda.max_memory_allocated() / 2**20)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_mb(device: str, before: int) -> float | None:
    if device != "cuda":
        return None  # the CPU dry run has no allocator peak to read
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


def first_action(traj) -> list[int]:
    """The ids of a trajectory's first action (its sampled run after the prompt)."""
    mask = traj.action_mask[traj.prompt_length :]
    end = mask.index(0) if 0 in mask else len(mask)
    return traj.token_ids[traj.prompt_length : traj.prompt_length + end]


def check_env(device: str) -> dict:
    out = {
        "ok": True,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "cuda_available": torch.cuda.is_available(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(
            cuda=torch.version.cuda,
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gb=round(props.total_memory / 2**30, 1),
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
    return out


def check_rollout_cuda(model, codec, tasks, device: str) -> dict:
    requests = [RolloutRequest(t) for t in tasks]
    greedy = Sampling(temperature=0.0, max_new_tokens=32, max_context=1024)
    on_cpu = rollout(copy.deepcopy(model).cpu(), codec, requests, sampling=greedy, batch_size=len(requests))
    on_device = rollout(copy.deepcopy(model).to(device), codec, requests, sampling=greedy, batch_size=len(requests))
    same = sum(a.token_ids == b.token_ids for a, b in zip(on_cpu, on_device))
    return {"ok": same == len(requests), "trajectories": len(requests), "same_ids_as_cpu": same}


def check_rollout_bf16(model, codec, tasks, device: str, group: int) -> dict:
    full = copy.deepcopy(model).to(device)
    half = copy.deepcopy(model).to(device=device, dtype=torch.bfloat16)
    first = [RolloutRequest(t) for t in tasks]
    first_turn = Sampling(temperature=0.0, max_new_tokens=32, max_context=1024)
    ref = rollout(full, codec, first, sampling=first_turn, batch_size=len(first))
    got = rollout(half, codec, first, sampling=first_turn, batch_size=len(first))

    agree = sum(first_action(a) == first_action(b) for a, b in zip(ref, got))
    requests = [RolloutRequest(t, sample_index=g) for t in tasks for g in range(group)]
    _sync(device)
    started = time.perf_counter()
    trajs = rollout(
        half,
        codec,
        requests,
        sampling=Sampling(temperature=1.0, max_new_tokens=48, max_context=1024),
        batch_size=len(requests),
        seeds=list(range(len(requests))),
    )
    _sync(device)
    seconds = time.perf_counter() - started
    lps = [lp for t in trajs for lp, m in zip(t.sample_logprobs, t.action_mask) if m]
    finite = all(math.isfinite(lp) and lp <= 0 for lp in lps)
    torch.manual_seed(0)
    hidden = torch.randn(64, half.config.hidden_size, device=device).to(torch.bfloat16)
    exact = hidden.double() @ half.lm_head.weight.double().T
    head_err = (head_logits(half, hidden).double() - exact).abs().max().item()
    bf16_head_err = (half.lm_head(hidden).double() - exact).abs().max().item()
    return {
        "ok": finite and bool(lps),
        "greedy_first_action_same_as_float32": f"{agree}/{len(first)}",
        "sampled_trajectories": len(trajs),
        "action_tokens": len(lps),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(len(lps) / seconds, 1),
        "logprobs_finite_and_nonpositive": finite,
        "float32_head_max_abs_error": head_err,
        "bf16_head_max_abs_error": bf16_head_err,
    }


def check_lopd_step(model, tokenizer, batch, params, device: str, mode: str, dtype: torch.dtype) -> dict:
    tasks, trajs, experiences = batch
    base = copy.deepcopy(model).to(device=device, dtype=dtype)
    before_alloc = _peak_start(device)
    d = distiller(base, tokenizer, mode, experiences, params.lopd.samples_per_task, params)
    trainable = {n: p.detach().clone() for n, p in d.trainable.named_parameters() if p.requires_grad}
    composer = {n: p.detach().clone() for n, p in d.composer.named_parameters() if p.requires_grad}
    first = d.update(tasks, trajs)
    _sync(device)
    started = time.perf_counter()
    second = d.update(tasks, trajs)
    _sync(device)
    seconds = time.perf_counter() - started
    peak = _peak_mb(device, before_alloc)
    moved = sum(not torch.equal(p.detach(), trainable[n]) for n, p in d.trainable.named_parameters() if n in trainable)
    moved_phi = sum(not torch.equal(p.detach(), composer[n]) for n, p in d.composer.named_parameters() if n in composer)
    losses = {k: getattr(second.row, k) for k in ("distill_loss", "kl_phi", "delta", "beta")}
    finite = all(math.isfinite(float(v)) for v in list(losses.values()) + [first.row.distill_loss])
    return {
        "ok": finite and moved == len(trainable) and moved_phi == len(composer),
        "mode": mode,
        "dtype": str(dtype).removeprefix("torch."),
        "trajectories": len(trajs),
        "action_tokens": sum(t.num_action_tokens for t in trajs),
        "seconds_second_update": round(seconds, 3),
        "phases_s": {k: round(v, 4) for k, v in second.diagnostics.items() if k.endswith("_s")},
        "peak_cuda_mb_above_model": peak,
        "trainable_tensors_moved": f"{moved}/{len(trainable)}",
        "composer_tensors_moved": f"{moved_phi}/{len(composer)}",
        "losses": losses,
    }


def run(name: str, results: dict, fn, *args) -> None:
    started = time.perf_counter()
    try:
        results[name] = fn(*args)
    except Exception as exc:  # noqa: BLE001  one failing check is recorded, the others still run
        results[name] = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=8),
        }
    results[name]["check_seconds"] = round(time.perf_counter() - started, 2)
    print(f"gpu_check: {name}: {'ok' if results[name].get('ok', True) else 'FAILED'}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="data/base", help="base dir (a random tiny Qwen3 when missing)")
    parser.add_argument("--out", default="gpu_check", help="folder for checks.json")
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU with small sizes")
    parser.add_argument("--tasks", type=int, default=None, help="tasks per check (default 8; 2 with --cpu)")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if device == "cuda" and not torch.cuda.is_available():
        (out / "checks.json").write_text(json.dumps({"ok": False, "error": "no CUDA device"}, indent=2))
        print(f"gpu_check.py: torch {torch.__version__} sees no CUDA device (use --cpu for a dry run)", file=sys.stderr)
        return 2
    n = args.tasks or (2 if args.cpu else 8)
    group = 2 if args.cpu else 4
    model, tokenizer, source = load_or_build(args.model)
    codec = ChatCodec(tokenizer)
    tasks = make_tasks("toolworld", "test_id", n, seed=10)
    params = load_params(str(ROOT / "params.yaml"), [f"lopd.samples_per_task={group}", "lopd.micro_batch=0"])
    results: dict = {"model": source}
    run("env", results, check_env, device)
    run("rollout_cuda", results, check_rollout_cuda, model, codec, tasks, device)
    run("rollout_bf16", results, check_rollout_bf16, model, codec, tasks, device, group)
    on_device = copy.deepcopy(model).to(device)
    batch = make_batch(on_device, tokenizer, n, group, params.bank.top_j)
    del on_device
    for mode, dtype in (("full", torch.float32), ("lora", torch.float32), ("lora", torch.bfloat16)):
        name = f"lopd_step_{mode}" + ("_bf16" if dtype == torch.bfloat16 else "")
        run(name, results, check_lopd_step, model, tokenizer, batch, params, device, mode, dtype)
    if device == "cuda":
        results["peak_cuda_mb_whole_process"] = round(
            max(PROCESS_PEAK_MB[0], torch.cuda.max_memory_allocated() / 2**20), 1
        )
    results["ok"] = all(v.get("ok", True) for v in results.values() if isinstance(v, dict))
    (out / "checks.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: (v.get("ok") if isinstance(v, dict) else v) for k, v in results.items()}))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
