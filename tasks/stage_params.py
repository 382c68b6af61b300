"""What each pipeline stage reads: params.yaml keys and input artifacts, in one table.

Why one table: the stage's Prefect cache key (flows/stages.py) is derived from it, and dvc.yaml's `params:`
and data `deps:` lists are checked against it (tests/pipeline/test_stage_params.py). Written out by hand in three places,
the copies disagreed and a changed setting silently reused a cached result. Adding a setting a stage reads is
one line here (and the same line in dvc.yaml, which the test then asks for).

A params entry is a dotted key of params.yaml; a section (`bank`) or sub-section (`model.warmstart`) stands for
every key under it. Keys in PATH_FIELDS name where things are, not what is computed: they stay out of the cache
key (the cycle hashes the content found there instead) but DVC still tracks them. Keys in REACTION_FIELDS say
how a stage reacts to what it finds (refuse, warn or fail), never what it computes: out of the key as well.
`cycle_params` are read only by `lopd cycle` (the DVC pipeline runs one generation). `inputs` maps each input artifact's name, as the
flows hash it, to the dvc.yaml deps that are that artifact (empty where only the cycle has it).

A stage that reads all of `envs` draws deployment tasks, so it plays the mix's plugin environments: it reads their
task files and runs their packages' code, files whose paths come from params and package metadata. The cycle hashes
them into the key itself (`tasks.caching.plugin_fingerprint`); DVC cannot list such paths as deps, so its `plugins`
stage (always run, cheap) writes the same hashes to PLUGIN_FINGERPRINT, which those stages depend on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Where things are (or run), not what is computed: a plugin's tools give the same results in a sandboxed child.
PATH_FIELDS = frozenset({"model.name_or_path", "model.base_dir", "model.device", "bank.dir", "bank.index_dir",
                         "bank.chroma_url", "coldstart.out", "lopd.out_dir", "lopd.csv", "eval.out",
                         "envs.isolate_tools"})
# How a stage reacts to a checkpoint made under other settings, or to a plugin step that outlives its timeout (it
# fails): the outputs of a run that goes on are the same.
REACTION_FIELDS = frozenset({"lopd.resume_mismatch", "lopd.max_skipped_share", "envs.step_timeout_s"})
PLUGIN_FINGERPRINT = "data/plugins.json"  # `lopd envs fingerprint`: the plugin files' hashes (module docstring)
UNKEYED_FIELDS = PATH_FIELDS | REACTION_FIELDS


@dataclass(frozen=True)
class StageReads:
    params: tuple[str, ...]
    inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cycle_params: tuple[str, ...] = ()


_POLICY = "model.name_or_path", "model.dtype"  # which policy, loaded how (its content is an input)
# The warm start and the cold start play only the pretraining worlds: a new deployment world reuses both.
_PRETRAIN_ENVS = "envs.mix", "envs.pretrain_worlds", "envs.world_seed"

STAGES: dict[str, StageReads] = {
    "base": StageReads(("seed", "model.tiny", "model.warmstart", *_PRETRAIN_ENVS)),
    "bank": StageReads(("seed", *_POLICY, "bank", "rollout", "envs"),
                       {"policy": ("data/base",), "parent_bank": ()}),
    # The cold start reads oracle episodes of the pretraining worlds, never the deployment bank.
    "coldstart": StageReads(("seed", *_POLICY, "composer", "coldstart", *_PRETRAIN_ENVS, "bank.top_j", "bank.ef_search",
                             "bank.min_reward"),
                            {"policy": ("data/base",)}),
    "distill": StageReads(("seed", *_POLICY, "lopd", "baselines", "rollout", "composer", "envs", "bank.top_j",
                           "bank.allow_self_retrieval", "bank.same_world", "bank.ef_search", "bank.refresh_every",
                           "bank.min_reward"),
                          {"policy": ("data/base",), "teacher": (), "bank": ("data/bank",),
                           "phi0": ("data/composer",)},
                          cycle_params=("cycle.refresh_teacher",)),
    "evaluate": StageReads(("seed", *_POLICY, "eval", "bench", "rollout", "envs"),
                           {"model": ("data/base", "data/lopd")}),
    "export": StageReads(("rollout.max_new_tokens", "rollout.temperature", "rollout.top_p",
                          "tracking.registered_model"),
                         {"student": ("data/lopd",), "student_eval": ("metrics/eval.json",),
                          "base_eval": ("metrics/eval_base.json",)}),
    "report": StageReads(("lopd.margin", "lopd.method", "baselines"),
                         {"curves": ("plots/distill.csv",), "student_eval": ("metrics/eval.json",),
                          "base_eval": ("metrics/eval_base.json",)}),
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
    return {dotted: without_paths(_lookup(tree, dotted), dotted)
            for dotted in (*reads.params, *reads.cycle_params) if dotted not in UNKEYED_FIELDS}


def dvc_params(stage: str) -> list[str]:
    """What dvc.yaml's `params:` of `stage` must list."""
    return list(STAGES[stage].params)


def reads_plugins(stage: str) -> bool:
    """Whether `stage` plays the mix's plugin environments (it draws deployment tasks: it reads `envs` whole)."""
    return "envs" in STAGES[stage].params


def dvc_data_deps(stage: str) -> list[str]:
    """The artifact deps (not code) dvc.yaml's `deps:` of `stage` must list."""
    deps = {path for paths in STAGES[stage].inputs.values() for path in paths}
    return sorted(deps | ({PLUGIN_FINGERPRINT} if reads_plugins(stage) else set()))
