"""Rollout throughput: the batched token-level engine against a naive per-sample `generate` loop.

Both play the same multi-turn toolworld tasks greedily with the same model, one after the other in this run,
and count the tokens the policy generated. Prints JSON with tokens/s of each and their ratio.

    .venv/bin/python benchmarks/rollout_throughput.py [--tasks 64] [--batch-size 32] [--model data/base]

Uses the embedded base at data/base when it exists (build it with `lopd base`), else a randomly initialised
tiny Qwen3 with a tokenizer fitted on demonstrations (its actions are nonsense, so episodes run to the turn
limit: still a fair token-for-token comparison).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopd_core  # noqa: F401
from lopd_core.config import TinyModelConfig
from lopd_core.envs import make_env, make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout


def load_or_build(model_dir: str):
    if (Path(model_dir) / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir), model_dir
    from lopd_core.model.demos import build_demos
    from lopd_core.model.loading import tiny_qwen3
    from lopd_core.model.tokenizer import train_tokenizer

    demos = build_demos(n=300, experience_fraction=0.3, max_experiences=2, convention_noise=0.5, slip=0.0, seed=0)
    tokenizer = train_tokenizer((d.text() for d in demos), 1024)
    torch.manual_seed(0)
    return tiny_qwen3(TinyModelConfig(), tokenizer).eval(), tokenizer, "random-init tiny Qwen3"


@torch.no_grad()
def naive_rollouts(model, codec: ChatCodec, tasks, sampling: Sampling) -> int:
    """One task at a time, one `generate` call per assistant turn. Returns generated tokens."""
    generated = 0
    for task in tasks:
        env = make_env(task)
        first = env.reset(task)
        ids = codec.start(first.system, first.user).token_ids
        while True:
            out = model.generate(torch.tensor([ids]), max_new_tokens=sampling.max_new_tokens, do_sample=False,
                                 eos_token_id=codec.im_end_id, pad_token_id=codec.pad_id)
            new = out[0, len(ids):].tolist()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", default="data/base")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, source = load_or_build(args.model)
    codec = ChatCodec(tokenizer)
    tasks = make_tasks("toolworld", "test_id", args.tasks, seed=123)
    sampling = Sampling(temperature=0.0, max_new_tokens=64, max_context=1024)

    started = time.perf_counter()
    trajs = rollout(model, codec, [RolloutRequest(t) for t in tasks], sampling=sampling,
                    batch_size=args.batch_size, seed=0)
    engine_s = time.perf_counter() - started
    engine_tokens = sum(t.num_action_tokens for t in trajs)

    started = time.perf_counter()
    naive_tokens = naive_rollouts(model, codec, tasks, sampling)
    naive_s = time.perf_counter() - started

    engine_tps, naive_tps = engine_tokens / engine_s, naive_tokens / naive_s
    print(json.dumps({
        "model": source,
        "tasks": len(tasks),
        "batch_size": args.batch_size,
        "threads": args.threads,
        "engine": {"tokens": engine_tokens, "seconds": round(engine_s, 2), "tokens_per_s": round(engine_tps, 1)},
        "naive_generate": {"tokens": naive_tokens, "seconds": round(naive_s, 2), "tokens_per_s": round(naive_tps, 1)},
        "throughput_ratio": round(engine_tps / naive_tps, 2),
        "engine_success_rate": round(sum(t.success for t in trajs) / len(trajs), 3),
    }, indent=2))


if __name__ == "__main__":
    main()
