"""Task streams over the environment mix (`envs.mix` in params.yaml: env name -> weight).

Every consumer of training tasks — the warm start's demonstrations, the bank's seed rollouts and oracle seeds,
the distillation stream — draws through `mixed_tasks`, so one setting decides the proportions everywhere.
Counts are apportioned by largest remainder (they always sum to `n`, each within one of its exact share) and
the envs' tasks are interleaved evenly rather than concatenated: any slice of the stream (a distillation step
takes `tasks_per_step` consecutive tasks) holds the envs in close to the mix's proportions. Each env's own
tasks come from `make_tasks(env, split, count, seed)`, so they are the same tasks a single-env run draws,
extended deterministically as `n` grows.

Plugin environments (registry.py) have no pretraining worlds and no oracle, so the pretraining stream (warm
start, cold start) draws only from the mix's built-ins (`pretraining_mix`), while the deployment stream (bank,
distillation, evaluation) draws from the whole mix, plugins included.
"""

from __future__ import annotations

import warnings

from lopd_core.envs import registry
from lopd_core.envs.base import Task
from lopd_core.envs.tasks import make_tasks
from lopd_core.envs.toolworld.worlds import WorldSplit


def mix_counts(mix: dict[str, float], n: int) -> dict[str, int]:
    """How many of `n` tasks each env gets: largest-remainder apportionment of the weights (ties by name)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    names = sorted(mix)
    total = sum(mix[e] for e in names)
    if not names or total <= 0:
        raise ValueError(f"the mix needs at least one env with a positive weight, got {mix!r}")
    exact = {e: n * mix[e] / total for e in names}
    counts = {e: int(exact[e]) for e in names}
    by_remainder = sorted(names, key=lambda e: (-(exact[e] - counts[e]), e))
    for e in by_remainder[: n - sum(counts.values())]:
        counts[e] += 1
    return counts


def interleave(streams: dict[str, list]) -> list:
    """Merge the lists so each keeps its order and is spread evenly: item i of a list of length m sits at
    fraction (i + 0.5) / m of the merged list (ties by env name)."""
    keyed = [((i + 0.5) / len(items), name, i) for name, items in streams.items() for i in range(len(items))]
    return [streams[name][i] for _, name, i in sorted(keyed)]


def mixed_tasks(mix: dict[str, float], split: str, n: int, seed: int, worlds: dict | None = None) -> list[Task]:
    """`n` tasks of `split` drawn across the mix in proportion, interleaved; a single-env mix returns exactly
    `make_tasks(env, split, n, seed, worlds)`. `worlds` (name -> conventions) is toolworld's."""
    counts = mix_counts(mix, n)
    return interleave({env: make_tasks(env, split, k, seed, worlds) for env, k in counts.items() if k})


def pretraining_mix(mix: dict[str, float]) -> dict[str, float]:
    """The part of the mix that has pretraining worlds and an oracle (the built-ins), at its own weights; a mix
    of plugins only pretrains on toolworld, whose tool-call protocol a declarative tool environment shares."""
    return {e: w for e, w in mix.items() if registry.has_pretraining(e)} or {"toolworld": 1.0}


def resolve_mix(envs) -> None:
    """Resolve every environment of an `envs:` section now, before any work: each plugin of the mix (and of
    envs.task_files) imported and its class checked, every task file read line by line, a task of each split
    drawn from a class's own make_tasks. Why at the start: a typo in envs.plugins or a bad task line used to
    surface only in the bank stage, after the base was built and an MLflow run opened, as a long traceback.
    Raises ConfigError, one line naming the environment."""
    from lopd_core.config import ConfigError

    registry.use_config(envs)
    for name in dict.fromkeys([*envs.mix, *envs.task_files]):
        if registry.has_pretraining(name):
            continue  # the built-ins generate their tasks; nothing of theirs comes from configuration
        source = registry.known_envs().get(name, "unregistered")
        try:
            registry.env_class(name)
            for split in registry.env_splits(name):
                make_tasks(name, split, 1, 0)
        except (Exception, SystemExit) as exc:  # noqa: BLE001  whatever a plugin raises is its configuration's fault
            what = str(exc).strip().splitlines()[0] if str(exc).strip() else "(no message)"
            raise ConfigError(
                f"envs: environment {name!r} ({source}) cannot be used: {type(exc).__name__}: {what}"
            ) from None


def deployment_tasks(envs, split: str, n: int, seed: int) -> list[Task]:
    """Tasks of `split` in the run's deployment worlds (`pretrain_test`: in its pretraining worlds), from an
    `envs:` config section. Bank, distillation and evaluation draw here, never from the pretraining worlds.
    A held-out split comes from the envs of the mix that have it, as an evaluation plays them (`held_out_mix`)."""
    registry.use_config(envs)
    mix = envs.mix if split == "train" else held_out_mix(envs.mix, split)
    return mixed_tasks(mix, split, n, seed, WorldSplit.from_config(envs).for_split(split))


def held_out_mix(mix: dict[str, float], split: str) -> dict[str, float]:
    """The part of the mix that has `split`: a plugin without it (a task file with no val line) is left out with a
    warning naming it, and a mix none of whose envs has it is a ValueError now, before any model is loaded or
    played, rather than a plugin's error deep in a probe or a run."""
    have = {e: w for e, w in mix.items() if split in registry.env_splits(e)}
    left = sorted(set(mix) - set(have))
    if not have:
        raise ValueError(
            f"envs: no environment of the mix has {split!r} tasks ({', '.join(left)}); add {split} lines to the "
            "plugin's task file (lopd_core/envs/task_files.py) or put a built-in (toolworld, codegen) in envs.mix"
        )
    if left:
        warnings.warn(
            f"envs: {', '.join(left)} has no {split!r} tasks (a plugin has the splits its task file or make_tasks "
            f"gives); {split} is drawn from {', '.join(sorted(have))} only",
            stacklevel=3,
        )
    return have


def pretraining_tasks(envs, n: int, seed: int) -> list[Task]:
    """Training tasks of the run's pretraining worlds (the warm start's and the cold start's): built-ins only."""
    return mixed_tasks(pretraining_mix(envs.mix), "train", n, seed, WorldSplit.from_config(envs).pretrain)
