"""What each pipeline stage reads: params.yaml keys, input artifacts and the source code it runs, in one table.

Why one table: the stage's Prefect cache key (flows/stage_flows.py, tasks/caching.py) is derived from it, and
dvc.yaml's `params:` and `deps:` lists are checked against it (tests/pipeline/test_stage_params.py). Written out
by hand in three places, the copies disagreed and a changed setting silently reused a cached result. Adding a
setting a stage reads is one line here (and the same line in dvc.yaml, which the test then asks for).

A params entry is a dotted key of params.yaml; a section (`bank`) or sub-section (`model.warmstart`) stands for
every key under it. Keys in PATH_FIELDS name where things are, not what is computed: they stay out of the cache
key (the cycle hashes the content found there instead) but DVC still tracks them. Keys in REACTION_FIELDS say
how a stage reacts to what it finds (refuse, warn or fail), never what it computes: out of the key as well, as
are SCHEDULE_FIELDS (how many evaluations the cycle runs, not what one computes). The promotion gate's `cycle.*`
keys are read by no stage: the cycle applies them to the evaluate stage's outputs (flows/cycle.py).
`cycle_params` are read only by `lopd cycle` (the DVC pipeline runs one generation). `inputs` maps each input
artifact's name, as the flows hash it, to the dvc.yaml deps that are that artifact (empty where only the cycle has it).

`code` lists the source folders and files (relative to the repository root) the stage runs: its driver's module
(lopd_core/drivers/, lopd_core/drivers/distill.py) and everything that module imports, by import-graph walk
(tests/pipeline/test_stage_params.py walks it, so a new import outside the list fails a test). DVC re-runs the
stage when one changes, and the cycle's cache key holds their content hash: one list, two consumers. Modules in
UNSHAPING_CODE are imported by every stage but never change what one computes (configuration types, whose
values enter the key as params; error classes; offline defaults; file-writing and locking guards): left out, so
a new error message does not re-run a day of training.

A stage that reads all of `envs` draws deployment tasks, so it plays the mix's plugin environments: it reads their
task files and runs their packages' code, files whose paths come from params and package metadata. The cycle hashes
them into the key itself (`tasks.caching.plugin_fingerprint`); DVC cannot list such paths as deps, so its `plugins`
stage (always run, cheap) writes the same hashes to PLUGIN_FINGERPRINT, which those stages depend on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lopd_core.distill.loop.resume import RESUME_SETTINGS

# Where things are (or run), not what is computed: a plugin's tools give the same results in a sandboxed child.
PATH_FIELDS = frozenset(
    {
        "model.name_or_path",
        "model.base_dir",
        "model.device",
        "bank.dir",
        "bank.index_dir",
        "bank.chroma_url",
        "coldstart.out",
        "coldstart.fit_out",
        "lopd.out_dir",
        "lopd.csv",
        "eval.out",
        "envs.isolate_tools",
    }
)
# How a stage reacts to a checkpoint made under other settings, or to a plugin step that outlives its timeout (it
# fails): the outputs of a run that goes on are the same.
REACTION_FIELDS = frozenset({"lopd.resume_mismatch", "lopd.max_skipped_share", "envs.step_timeout_s"})
# How many batches the cycle's sequential gate may play (lopd_core/gate.py), never what one evaluation computes: a
# batch is `eval.batch`, which is keyed.
SCHEDULE_FIELDS = frozenset({"eval.sequential", "eval.max_n"})
PLUGIN_FINGERPRINT = "data/plugins.json"  # `lopd envs fingerprint`: the plugin files' hashes (module docstring)
UNKEYED_FIELDS = PATH_FIELDS | REACTION_FIELDS | SCHEDULE_FIELDS


UNSHAPING_CODE = frozenset(
    {
        "lopd_core/__init__.py",
        "lopd_core/config.py",
        "lopd_core/settings",
        "lopd_core/names.py",
        "lopd_core/errors.py",
        "lopd_core/offline.py",
        "lopd_core/outputs.py",
        "lopd_core/jsonio.py",
        "lopd_core/locks.py",
        "lopd_core/drivers/__init__.py",
    }
)


@dataclass(frozen=True)
class StageReads:
    params: tuple[str, ...]
    inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cycle_params: tuple[str, ...] = ()
    code: tuple[str, ...] = ()


_POLICY = "model.name_or_path", "model.dtype", "model.threads"  # which policy, loaded how (its content is an input)
# The warm start and the cold start play only the pretraining worlds: a new deployment world reuses both.
_PRETRAIN_ENVS = "envs.mix", "envs.pretrain_worlds", "envs.world_seed"
# Source every stage that plays environments with a policy runs: the environments (a reward check), the model
# (loading, chat template), the experience texts.
_PLAY = "lopd_core/envs", "lopd_core/model", "lopd_core/experience.py"
_ROLLOUT = *_PLAY, "lopd_core/rollout"
# What training the composer through the frozen base runs: the cold start's step (the fit's too) and what it reads.
_COMPOSER_CODE = (
    "lopd_core/distill/__init__.py",
    "lopd_core/distill/composer/__init__.py",
    "lopd_core/distill/composer/coldstart.py",
    "lopd_core/distill/composer/coldstart_data.py",
    "lopd_core/distill/composer/composer.py",
    "lopd_core/distill/composer/encoder_lora.py",
    "lopd_core/distill/composer/lru.py",
    "lopd_core/distill/composer/reading.py",
    "lopd_core/distill/scoring/__init__.py",
    "lopd_core/distill/scoring/losses.py",
    "lopd_core/distill/scoring/models.py",
    "lopd_core/distill/scoring/teacher.py",
    "lopd_core/distributed.py",
    "lopd_core/sharding.py",
    "lopd_core/bank",
    *_ROLLOUT,
)
# The cold start's own keys (φ0) and the in-world fit's (coldstart.fit_*): one section, two stages.
_COLDSTART = tuple(
    f"coldstart.{k}" for k in ("steps", "batch_size", "lr", "kl_weight", "oracle_tasks", "max_experiences", "out")
)
_RETRIEVAL = "bank.top_j", "bank.same_world", "bank.ef_search"
_FIT = tuple(
    f"coldstart.{k}" for k in ("fit_steps", "fit_batch_size", "fit_lr", "online_rollouts", "max_experiences", "fit_out")
)

STAGES: dict[str, StageReads] = {
    # model.base_source: the shipped base (lopd_core/model/embedded_base, part of lopd_core/model's code) or a build
    "base": StageReads(
        ("seed", "model.base_source", "model.tiny", "model.warmstart", "model.threads", *_PRETRAIN_ENVS),
        code=("lopd_core/drivers/base.py", *_PLAY),
    ),
    # `traces`: the served traces at lopd.traces when lopd.bank_source (lopd.trajectories for distill) names them,
    # keyed by content; an optional path, so the cycle hashes it and DVC lists only the key (`lopd.traces`). The
    # path stays in the key too: a distill checkpoint records it (a resume must read the same trace stream).
    "bank": StageReads(
        ("seed", *_POLICY, "bank", "rollout", "envs", "lopd.bank_source", "lopd.traces"),
        {"policy": ("data/base",), "parent_bank": (), "traces": ()},
        code=("lopd_core/drivers/bank.py", "lopd_core/bank", "lopd_core/traces", *_ROLLOUT),
    ),
    # The cold start reads oracle episodes of the pretraining worlds, never the deployment bank.
    "coldstart": StageReads(
        ("seed", *_POLICY, "composer", *_COLDSTART, *_PRETRAIN_ENVS, "bank.top_j", "bank.ef_search", "bank.min_reward"),
        {"policy": ("data/base",)},
        code=("lopd_core/drivers/coldstart.py", *_COMPOSER_CODE),
    ),
    # φ fitted in the deployment world: the teacher's weights read the bank's rows (its seed rollouts the targets)
    # with the composer it starts from; `rollout` and `envs` shape the text teacher's fresh rollouts.
    "fit": StageReads(
        ("seed", *_POLICY, "composer", *_FIT, "bank.top_j", "bank.same_world", "bank.ef_search", "rollout", "envs"),
        {"teacher": ("data/base",), "bank": ("data/bank",), "start": ("data/composer",)},
        code=(
            "lopd_core/drivers/fit.py",
            "lopd_core/drivers/bank.py",
            "lopd_core/drivers/coldstart.py",
            "lopd_core/distill/composer/world_fit.py",
            "lopd_core/traces",
            *_COMPOSER_CODE,
        ),
    ),
    # The teacher in play: the frozen weights alone, reading the bank as text and as φ's latents, on held-out tasks.
    "teacher": StageReads(
        ("seed", *_POLICY, "eval", "rollout", "envs", "composer", "coldstart.fit_steps", *_RETRIEVAL),
        {"teacher": ("data/base",), "bank": ("data/bank",), "phi": ("data/composer", "data/composer_fit")},
        code=(
            "lopd_core/drivers/teacher.py",
            "lopd_core/drivers/bank.py",
            "lopd_core/drivers/coldstart.py",
            "lopd_core/drivers/distill.py",
            "lopd_core/distill",
            "lopd_core/evaluation.py",
            "lopd_core/outcomes.py",
            "lopd_core/export.py",
            "lopd_core/bench",
            "lopd_core/methods.py",
            "lopd_core/distributed.py",
            "lopd_core/sharding.py",
            "lopd_core/bank",
            "lopd_core/traces",
            *_ROLLOUT,
        ),
    ),
    # What shapes a distillation's numbers is what its checkpoint must agree with to be resumed: one list.
    "distill": StageReads(
        ("model.name_or_path", *RESUME_SETTINGS),
        # phi0: the composer it starts from, the fitted φ (coldstart.fit_out) unless coldstart.fit_steps is 0
        {
            "policy": ("data/base",),
            "teacher": (),
            "bank": ("data/bank",),
            "phi0": ("data/composer", "data/composer_fit"),
            "traces": (),
        },
        cycle_params=("cycle.refresh_teacher",),
        # the bank's and the cold start's drivers: open_bank, and the re-exported names
        code=(
            "lopd_core/drivers/distill.py",
            "lopd_core/distill",
            "lopd_core/methods.py",
            "lopd_core/drivers/bank.py",
            "lopd_core/drivers/coldstart.py",
            "lopd_core/distributed.py",
            "lopd_core/sharding.py",
            "lopd_core/bank",
            "lopd_core/traces",
            *_ROLLOUT,
        ),
    ),
    "evaluate": StageReads(
        ("seed", *_POLICY, "eval", "bench", "rollout", "envs"),
        {"model": ("data/base", "data/lopd")},
        # export.py: eval_rows, the eval.json cells (summary_table)
        code=(
            "lopd_core/drivers/evaluate.py",
            "lopd_core/evaluation.py",
            "lopd_core/outcomes.py",
            "lopd_core/export.py",
            "lopd_core/bench",
            *_ROLLOUT,
        ),
    ),
    "export": StageReads(
        ("rollout.max_new_tokens", "rollout.temperature", "rollout.top_p", "tracking.registered_model"),
        {"student": ("data/lopd",), "student_eval": ("metrics/eval.json",), "base_eval": ("metrics/eval_base.json",)},
        code=("lopd_core/drivers/export.py", "lopd_core/export.py"),
    ),
    "report": StageReads(
        ("lopd.margin", "lopd.method", "baselines"),
        {
            "curves": ("plots/distill.csv",),
            "student_eval": ("metrics/eval.json",),
            "base_eval": ("metrics/eval_base.json",),
        },
        code=("lopd_core/drivers/report.py", "lopd_core/run_report.py", "lopd_core/export.py"),
    ),
    # DVC only: writes PLUGIN_FINGERPRINT (the cycle hashes the same files into each stage's key itself).
    "plugins": StageReads(("envs.mix", "envs.plugins", "envs.task_files")),
}


def _lookup(tree: dict, dotted: str) -> Any:
    node = tree
    for part in dotted.split("."):
        node = node[part]
    return node


def without_paths(value: Any, dotted: str) -> Any:
    """`value` (the plain value at key `dotted`) with the unkeyed fields (paths, reactions) under it removed."""
    if not isinstance(value, dict):
        return value
    return {k: without_paths(v, f"{dotted}.{k}") for k, v in value.items() if f"{dotted}.{k}" not in UNKEYED_FIELDS}


def stage_sections(params, stage: str) -> dict[str, Any]:
    """The params part of `stage`'s cache key: each key the table lists, unkeyed fields left out."""
    reads = STAGES[stage]
    tree = dataclasses.asdict(params)
    return {
        dotted: without_paths(_lookup(tree, dotted), dotted)
        for dotted in (*reads.params, *reads.cycle_params)
        if dotted not in UNKEYED_FIELDS
    }


def dvc_params(stage: str) -> list[str]:
    """What dvc.yaml's `params:` of `stage` must list."""
    return list(STAGES[stage].params)


def reads_plugins(stage: str) -> bool:
    """Whether `stage` plays the mix's plugin environments (it draws deployment tasks: it reads `envs` whole)."""
    return "envs" in STAGES[stage].params


# What a `lopd compare` run executes: the distill stage's driver, then the evaluate stage's, through its own module.
COMPARE_CODE = tuple(
    sorted(
        {*STAGES["distill"].code, *STAGES["evaluate"].code, "lopd_core/compare/__init__.py", "lopd_core/compare/run.py"}
    )
)


def dvc_code_deps(stage: str) -> list[str]:
    """The code deps dvc.yaml's `deps:` of `stage` must list: the table's `code`."""
    return sorted(STAGES[stage].code)


def dvc_data_deps(stage: str) -> list[str]:
    """The artifact deps (not code) dvc.yaml's `deps:` of `stage` must list."""
    deps = {path for paths in STAGES[stage].inputs.values() for path in paths}
    return sorted(deps | ({PLUGIN_FINGERPRINT} if reads_plugins(stage) else set()))
