"""Settings of `lopd compare`: every method at one rollout budget, seeds, learning rates tuned on one grid."""

from __future__ import annotations

from dataclasses import dataclass

from lopd_core.methods import METHOD_NAMES
from lopd_core.settings.checks import ConfigError, any_of, fraction, one_of, positive, subset_of
from lopd_core.settings.envs import NAMED_WORLDS
from lopd_core.settings.fields import Section, setting


@dataclass(frozen=True)
class ComparePreset(Section):
    """One size of `lopd compare`: which methods, seeds and rollout budget, and the learning-rate grid."""

    SECTION = "compare.presets.*"

    methods: list[str] = setting(
        factory=lambda: list(METHOD_NAMES),
        check=subset_of(*METHOD_NAMES),
        help="the methods compared (lopd.method's names)",
    )
    seeds: list[int] = setting(factory=lambda: [0, 1, 2], help="one replicate per seed")
    train_seeds: int = setting(
        1,
        help="training runs of every method per replicate (its bank and φ shared): run t trains and evaluates "
        "under the replicate's seed + 1000·t, so the verdicts' intervals cover the spread between training runs",
        check=positive(),
    )
    curve_marks: list[int] = setting(
        factory=list,
        help="rollouts at which the held-out curve is read, the same for every method (empty: curve_points "
        "evenly spaced steps)",
    )
    worlds: list[str] = setting(
        factory=list,
        check=any_of(*NAMED_WORLDS),
        help="the deployment world of each seed (empty: envs.deploy_worlds for every seed)",
    )
    tune_world: str = setting(
        "",
        check=one_of("", *NAMED_WORLDS),
        help="learning rates are tuned in this world, apart from every world a replicate reports",
    )
    budget: int = setting(
        1024,
        help="sampled trajectories per run, bank seed rollouts included (a method that reads the bank pays for it)",
        check=positive(),
    )
    lr_grid: list[float] = setting(factory=lambda: [3e-4, 1e-3], help="lopd.lr_student, the same grid for every method")
    tune_seed: int = setting(100, help="learning rates are picked on this seed and validation tasks, never on test")
    tune_budget_fraction: float = setting(0.25, help="tuning runs are this much shorter", check=fraction())
    tune_n: int = setting(32, help="validation tasks (train split, own seed stream)", check=positive())
    eval_n: int = setting(100, help="held-out tasks per split at the end of a run", check=positive())
    curve_points: int = setting(4, help="held-out (test_id) evaluations along a run", check=positive())
    curve_n: int = setting(48, help="tasks per curve point", check=positive())
    overrides: list[str] = setting(
        factory=lambda: ["bank.seed_tasks=64", "bank.samples_per_task=2", "eval.with_experience=false"],
        help="section.key=value applied to every run (before the command line's --set)",
    )

    def check(self) -> None:
        if self.worlds and len(self.worlds) != len(self.seeds):
            raise ConfigError(
                f"compare preset worlds: got {len(self.worlds)} ({', '.join(self.worlds)}) for "
                f"{len(self.seeds)} seeds, expected one deployment world per seed or none"
            )

    def pairs(self, default_worlds: list[str]) -> list[tuple[str, int]]:
        """The replicates: (deployment world, seed); without `worlds`, the first of `default_worlds` each time."""
        worlds = self.worlds or [default_worlds[0]] * len(self.seeds)
        return list(zip(worlds, self.seeds))


def _full_preset() -> ComparePreset:
    return ComparePreset(worlds=["cobalt", "borealis", "aurora"], tune_world="dune")


def _regime_preset() -> ComparePreset:
    return ComparePreset(
        methods=[
            "lopd",
            "lopd_frozen_composer",
            "text_experience",
            "grpo",
            "lopd_then_grpo",
            "lopd_mixed_kl",
            "sharpened_teacher",
            "lopd_random_retrieval",
        ],
        worlds=["cobalt", "borealis", "cobalt"],
        tune_world="dune",
        lr_grid=[3e-4],
        curve_points=5,
        overrides=[
            "bank.seed_tasks=64",
            "bank.samples_per_task=2",
            "eval.with_experience=false",
            "eval.splits=[test_id,test_ood]",
        ],
    )


def _decide_preset() -> ComparePreset:
    """The comparison that decides (DESIGN §3): GRPO against the LOPD family's reward-led arms, S = 5 training
    seeds per world, curves read at fixed rollout marks, the methods listed in the order they are run."""
    return ComparePreset(
        methods=[
            "grpo",
            "lopd_rl",
            "lopd_rl_silent",
            "lopd_rlsd",
            "lopd_rl_annealed",
            "lopd",
            "text_experience",
            "lopd_frozen_composer",
            "lopd_random_retrieval",
        ],
        seeds=[0, 1],
        worlds=["cobalt", "borealis"],
        train_seeds=5,
        tune_world="dune",
        lr_grid=[3e-4],
        curve_marks=[256, 512, 1024],
        overrides=[
            "bank.seed_tasks=64",
            "bank.samples_per_task=2",
            "eval.with_experience=false",
            "eval.splits=[test_id,test_ood]",
        ],
    )


def _smoke_preset() -> ComparePreset:
    return ComparePreset(
        seeds=[0],
        budget=24,
        lr_grid=[3e-4],
        tune_n=4,
        eval_n=4,
        curve_points=2,
        curve_n=4,
        train_seeds=2,
        overrides=[
            "model.base_dir=data/compare/base_smoke",
            "model.tiny.vocab_size=600",
            "model.tiny.hidden_size=32",
            "model.tiny.num_layers=1",
            "model.tiny.num_heads=2",
            "model.tiny.num_kv_heads=1",
            "model.tiny.intermediate_size=64",
            "model.warmstart.demos=120",
            "model.warmstart.drills=0",
            "model.warmstart.time_budget_s=10",
            "model.warmstart.max_steps=0",
            "model.warmstart.epochs=1.0",
            "bank.seed_tasks=4",
            "bank.samples_per_task=2",
            "coldstart.oracle_tasks=8",
            "envs.pretrain_worlds=2",
            "coldstart.steps=2",
            "coldstart.fit_steps=2",
            "coldstart.batch_size=4",
            "composer.num_queries=4",
            "composer.num_layers=1",
            "composer.num_heads=2",
            "lopd.tasks_per_step=2",
            "lopd.samples_per_task=2",
            "rollout.max_new_tokens=24",
            "rollout.max_context=640",
            "eval.with_experience=false",
        ],
    )


PRESET_HELP = {
    "full": "every method over three (deployment world, seed) replicates, tuned in a fourth world",
    "regime": "the paper-regime comparison: LOPD against GRPO, the frozen composer, the text teacher, the ways past "
    "the teacher's ceiling and both controls, at the one learning rate every method preferred in the full "
    "preset's tuning",
    "decide": "the comparison that decides: GRPO, LOPD and the reward-led arms, the text teacher, the frozen composer "
    "and a control, 5 training seeds in cobalt and in borealis, verdicts over seeds and tasks, curves at 256 / 512 / "
    "1,024 rollouts; runs in replicate, seed, method order, so a stopped comparison resumes where it stopped",
    "smoke": "every method on a tiny base, two training seeds (tests/pipeline/test_compare.py)",
}


@dataclass(frozen=True)
class CompareConfig(Section):
    """`lopd compare`: every method at one rollout budget (bank seed rollouts included)."""

    SECTION = "compare"

    preset: str = setting("full", help="a key of presets")
    presets: dict[str, ComparePreset] = setting(
        factory=lambda: {
            "full": _full_preset(),
            "regime": _regime_preset(),
            "decide": _decide_preset(),
            "smoke": _smoke_preset(),
        },
        help="the sizes of a comparison",
        key_help=PRESET_HELP,
    )
    work_dir: str = setting("data/compare", help="one folder per run")
    reuse: str = setting(
        "content",
        help="content: a run is reused only when everything it read is unchanged, its code included; identity: a "
        "run not finished under the current code takes a finished run of the same method, world, seed, learning "
        "rate, budget and evaluation size from any code version (to extend a long comparison across a refactor "
        "that changes no figure; the report lists the runs taken so)",
        check=one_of("content", "identity"),
    )
    report_dir: str = setting("reports", help="compare.md, compare.png, compare.json")
    stop_grace_s: float = setting(
        30.0,
        help="after SIGTERM or SIGINT, the seconds the running stage has to unwind before the process exits "
        "anyway; a second signal exits at once",
        check=positive(),
    )
