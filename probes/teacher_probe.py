"""Does the latent teacher play better than the base? The ceiling a distillation run can reach, measured.

    .venv/bin/python probes/teacher_probe.py [--n 200] [--split val] [--modes greedy sampled] \\
        [--composer data/exp/lopd_s0/composer.pt ...] [--set section.key=value ...] [--out metrics/teacher_probe.json]

On held-out tasks of `--split` (default `val`: held-out training-distribution tasks, disjoint from train and from
every test split, lopd_core/envs/held_out.py; drawn as `lopd evaluate` draws a split, same seed), each task's J
nearest bank rows are retrieved as in training (no self-retrieval), and the frozen base plays every task four ways:

* `base`        — nothing in context: the student before distillation;
* `text`        — the retrieved experiences as text in the first user turn: what the cold start's KL teaches the
                  composer to imitate, the reference for what the experiences can tell this base;
* `latents_phi0`— the same experiences through the cold-start composer φ0 (`coldstart.out`), spliced into the
                  same slot: the teacher LOPD starts from;
* `latents_<name>` — the same through each `--composer` file (a run's `composer.pt`): the teacher it ended with.

A teacher that does not play better than `base` cannot lift the student by distillation, however the
distillation is tuned. Why `val` by default: this probe chooses between composers and their options, and a choice
made on test_id (the split the gate and the headline figures read) would make those figures look better than a
fresh draw would (winner's curse); test_final is refused, since no choice may read it. Needs the base, the bank
and φ0 (`lopd base`, `lopd bank`, `lopd coldstart`). Prints a markdown table and JSON (success with 95 % interval,
mean reward, per condition and mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.config import load_params
from lopd_core.distill.loop.build import load_composer
from lopd_core.distill.teacher.teacher_rollout import latent_rollout, task_latents
from lopd_core.drivers.distill import make_retriever, open_bank
from lopd_core.envs.mix import deployment_tasks
from lopd_core.evaluation import EVAL_SEED_OFFSET, summarize
from lopd_core.jsonio import write_json
from lopd_core.model.chat import ChatCodec
from lopd_core.model.loading import load_policy
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--n", type=int, default=200, help="held-out tasks of --split")
    parser.add_argument(
        "--split",
        default="val",
        choices=["val", "test_id", "test_ood", "pretrain_test"],  # never test_final: no choice reads it
        help="val (default): the split design choices are made on; a test split only to reproduce an old figure",
    )
    parser.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    parser.add_argument("--composer", nargs="*", default=[], help="trained composers (a run's composer.pt)")
    parser.add_argument(
        "--conditions",
        nargs="*",
        default=["base", "text", "phi0"],
        choices=["base", "text", "phi0"],
        help="the reference conditions played beside --composer's (phi0: coldstart.out's latents)",
    )
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    params = load_params(args.params, args.overrides)
    # drawn before the model loads: a mix that has no such split stops here (lopd_core/envs/mix.py)
    tasks = deployment_tasks(params.envs, args.split, args.n, params.seed + EVAL_SEED_OFFSET)
    torch.manual_seed(params.seed)
    model, tokenizer = load_policy(params.model)
    model.eval()
    codec = ChatCodec(tokenizer)
    with open_bank(params) as bank:
        retrieval = dataclasses.replace(params.bank.retrieval, allow_self_retrieval=False)
        texts = make_retriever(bank, retrieval)(tasks)
    composers = {"latents_phi0": params.coldstart.out} if "phi0" in args.conditions else {}
    composers.update({f"latents_{Path(p).parent.name or Path(p).stem}": p for p in args.composer})
    for name, path in composers.items():
        if not Path(path).exists():
            raise FileNotFoundError(f"{name}: no composer at {path}")
    latents = {
        name: task_latents(
            model,
            tokenizer,
            load_composer(path, model, params.composer),
            texts,
            max_tokens=params.composer.max_experience_tokens,
            queries=[t.instruction for t in tasks],
        )
        for name, path in composers.items()
    }
    ro, ev = params.rollout, params.eval
    plain = [RolloutRequest(t) for t in tasks]
    with_text = [RolloutRequest(t, experiences=tuple(x)) for t, x in zip(tasks, texts)]

    def play(condition: str, sampling: Sampling):
        if condition == "base":
            return rollout(model, codec, plain, sampling=sampling, batch_size=ro.batch_size, seed=params.seed)
        if condition == "text":
            return rollout(model, codec, with_text, sampling=sampling, batch_size=ro.batch_size, seed=params.seed)
        return latent_rollout(
            model, tokenizer, plain, latents[condition], sampling=sampling, batch_size=ro.batch_size, seed=params.seed
        )

    results: dict = {}
    for mode in args.modes:
        sampling = Sampling(
            temperature=0.0 if mode == "greedy" else ev.temperature,
            top_p=ro.top_p,
            max_new_tokens=ro.max_new_tokens,
            max_context=ro.max_context,
        )
        for condition in [c for c in ("base", "text") if c in args.conditions] + list(latents):
            started = time.perf_counter()
            summary = summarize(play(condition, sampling))
            summary["seconds"] = round(time.perf_counter() - started, 1)
            results.setdefault(condition, {})[mode] = summary
            print(
                f"{condition}/{mode}: success {summary['success_rate']:.3f} {summary['ci95']} "
                f"reward {summary['reward_mean']:.3f}",
                file=sys.stderr,
                flush=True,
            )
    report = {
        "envs": params.envs.mix,
        "deploy_worlds": params.envs.deploy_worlds,
        "split": args.split,
        "n": args.n,
        "top_j": params.bank.top_j,
        "model": params.model.name_or_path,
        "composers": composers,
        "results": results,
    }
    print("| condition | " + " | ".join(f"{m} success [95 % CI]" for m in args.modes) + " |")
    print("|---|" + "---|" * len(args.modes))
    for name, cells in results.items():
        row = " | ".join(
            f"{c['success_rate'] * 100:.1f} % [{c['ci95'][0] * 100:.1f}, {c['ci95'][1] * 100:.1f}]"
            for c in (cells[m] for m in args.modes)
        )
        print(f"| {name} | {row} |")
    print(json.dumps(report, indent=2))
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
