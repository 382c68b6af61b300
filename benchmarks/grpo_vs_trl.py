"""Reference check of our GRPO against TRL's GRPOTrainer, side by side in one run.

A single-turn variant of the toolworld tasks: the prompt is a task's first turn (system + user, the chat format
of lopd_core/model/chat/codec.py), the completion is the first action, and the reward is 1 when the first call equals
the oracle's first call (tool and arguments), 0.5 when only the tool matches, else 0 — a partial credit so that
a weak base gets a learning signal at all. Both trainers start from the same model, see the same prompts in the
same order (B tasks × G samples per step), use the same learning rate, temperature 1, no KL term, rewards scaled
by the group std and the token-mean ("dapo") aggregation, one optimizer step per batch.

Ours: first actions sampled by lopd_core's engine (`generate_turn`), then `Distiller.update` with
`lopd.method=grpo` — the exact update `lopd distill` runs. TRL: `GRPOTrainer` with its own generation.
Prints the two reward curves and, as JSON, the step-time ratio ours/TRL measured here (generation + update per
step, both on this machine, in this process, one after the other).

    python benchmarks/grpo_vs_trl.py [--model data/base] [--steps 15] [--tasks 4] [--samples 4] [--lr 1e-3]

TRL is a development dependency (`pip install -e .[dev]`); without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import lopd_core  # noqa: F401  (offline defaults)

HERE = Path(__file__).resolve().parent


def first_call_reward(task, action_text: str, oracle_first: dict) -> float:
    from lopd_core.envs import make_env

    env = make_env(task)
    env.reset(task)
    env.step(action_text)
    call = env.episode[0].get("call") if env.episode else None
    if not call:
        return 0.0
    if call.get("name") == oracle_first.get("name") and call.get("arguments") == oracle_first.get("arguments"):
        return 1.0
    return 0.5 if call.get("name") == oracle_first.get("name") else 0.0


def load(model_dir: str | None):
    """The embedded base when built (data/base), else a small randomly initialised Qwen3 and a fitted
    tokenizer, as the tests build them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir and (Path(model_dir) / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    from lopd_core.config import TinyModelConfig
    from lopd_core.model.demos import build_demos
    from lopd_core.model.loading import tiny_qwen3
    from lopd_core.model.tokenizer import train_tokenizer

    demos = build_demos(n=200, experience_fraction=0.4, max_experiences=2, convention_noise=0.5, slip=0.1, seed=0)
    tok = train_tokenizer((d.text() for d in demos), vocab_size=600)
    torch.manual_seed(0)
    return tiny_qwen3(
        TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128), tok
    ), tok


def make_prompts(n: int, seed: int):
    from lopd_core.envs import make_env, make_tasks, run_oracle

    out = []
    for task in make_tasks("toolworld", "train", n, seed):
        env = make_env(task)
        first = env.reset(task)
        _, _, oracle_env = run_oracle(task)
        out.append((task, first.system, first.user, oracle_env.episode[0].get("call") or {}))
    return out


def run_ours(model, tokenizer, prompts, *, steps, tasks, samples, lr, max_new_tokens, seed):
    """Our GRPO: sample first actions, build single-turn trajectories as ids, `Distiller.update`."""
    import torch

    from lopd_core.config import Params
    from lopd_core.distill.loop.trainer import Distiller
    from lopd_core.drivers.distill import new_composer
    from lopd_core.model.chat import ChatCodec
    from lopd_core.rollout.engine import Sampling, Trajectory, generate_turn

    p = Params()
    p.seed = seed
    p.lopd = replace(
        p.lopd,
        method="grpo",
        tasks_per_step=tasks,
        samples_per_task=samples,
        lr_student=lr,
        steps=steps,
        micro_batch=0,
        out_dir="/tmp/grpo_vs_trl/ours",
        csv="/tmp/grpo_vs_trl/ours/distill.csv",
    )
    torch.manual_seed(seed)
    d = Distiller(p, model, tokenizer, lambda ts: [[] for _ in ts], composer=new_composer(p, model), log=lambda m: None)
    codec = ChatCodec(tokenizer)
    sampling = Sampling(temperature=1.0, max_new_tokens=max_new_tokens)
    gen = torch.Generator().manual_seed(seed)
    rewards, seconds = [], []
    for s in range(steps):
        started = time.perf_counter()
        batch = prompts[s * tasks : (s + 1) * tasks]
        starts = [codec.start(system, user) for _, system, user, _ in batch for _ in range(samples)]
        turns = generate_turn(
            d.student,
            [t.token_ids for t in starts],
            sampling=sampling,
            stop_id=codec.im_end_id,
            pad_id=codec.pad_id,
            generator=gen,
        )
        trajs = []
        for i, (ids, (act, lps)) in enumerate(zip(starts, turns)):
            task, _, _, oracle_first = batch[i // samples]
            ids.add_action(act, lps)
            r = first_call_reward(task, codec.decode_action(act), oracle_first)
            trajs.append(
                Trajectory(
                    task,
                    i % samples,
                    (),
                    ids.token_ids,
                    ids.action_mask,
                    ids.sample_logprobs,
                    len(ids.token_ids) - len(act),
                    reward=r,
                    success=r == 1.0,
                )
            )
        d.update([b[0] for b in batch], trajs)
        seconds.append(time.perf_counter() - started)
        rewards.append(statistics.fmean(t.reward for t in trajs))
    return rewards, seconds


def run_trl(model, tokenizer, prompts, *, steps, tasks, samples, lr, max_new_tokens, seed):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lopd_core.model.chat import IM_END, first_turn_text

    tok = copy.deepcopy(tokenizer)
    tok.eos_token = IM_END  # a completion is one assistant turn: it ends at <|im_end|>, as in our engine
    by_prompt = {first_turn_text(system, user): (task, oracle) for task, system, user, oracle in prompts}
    data = Dataset.from_list(
        [{"prompt": first_turn_text(system, user)} for _, system, user, _ in prompts[: steps * tasks]]
    )

    def reward(prompts, completions, completion_ids=None, **_):
        # TRL's `completions` are decoded with skip_special_tokens=True, which drops the <tool_call> markers a
        # call is parsed by (every completion then scores 0): decode its ids with the special tokens kept.
        texts = (
            [tok.decode(ids, skip_special_tokens=False) for ids in completion_ids]
            if completion_ids is not None
            else completions
        )
        out = []
        for prompt, completion in zip(prompts, texts):
            task, oracle = by_prompt[prompt]
            out.append(first_call_reward(task, completion.split(IM_END)[0], oracle))
        return out

    class Timer(TrainerCallback):
        def __init__(self):
            self.seconds, self._t = [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.seconds.append(time.perf_counter() - self._t)

    args = GRPOConfig(
        output_dir="/tmp/grpo_vs_trl/trl",
        per_device_train_batch_size=tasks * samples,
        num_generations=samples,
        max_completion_length=max_new_tokens,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        beta=0.0,
        num_iterations=1,
        temperature=1.0,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=seed,
        shuffle_dataset=False,
        disable_dropout=True,
        bf16=False,
    )
    timer = Timer()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok, callbacks=[timer]
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return rewards, timer.seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(HERE.parent / "data" / "base"))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        print(
            "grpo_vs_trl: TRL is not installed (a development dependency: pip install -e '.[dev]'); "
            "nothing to compare, skipping."
        )
        return 0
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    base, tokenizer = load(args.model)
    prompts = make_prompts(args.steps * args.tasks, args.seed + 7)
    kw = {
        "steps": args.steps,
        "tasks": args.tasks,
        "samples": args.samples,
        "lr": args.lr,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
    }
    ours_r, ours_s = run_ours(copy.deepcopy(base), tokenizer, prompts, **kw)
    trl_r, trl_s = run_trl(copy.deepcopy(base), tokenizer, prompts, **kw)
    print(f"{'step':>4}  {'ours reward':>11}  {'TRL reward':>10}  {'ours s':>7}  {'TRL s':>7}")

    def cell(xs, i, fmt):
        return fmt.format(xs[i]) if i < len(xs) else "-"

    for i in range(max(len(ours_r), len(trl_r))):
        print(
            f"{i + 1:>4}  {cell(ours_r, i, '{:11.3f}'):>11}  {cell(trl_r, i, '{:10.3f}'):>10}  "
            f"{cell(ours_s, i, '{:7.2f}'):>7}  {cell(trl_s, i, '{:7.2f}'):>7}"
        )
    skip = 1 if len(ours_s) > 2 and len(trl_s) > 2 else 0  # the first step of each pays one-off warm-up costs
    ratio = statistics.fmean(ours_s[skip:]) / statistics.fmean(trl_s[skip:])
    half = max(1, len(ours_r) // 2)
    print(
        json.dumps(
            {
                "model": args.model if (Path(args.model) / "config.json").exists() else "random tiny Qwen3",
                "steps": args.steps,
                "tasks_x_samples": [args.tasks, args.samples],
                "lr": args.lr,
                "ours_reward_first_half": round(statistics.fmean(ours_r[:half]), 4),
                "ours_reward_second_half": round(statistics.fmean(ours_r[half:]), 4),
                "trl_reward_first_half": round(statistics.fmean(trl_r[:half]), 4),
                "trl_reward_second_half": round(statistics.fmean(trl_r[half:]), 4),
                "ours_step_s": round(statistics.fmean(ours_s[skip:]), 3),
                "trl_step_s": round(statistics.fmean(trl_s[skip:]), 3),
                "step_time_ratio_ours_over_trl": round(ratio, 3),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
