"""Settings around a training run: evaluation (`eval`), MLflow (`tracking`), continual cycles and their promotion
gate (`cycle`), the tool-use benchmarks (`bench`)."""

from __future__ import annotations

from dataclasses import dataclass

from lopd_core.names import ACEBENCH_CATEGORIES, ACEBENCH_GROUPS, BFCL_CATEGORIES
from lopd_core.settings.checks import (
    Check,
    ConfigError,
    any_of,
    fraction,
    in_range,
    non_negative,
    one_of,
    positive,
    subset_of,
)
from lopd_core.settings.fields import Section, setting

SPLIT_NAMES = ("train", "val", "test_id", "test_ood", "pretrain_test", "test_final")  # envs/base.py SPLITS
# Read by no decision and no design choice, reported only (lopd_core/envs/held_out.py): no gate split, guard or
# option choice may name it.
FINAL_SPLIT = "test_final"


@dataclass(frozen=True)
class EvalConfig(Section):
    """Held-out evaluation -> metrics/eval.json, greedy and sampled."""

    SECTION = "eval"

    n_per_split: int = setting(
        200, help="tasks per split (200: a success rate's 95 % interval is about ±6 points)", check=positive()
    )
    splits: list[str] = setting(
        factory=lambda: ["test_id", "test_ood", "pretrain_test", "test_final"],
        check=subset_of(*SPLIT_NAMES),
        help="test_id and test_ood in the deployment worlds; pretrain_test: held-out tasks of the pretraining "
        "worlds (what adaptation forgets); test_final: test_id's distribution, disjoint from it, read by no "
        "decision (reported only); val: held-out training tasks for design choices (lopd_core/envs/held_out.py)",
    )
    modes: list[str] = setting(
        factory=lambda: ["greedy", "sampled"],
        check=subset_of("greedy", "sampled"),
        help="decoding modes: greedy | sampled",
    )
    temperature: float = setting(1.0, help="the sampled mode's temperature", check=positive())
    with_experience: bool = setting(
        False,
        help="also report success with 1..num_experiences same-world oracle "
        "successes as text in the first user turn, under <split>+experience (a probe of the base; what the cycle's "
        "own teacher reads is the teacher in play)",
    )
    num_experiences: int = setting(
        3, help="same-world successes in context for the +experience splits", check=positive()
    )
    out: str = setting("metrics/eval.json", help="the metrics file")
    teacher_splits: list[str] = setting(
        factory=lambda: ["test_id"],
        check=any_of(*(s for s in SPLIT_NAMES if s != FINAL_SPLIT)),
        help="splits (of splits) the teacher in play is played on: the frozen base alone, reading its bank rows as "
        "text and as the composer's latents (`lopd evaluate --teacher-in-play`, every cycle); []: none",
    )
    benchmarks: list[str] = setting(
        factory=list,
        check=any_of("bfcl", "acebench", "humaneval"),
        help="external benchmarks also run: bfcl, acebench, humaneval (settings under "
        "bench); scores under their own names in out",
    )
    batch: int = setting(
        0,
        help="which batch of fresh held-out tasks: batch k plays instances [k·n_per_split, (k+1)·n_per_split) of each "
        "split's seeded stream (0: the report's; `lopd cycle`'s gate plays batches >= 1, fresh ones each cycle)",
        check=non_negative(),
    )
    sequential: bool = setting(
        False,
        help="`lopd cycle`: when the gate's interval straddles the threshold, play another n_per_split fresh tasks "
        "per split, up to max_n, each look at a Bonferroni-adjusted level (lopd_core/gate.py)",
    )
    max_n: int = setting(
        400,
        help="with sequential: tasks per split at most (looks = max_n // n_per_split)",
        check=positive(),
    )

    def check(self) -> None:
        if self.sequential and self.max_n < self.n_per_split:
            raise ConfigError(
                f"eval.max_n: got {self.max_n}, expected at least eval.n_per_split ({self.n_per_split}) "
                "with eval.sequential"
            )


@dataclass(frozen=True)
class TrackingConfig(Section):
    """MLflow lineage of `lopd cycle` (the environment variable MLFLOW_TRACKING_URI overrides mlflow_uri)."""

    SECTION = "tracking"

    mlflow_uri: str = setting("sqlite:///mlflow.db", help="the MLflow tracking store")
    experiment: str = setting("lopd", help="the MLflow experiment")
    registered_model: str = setting("lopd-student", help="every exported student becomes a version of this model")
    champion_alias: str = setting("champion", help="moves to a version only when the promotion gate passes")


@dataclass(frozen=True)
class CycleConfig(Section):
    """`lopd cycle`: continual self-improvement from the last promoted student, and the promotion gate.

    The gate (lopd_core/gate.py): champion and student play the same held-out tasks with the same seeds; with
    `gate_test: paired` the student is promoted only when an exact one-sided sign-flip test on the paired
    differences of `gate_metric` (under `gate_mode`, averaged over `gate_splits`; McNemar's exact test for success
    at a zero min gain) shows a gain above `min_gain` at (1 − `confidence`) / 2 = 2.5 %, and no guard fails: since
    the root (the first base) a guard must show a fall within `guard_budget`, since the champion it must not show
    one beyond `guard_max_fall`. `point` is the earlier rule: the two averages, `min_gain` apart.
    """

    SECTION = "cycle"

    dir: str = setting(
        "data/cycles", help="per-cycle work (content-addressed), champion.json, history.json, task cache"
    )
    refresh_teacher: bool = setting(
        True,
        help="the teacher of each cycle is the champion the student starts from (false: the first base, every cycle)",
    )
    gate_metric: str = setting(
        "reward_mean",
        help="success_rate | reward_mean (a weak base rarely succeeds: reward moves first)",
        check=one_of("success_rate", "reward_mean"),
    )
    gate_splits: list[str] = setting(
        factory=lambda: ["test_id", "test_ood"],
        check=subset_of("test_id", "test_ood"),
        help="held-out splits the gate averages, judged without experience in context",
    )
    gate_mode: str = setting("greedy", help="greedy | sampled", check=one_of("greedy", "sampled"))
    gate_test: str = setting(
        "paired",
        help="paired: promote when the exact paired test shows a gain above min_gain and no guard fails | point: "
        "when the student's average exceeds the champion's by min_gain (no test, no guards)",
        check=one_of("paired", "point"),
    )
    min_gain: float = setting(
        0.02,
        help="the gain to clear, in the metric's units (0.02: 2 points): the paired test must show a gain above it, "
        "or the point rule's difference exceed it (at the default n = 400 paired tasks a true gain of 10 points is "
        "promoted 90 % of the time; lopd_core/gate.py)",
        check=in_range(-1.0, 1.0),
    )
    confidence: float = setting(
        0.95,
        help="the tests are one-sided at (1 − confidence) / 2 (2.5 %: the old interval's lower bound); the shown "
        "intervals are two-sided at confidence",
        check=in_range(0.5, 0.999),
    )
    guards: list[str] = setting(
        factory=lambda: ["pretrain_test", "per_env", "gate_success"],
        check=Check(
            lambda v: all(
                g in ("per_env", "gate_success") or g.split(":")[-1] in set(SPLIT_NAMES) - {FINAL_SPLIT} for g in v
            ),
            "a list of split names (every env of the mix on it; not test_final, which no decision reads), env:split, "
            "per_env or gate_success",
        ),
        help="metrics that must not fall (paired gate): a split (pretrain_test: forgetting) in every env of the "
        "mix, env:split for one, per_env: each env of a mix on the gate's splits alone, gate_success: success on "
        "the gate's splits when gate_metric is reward_mean; []: none",
    )
    guard_metric: str = setting(
        "success_rate",
        help="the guards' metric: success_rate | reward_mean",
        check=one_of("success_rate", "reward_mean"),
    )
    guard_max_fall: float = setting(
        0.1,
        help="since the champion: a guard fails when the exact test shows a fall beyond this bound in one cycle "
        "(0.1: 10 points; adapting to a new world costs some of the old ones, and a team says how much it accepts)",
        check=fraction(),
    )
    guard_budget: float = setting(
        0.1,
        help="since the lineage's root (the first base): a guard fails unless the exact test shows the total fall "
        "is smaller than this budget (non-inferiority: forgetting adds up over cycles)",
        check=fraction(),
    )
    stage_timeout_s: float = setting(21600.0, help="per long task (base, bank, ...)", check=positive())
    stop_grace_s: float = setting(
        30.0,
        help="after SIGTERM or SIGINT, the seconds the running stage has to unwind (MLflow run KILLED, flow run "
        "Cancelled, lock released) before the process exits anyway; a second signal exits at once",
        check=positive(),
    )
    report_dir: str = setting("reports/cycles", help="`lopd cycle`'s report (the DVC pipeline's: reports/run)")


@dataclass(frozen=True)
class BenchConfig(Section):
    """Tool-use benchmarks (`lopd bench score|run bfcl|acebench`, and `eval.benchmarks`).

    Data folders are settings. An empty bfcl_dir means the data inside the bfcl-eval package (installed with
    `pip install --no-deps bfcl-eval==2026.3.23`); ACEBench has no package, so acebench_dir must point at a copy
    of its data_all/ folder (or its parent).
    """

    SECTION = "bench"

    bfcl_dir: str = setting("", help="empty: the data of the installed bfcl-eval package (pip install --no-deps)")
    bfcl_categories: list[str] = setting(
        factory=lambda: [
            "simple",
            "multiple",
            "parallel",
            "parallel_multiple",
            "irrelevance",
            "live_simple",
            "live_multiple",
            "live_parallel",
            "live_parallel_multiple",
            "live_irrelevance",
            "multi_turn_base",
        ],
        check=subset_of(*BFCL_CATEGORIES),
        help="BFCL categories run",
    )
    acebench_dir: str = setting("", help="a copy of ACEBench's data_all/ (holding data_en/, data_zh/)")
    acebench_categories: list[str] = setting(
        factory=lambda: ["normal", "special"],
        check=subset_of(*ACEBENCH_GROUPS, *ACEBENCH_CATEGORIES),
        help="groups or single categories (agent is not supported)",
    )
    acebench_languages: list[str] = setting(factory=lambda: ["en", "zh"], check=subset_of("en", "zh"), help="en | zh")
    limit: int = setting(0, help="test cases per category in a run (0: all)", check=non_negative())
    max_new_tokens: int = setting(256, help="tokens per model answer", check=positive())
    batch_size: int = setting(8, help="answers generated together", check=positive())
    max_steps_per_turn: int = setting(5, help="BFCL multi-turn: model answers per user turn", check=positive())
