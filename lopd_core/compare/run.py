"""One run of `lopd compare`: train one method with one seed to a rollout budget, evaluating along the way.

The budget is counted in sampled trajectories, and a method that reads the experience bank starts with the
bank's seed rollouts already spent (they were sampled to fill it); GRPO and the other bank-free methods spend
the whole budget on training steps. The bank holds only sampled successes of the deployment worlds; the
composer's cold start reads oracle episodes of the pretraining worlds only, and OPSD's golden solutions (ground
truth by definition) are not sampled and not counted; compare.md says so.

Along the run, the student is evaluated on the held-out `test_id` tasks (`curve_n`, greedy and sampled) at
`curve_points` evenly spaced steps and at the start, which gives success against rollouts; at the end on
`test_id` and `test_ood` with `eval_n` tasks per split (or, for learning-rate tuning, on validation tasks from
the train split, never on test).
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import torch

from lopd_core.config import Params
from lopd_core.evaluation import evaluate
from lopd_core.lopd.composer import mean_embedding_norm
from lopd_core.lopd.methods import method_spec
from lopd_core.lopd.stages import method_retriever, new_composer, open_bank
from lopd_core.lopd.trainer import Distiller, load_composer, run_distill
from lopd_core.model.loading import load_policy


def _evaluate(model, tokenizer, params: Params, splits: list[str], n: int, log) -> dict:
    p = copy.deepcopy(params)
    p.eval.splits, p.eval.n_per_split, p.eval.with_experience = splits, n, False
    p.eval.modes = ["greedy", "sampled"]
    return evaluate(model, tokenizer, p, log=log)["toolworld"]


def plan_steps(params: Params, method: str, budget: int, bank_rollouts: int) -> tuple[int, int]:
    """(training steps, rollouts already spent) for `method` at `budget` sampled trajectories."""
    spec = method_spec(method, params.baselines)
    spent = bank_rollouts if spec.uses_bank else 0
    per_step = params.lopd.tasks_per_step * params.lopd.samples_per_task
    steps = (budget - spent) // per_step
    if steps < 1:
        raise ValueError(f"compare budget {budget} leaves no training step for {method} (bank rollouts {spent}, "
                         f"{per_step} per step): raise the budget or shrink the bank")
    return steps, spent


def run_method(params: Params, method: str, out_dir: str | Path, *, budget: int, bank_rollouts: int,
               bank_dir: str | None = None, index_dir: str | None = None, phi0: str | None = None,
               curve_points: int = 4, curve_n: int = 32, eval_n: int = 100, validation_n: int = 0,
               log=print) -> dict:
    """Train `method` from params.model to `budget`; returns (and writes to out_dir/summary.json) the run's
    numbers. `validation_n` > 0: a tuning run, evaluated at the end on that many train-split tasks only."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p = copy.deepcopy(params)
    spec = method_spec(method, p.baselines)
    steps, spent = plan_steps(p, method, budget, bank_rollouts)
    p.lopd.method, p.lopd.steps = method, steps
    p.lopd.out_dir, p.lopd.csv = str(out), str(out / "distill.csv")
    p.lopd.checkpoint_every = max(steps, 1)
    if bank_dir:
        p.bank.dir, p.bank.index_dir = bank_dir, index_dir or p.bank.index_dir
    random.seed(p.seed)
    torch.manual_seed(p.seed)
    model, tokenizer = load_policy(p.model)
    if spec.needs_composer:
        composer = load_composer(phi0, model.config.hidden_size, p.composer, mean_embedding_norm(model))
    else:  # unused by the teacher: the Distiller still owns one, so every method builds the same objects
        composer = new_composer(p, model)

    bank = open_bank(p) if spec.uses_bank else None
    try:
        retriever = method_retriever(spec, bank, p)
        distiller = Distiller(p, model, tokenizer, retriever, composer=composer, initial_rollouts=spent,
                              log=log)
        marks = sorted({max(1, round(steps * k / curve_points)) for k in range(1, curve_points + 1)})
        curve, train_s, eval_s = [], 0.0, 0.0
        t = time.perf_counter()
        start_eval = _evaluate(distiller.student, tokenizer, p, ["test_id"], curve_n, log)
        eval_s += time.perf_counter() - t
        curve.append({"step": 0, "rollouts": spent, **_cells(start_eval)})
        for mark in marks:
            t = time.perf_counter()
            run_distill(distiller, steps=mark, resume=mark == marks[0])
            train_s += time.perf_counter() - t
            t = time.perf_counter()
            point = _evaluate(distiller.student, tokenizer, p, ["test_id"], curve_n, log)
            eval_s += time.perf_counter() - t
            curve.append({"step": mark, "rollouts": distiller.state.rollouts, **_cells(point)})
        t = time.perf_counter()
        if validation_n:
            final = _evaluate(distiller.student, tokenizer, p, ["train"], validation_n, log)
        else:
            final = _evaluate(distiller.student, tokenizer, p, ["test_id", "test_ood"], eval_n, log)
        eval_s += time.perf_counter() - t
    finally:
        if bank is not None:
            bank.close()
    (out / "eval.json").write_text(json.dumps({"toolworld": final}, indent=2, sort_keys=True))
    summary = {
        "method": method, "world": p.envs.deploy_worlds[0], "seed": p.seed, "lr": p.lopd.lr_student, "budget": budget, "steps": steps,
        "bank_rollouts": spent, "rollouts": distiller.state.rollouts, "train_seconds": round(train_s, 2),
        "eval_seconds": round(eval_s, 2), "final_beta": distiller.state.beta, "csv": str(out / "distill.csv"),
        "eval": str(out / "eval.json"), "curve": curve,
        "final": {split: {mode: {"success_rate": cell["success_rate"], "reward_mean": cell["reward_mean"],
                                 "n": cell["n"], "by_domain": cell.get("by_domain", {})}
                          for mode, cell in modes.items()} for split, modes in final.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _cells(results: dict) -> dict:
    """test_id success and reward per mode, flat: {"greedy_success": .., "sampled_reward": ..}."""
    cells = results["test_id"]
    return {f"{mode}_{k}": cells[mode][f"{k}_rate" if k == "success" else f"{k}_mean"]
            for mode in ("greedy", "sampled") for k in ("success", "reward")}
