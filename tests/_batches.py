"""A shared training batch for the trainer tests: six trajectories (3 tasks × 2 samples) of the tiny model with
rewards of both signs, and oracle experience texts to retrieve."""

from __future__ import annotations

from dataclasses import replace

from lopd_core.config import Params
from lopd_core.envs import make_tasks, run_oracle
from lopd_core.experience import format_experience
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout


def six_trajectories(model, tokenizer):
    """(tasks, trajectories) with rewards 1, 0, .5, 1, 0, .25 (successes 0 and 3): the advantage takes both signs."""
    tasks = make_tasks("toolworld", "train", 3, seed=11)
    reqs = [RolloutRequest(t, sample_index=g) for t in tasks for g in range(2)]
    trajs = rollout(
        model,
        ChatCodec(tokenizer),
        reqs,
        sampling=Sampling(temperature=1.0, max_new_tokens=24, max_context=640),
        seed=3,
    )
    for i, t in enumerate(trajs):
        t.reward, t.success = [1.0, 0.0, 0.5, 1.0, 0.0, 0.25][i], i in (0, 3)
    return tasks, trajs


def oracle_texts(n: int) -> list[str]:
    """Experience texts of `n` oracle successes (seed 99)."""
    out = []
    for t in make_tasks("toolworld", "train", n, seed=99):
        _, _, env = run_oracle(t)
        out.append(format_experience(t.instruction, env.episode))
    return out


def loop_params(tmp_path, *, max_new_tokens: int = 24, **lopd) -> Params:
    """Params of a short resumable run (2 tasks × 2 samples, 3 steps, a checkpoint every step): the paper's
    LOPD, φ trained (the default method keeps φ = φ0), at the paper's constant m (the default prices it: auto);
    `lopd` overrides any of the section's fields."""
    p = Params()
    p.seed = 0
    p.rollout = replace(p.rollout, max_new_tokens=max_new_tokens, max_context=640)
    p.lopd = replace(
        p.lopd,
        **{
            "method": "lopd",
            "tasks_per_step": 2,
            "samples_per_task": 2,
            "steps": 3,
            "checkpoint_every": 1,
            "out_dir": str(tmp_path / "lopd"),
            "margin": 0.05,
            "csv": str(tmp_path / "plots" / "distill.csv"),
            **lopd,
        },
    )
    return p


def step_params(tmp_path, **lopd) -> Params:
    """Params of one small LOPD step on that batch (3 tasks × 2 samples): the paper's LOPD, φ trained, at the
    paper's constant m and β starting at 0.5; `lopd` overrides any of the section's fields."""
    p = Params()
    p.seed = 0
    p.rollout = replace(p.rollout, max_new_tokens=24, max_context=640)
    # the paper's LOPD, φ trained (the default method keeps φ = φ0), at the paper's constant m: what these tests
    # exercise (the default prices it: auto)
    p.lopd = replace(
        p.lopd,
        **{
            "method": "lopd",
            "tasks_per_step": 3,
            "samples_per_task": 2,
            "steps": 1,
            "out_dir": str(tmp_path / "lopd"),
            "csv": str(tmp_path / "plots" / "distill.csv"),
            "checkpoint_every": 1,
            "beta_init": 0.5,
            "margin": 0.05,
            **lopd,
        },
    )
    return p
