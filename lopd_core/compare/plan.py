"""What `lopd compare` decides between its runs: the params of a replicate, the learning rate each method keeps
after tuning, and the settings table its report opens with.

Pure functions of the preset and the runs' summaries, apart from the flow (flows/compare.py) that schedules the
runs: the same choices whoever ran them, testable without Prefect or MLflow.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from lopd_core.config import Params

# A tie between learning rates on the validation score goes to the one nearest this (the default lr_student).
TIE_BREAK_LR = 3e-4


# Training run t of a replicate runs under seed + TRAIN_SEED_STRIDE·t: t = 0 is the replicate's own seed (the runs
# of a one-seed comparison keep their keys), and the stride keeps every replicate's runs apart.
TRAIN_SEED_STRIDE = 1000


def run_seed(replicate_seed: int, train_seed: int) -> int:
    return replicate_seed + TRAIN_SEED_STRIDE * train_seed


def pair_params(params: Params, world: str, seed: int) -> Params:
    """The params of one replicate: the deployment world it plays and the seed it runs under."""
    p = copy.deepcopy(params)
    p.seed, p.envs = seed, replace(p.envs, deploy_worlds=[world])
    return p


def tune_score(summary: dict) -> float:
    """Validation score of a tuning run: mean reward of greedy and sampled (smoother than success)."""
    cells = summary["final"]["train"]
    return (cells["greedy"]["reward_mean"] + cells["sampled"]["reward_mean"]) / 2


def tuned_rates(tuning: list[dict], methods, lr_grid, default_lr: float) -> dict[str, float]:
    """The learning rate each method runs at: its best on the tuning runs (`{"method", "lr", "score"}` each), else
    the grid's one value, else `default_lr` (lopd.lr_student)."""
    rates = {}
    for m in methods:
        scored = [t for t in tuning if t["method"] == m]
        if scored:
            rates[m] = max(scored, key=lambda t: (t["score"], -abs(t["lr"] - TIE_BREAK_LR)))["lr"]
        else:
            rates[m] = lr_grid[0] if lr_grid else default_lr
    return rates


def bank_note(params: Params, sampled: int | None) -> str:
    """The report's line on the bank: what it cost (`sampled` rollouts per replicate; None: no method reads it)."""
    if sampled is None:
        return "not used"
    note = (
        f"{sampled} sampled rollouts per replicate, charged to the methods "
        f"that read the bank (its own successes only; the composer's cold start read "
        f"{params.coldstart.oracle_tasks} oracle episodes of the pretraining worlds)"
    )
    if params.bank.refresh_every > 0:
        note += (
            f"; grown during each run by the student's successes every {params.bank.refresh_every} "
            "steps, in the run's own copy (the methods that retrieve the nearest, as in the cycle)"
        )
    return note


def report_settings(
    params: Params,
    preset,
    *,
    command: str,
    pairs: list[tuple[str, int]],
    tune_pair: tuple[str, int] | None,
    bank_sampled: int | None,
    base: str,
    base_hash: str,
    overrides: list[str],
    seconds: float,
    commit: str,
) -> list[tuple[str, str]]:
    """The settings table of compare.md: how the comparison was run, in the order a reader checks it.
    `tune_pair`: the replicate the rates were tuned on, None when the grid has one value."""
    per_step = f"{params.lopd.tasks_per_step} tasks × {params.lopd.samples_per_task} samples per step"
    grid = ", ".join(f"{x:g}" for x in preset.lr_grid)
    if tune_pair is None:
        grid += " (one value: no tuning)"
    else:
        grid += (
            f"; tuned in {tune_pair[0]} on seed {tune_pair[1]} at {preset.tune_budget_fraction:g} of the budget, "
            f"{preset.tune_n} validation tasks"
        )
    return [
        ("command", f"`{command}`"),
        ("preset", params.compare.preset),
        ("methods", ", ".join(preset.methods)),
        ("replicates (deployment world, seed)", ", ".join(f"({w}, {s})" for w, s in pairs)),
        ("training seeds per replicate", f"{preset.train_seeds} (run t: the replicate's seed + 1000·t)"),
        ("rollout budget", f"{preset.budget} sampled trajectories per run ({per_step})"),
        ("bank", bank_note(params, bank_sampled)),
        ("learning-rate grid (lopd.lr_student)", grid),
        ("base", f"{base}, weights sha256 {base_hash}"),
        ("preset overrides", " ".join(f"`{o}`" for o in overrides) or "none"),
        ("total wall time", f"{seconds / 60:.1f} min"),
        ("git commit", commit),
    ]
