"""Settings of the environments (`envs`), and the installed environment plugins their names resolve against.

The plugin lookups read package metadata only: nothing is imported until an environment is used.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from lopd_core.names import BUILTIN_ENVS, ENV_ENTRY_POINT_GROUP
from lopd_core.settings.checks import Check, ConfigError, in_range, positive, positive_weights, subset_of
from lopd_core.settings.fields import Section, setting

# The named worlds of toolworld (lopd_core/envs/toolworld/worlds.py WORLDS), the deployment candidates; kept here as
# plain data so the config imports nothing of the library (a test checks the two agree).
NAMED_WORLDS = ("aurora", "borealis", "cobalt", "dune")


def installed_env_plugins() -> dict[str, str]:
    """Environments installed packages register (entry points of group `lopd.envs`): name -> `module:Class`."""
    return {name: value for name, value, _ in _installed_env_plugins()}


def installed_env_conflicts() -> dict[str, list[str]]:
    """Names that two or more installed packages register with different classes: name -> ["package (module:Class)",
    ...]. Such a name resolves to none of them (which one the metadata lists last is an accident of the install):
    `envs.plugins.NAME` picks one."""
    seen: dict[str, dict[str, str]] = {}
    for name, value, dist in _installed_env_plugins():
        seen.setdefault(name, {})[value] = dist
    return {
        name: [f"{dist} ({value})" for value, dist in sorted(by_value.items())]
        for name, by_value in seen.items()
        if len(by_value) > 1
    }


def env_conflict_message(name: str, where: str) -> str:
    both = " and ".join(installed_env_conflicts()[name])
    return (
        f"{where}: environment {name!r} is registered by more than one installed package: {both}; uninstall "
        f"one, or pick one with --set 'envs.plugins={{{name}: \"module:Class\"}}'"
    )


@functools.lru_cache(maxsize=1)
def _installed_env_plugins() -> tuple[tuple[str, str, str], ...]:
    # Read once a process: the environment registry resolves a plugin's name for every episode the rollout engine
    # plays, and scanning package metadata is not free.
    from importlib.metadata import entry_points

    def package(ep) -> str:
        dist = getattr(ep, "dist", None)
        return getattr(dist, "name", None) or "an unnamed package"

    return tuple((ep.name, ep.value, package(ep)) for ep in entry_points(group=ENV_ENTRY_POINT_GROUP))


_PLUGIN_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(frozen=True)
class EnvsConfig(Section):
    """Adaptation to a new environment: the warm start and the composer's cold start see only generated
    pretraining worlds; bank, distillation, evaluation and the cycle run in the deployment worlds, held out from
    both (lopd_core/envs/toolworld/worlds.py)."""

    SECTION = "envs"

    mix: dict[str, float] = setting(
        factory=lambda: {"toolworld": 1.0},
        check=positive_weights(),
        help="environment -> weight, for training and evaluation: a built-in (toolworld, codegen), a key of "
        "plugins, or an environment an installed package registers (entry point group lopd.envs)",
    )
    pretrain_worlds: int = setting(64, help="generated worlds the warm start and the cold start see", check=positive())
    deploy_worlds: list[str] = setting(
        factory=lambda: ["cobalt"],
        check=subset_of(*NAMED_WORLDS),
        help="held-out named worlds where bank, distillation, evaluation and the cycle run (aurora and dune agree "
        "with what the pretraining worlds most often do, so the base half-knows them without experience)",
    )
    world_seed: int = setting(0, help="which pretraining worlds are generated")
    plugins: dict[str, str] = setting(
        factory=dict,
        check=Check(lambda v: all(_PLUGIN_SPEC.match(s) for s in v.values()), 'a mapping of names to "module:Class"'),
        help='your own environments by import path, name -> "module:Class" (lopd_core/envs/registry.py); the name '
        "must equal the class's `name`",
    )
    task_files: dict[str, str] = setting(
        factory=dict,
        help="a plugin environment's tasks from a JSON Lines file instead of its make_tasks, "
        "name -> path (lopd_core/envs/task_files.py gives the format)",
    )
    isolate_tools: bool = setting(
        False,
        help="false: plugin tools are trusted code run in the trainer's process (your files, environment "
        "variables and network in reach); true: each episode's reset and step run in a sandboxed child process (no "
        "network, a scrubbed environment, a private folder, rlimits; lopd_core/envs/guarded.py)",
    )
    step_timeout_s: float = setting(
        30.0,
        check=in_range(0.0, 86400.0, open_low=True),
        help="the longest one reset or step of a plugin environment may take, isolated or not: past it the episode "
        "fails naming the env and the task, instead of hanging a stage",
    )

    def check(self) -> None:
        """The names across keys: the mix's must be known, plugins must not shadow built-ins, task files must
        belong to a plugin environment and exist."""
        clash = sorted(set(self.plugins) & set(BUILTIN_ENVS))
        if clash:
            raise ConfigError(
                f"envs.plugins.{clash[0]}: got {self.plugins[clash[0]]!r}, expected a name that is not "
                f"a built-in environment ({', '.join(BUILTIN_ENVS)})"
            )
        plugin_names = set(self.plugins) | set(installed_env_plugins())
        known = sorted(BUILTIN_ENVS) + sorted(plugin_names)
        unknown = sorted(set(self.mix) - set(known))
        if unknown:
            raise ConfigError(
                f"envs.mix: got {unknown[0]!r}, expected one of the known environments: "
                f"{', '.join(known)} (built-ins, envs.plugins, and entry points of group "
                f"{ENV_ENTRY_POINT_GROUP!r})"
            )
        conflicts = installed_env_conflicts()
        for name in sorted((set(self.mix) | set(self.task_files)) & set(conflicts) - set(self.plugins)):
            raise ConfigError(env_conflict_message(name, "envs.mix" if name in self.mix else f"envs.task_files.{name}"))
        for name, path in self.task_files.items():
            if name not in plugin_names:
                raise ConfigError(
                    f"envs.task_files.{name}: got {path!r}, expected a plugin environment's name "
                    f"(known plugins: {', '.join(sorted(plugin_names)) or 'none'}); built-ins "
                    "generate their own tasks"
                )
            if not Path(path).is_file():
                raise ConfigError(f"envs.task_files.{name}: got {path!r}, expected an existing JSON Lines file")
