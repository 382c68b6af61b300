"""Rollout throughput: the batched token-level engine, with and without prompt sharing, against a naive
per-sample `generate` loop.

For each group size G, the same multi-turn toolworld tasks are played G times each (sampled, one seeded stream
per trajectory as in training) four ways, one after the other in this run: the engine keeping each trajectory's
KV cache across turns, so a later turn prefills only its new tokens (`kept`, the default), the engine
re-prefilling every conversation each turn with each distinct context prefilled once and its KV cache forked
for the G samples (`shared`: a task's first turn), the same prefilling every row (`unshared`), and one
`generate` call per sample and turn (`naive`). Prints JSON with each one's tokens/s and their ratios, and
whether the engine's variants played the same ids.

    .venv/bin/python benchmarks/rollout_throughput.py [--tasks 16] [--groups 4,8] [--batch-size 32] [--model data/base]

Uses the embedded base at data/base when it exists (build it with `lopd base`), else a randomly initialised
tiny Qwen3 with a tokenizer fitted on demonstrations (its actions are nonsense, so episodes run to the turn
limit: still a fair token-for-token comparison). `--device cuda --dtype bfloat16` measures on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopd_core  # noqa: F401
from lopd_core.config import TinyModelConfig
from lopd_core.envs import make_env, make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout import engine
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout


def load_or_build(model_dir: str):
    if (Path(model_dir) / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        return model, AutoTokenizer.from_pretrained(model_dir), model_dir
    from lopd_core.model.demos import build_demos
    from lopd_core.model.loading import tiny_qwen3
    from lopd_core.model.tokenizer import train_tokenizer

    demos = build_demos(n=300, experience_fraction=0.3, max_experiences=2, convention_noise=0.5, slip=0.0, seed=0)
    tokenizer = train_tokenizer((d.text() for d in demos), 1024)
    torch.manual_seed(0)
    return tiny_qwen3(TinyModelConfig(), tokenizer).eval(), tokenizer, "random-init tiny Qwen3"


@torch.no_grad()
def naive_rollouts(model, codec: ChatCodec, requests: list[RolloutRequest], sampling: Sampling, seed: int) -> int:
    """One sample at a time, one `generate` call per assistant turn. Returns generated tokens."""
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    sample = (
        {"do_sample": False}
        if sampling.temperature == 0
        else {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
    )
    generated = 0
    for req in requests:
        env = make_env(req.task)
        first = env.reset(req.task)
        ids = codec.start(first.system, first.user).token_ids
        while True:
            out = model.generate(
                torch.tensor([ids], device=device),
                max_new_tokens=sampling.max_new_tokens,
                eos_token_id=codec.im_end_id,
                pad_token_id=codec.pad_id,
                **sample,
            )
            new = out[0, len(ids) :].tolist()
            generated += len(new)
            ids = ids + new + ([] if new and new[-1] == codec.im_end_id else [codec.im_end_id])
            result = env.step(codec.decode_action(new))
            if result.done:
                break
            ids += codec.observation_ids(result.observation)
            if len(ids) + sampling.max_new_tokens > sampling.max_context:
                env.step("")
                break
    return generated


def engine_rollouts(
    model,
    codec: ChatCodec,
    requests: list[RolloutRequest],
    sampling: Sampling,
    batch_size: int,
    *,
    share_prompts: bool,
    keep_cache: bool = False,
):
    seeds = list(range(len(requests)))
    turn = partial(engine.generate_turn, share_prompts=share_prompts)
    with mock.patch.object(engine, "generate_turn", turn):
        return rollout(
            model, codec, requests, sampling=sampling, batch_size=batch_size, seeds=seeds, keep_cache=keep_cache
        )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(
    model, codec: ChatCodec, tasks, group: int, sampling: Sampling, batch_size: int, device: str, repeats: int
) -> dict:
    """The engine's variants and naive rollouts of `tasks` × `group` samples, side by side. The engine's variants
    alternate `repeats` times and keep their median time (they are short next to the naive loop, so noisier);
    the naive loop runs once."""
    requests = [RolloutRequest(t, sample_index=g) for t in tasks for g in range(group)]
    seconds: dict[str, list[float]] = {"unshared": [], "shared": [], "kept": [], "naive": []}
    tokens, played = {}, {}
    for name in ["unshared", "shared", "kept"] * repeats + ["naive"]:
        _sync(device)
        started = time.perf_counter()
        if name == "naive":
            tokens[name] = naive_rollouts(model, codec, requests, sampling, seed=group)
        else:
            trajs = engine_rollouts(
                model,
                codec,
                requests,
                sampling,
                batch_size,
                share_prompts=name != "unshared",
                keep_cache=name == "kept",
            )
            tokens[name] = sum(t.num_action_tokens for t in trajs)
            played[name] = [t.token_ids for t in trajs]
        _sync(device)
        seconds[name].append(time.perf_counter() - started)
    figures = {}
    for name, times in seconds.items():
        median = sorted(times)[len(times) // 2]
        figures[name] = {
            "tokens": tokens[name],
            "seconds": round(median, 3),
            "tokens_per_s": round(tokens[name] / median, 1),
        }
    tps = {name: f["tokens_per_s"] for name, f in figures.items()}
    return {
        "group": group,
        "trajectories": len(requests),
        **figures,
        "kept_over_naive": round(tps["kept"] / tps["naive"], 2),
        "shared_over_naive": round(tps["shared"] / tps["naive"], 2),
        "unshared_over_naive": round(tps["unshared"] / tps["naive"], 2),
        "shared_over_unshared": round(tps["shared"] / tps["unshared"], 2),
        "kept_over_shared": round(tps["kept"] / tps["shared"], 2),
        "shared_plays_unshared_ids": played["shared"] == played["unshared"],
        "kept_plays_shared_ids": played["kept"] == played["shared"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=16, help="distinct tasks; each is played G times")
    parser.add_argument("--groups", default="4,8", help="comma-separated group sizes G")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default="data/base")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each engine variant (median kept)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, source = load_or_build(args.model)
    model = model.to(device=args.device, dtype=getattr(torch, args.dtype))
    codec = ChatCodec(tokenizer)
    tasks = make_tasks("toolworld", "test_id", args.tasks, seed=123)
    sampling = Sampling(temperature=args.temperature, max_new_tokens=args.max_new_tokens, max_context=1024)
    for keep_cache in (False, True):  # warm-up
        engine_rollouts(
            model, codec, [RolloutRequest(tasks[0])] * 2, sampling, 2, share_prompts=True, keep_cache=keep_cache
        )
    groups = [
        measure(model, codec, tasks, int(g), sampling, args.batch_size, args.device, args.repeats)
        for g in args.groups.split(",")
    ]
    print(
        json.dumps(
            {
                "model": source,
                "device": args.device,
                "dtype": args.dtype,
                "tasks": len(tasks),
                "batch_size": args.batch_size,
                "temperature": args.temperature,
                "threads": args.threads,
                "repeats": args.repeats,
                "groups": groups,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
