"""One typed configuration for a run: `params.yaml` -> nested frozen dataclasses, validated as they are built.

Why this shape: every command reads the configuration once at the edge (`load_params`) and passes typed
sections down; library functions take explicit arguments. A wrong key or value fails here, naming the key, the
value and what was expected, instead of deep inside a training step much later. The sections, with each
setting's default, help and check, live in lopd_core/settings/; this module reads the file, applies overrides and
re-exports every name callers import from `lopd_core.config`.

Overrides use the same dotted names as the file: `--set rollout.temperature=0.7` (the value is parsed as YAML,
so `true`, `3`, `[a, b]` keep their types).

    python -m lopd_core.config --write-params [PATH]   rewrite params.yaml from the definitions
    python -m lopd_core.config --list                  every setting, its default and its help
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from yaml.constructor import ConstructorError

from lopd_core.settings.checks import MARGIN_AUTO, ConfigError
from lopd_core.settings.compare import CompareConfig, ComparePreset
from lopd_core.settings.envs import (
    NAMED_WORLDS,
    EnvsConfig,
    _installed_env_plugins,
    env_conflict_message,
    installed_env_conflicts,
    installed_env_plugins,
)
from lopd_core.settings.fields import build
from lopd_core.settings.lopd import (
    FORWARD_KL_METHODS,
    KL_MIX_METHODS,
    POLICY_GRADIENT_METHODS,
    SAMPLED_KL_METHODS,
    BaselinesConfig,
    LopdConfig,
)
from lopd_core.settings.model import ModelConfig, TinyModelConfig, WarmStartConfig
from lopd_core.settings.params import Params
from lopd_core.settings.render import params_yaml, settings_listing
from lopd_core.settings.rollout import (
    BankConfig,
    ColdStartConfig,
    ComposerConfig,
    RetrievalSettings,
    RolloutConfig,
)
from lopd_core.settings.run import BenchConfig, CycleConfig, EvalConfig, TrackingConfig
from lopd_core.settings.serve import ServeConfig

__all__ = [
    "DEFAULT_PARAMS",
    "FORWARD_KL_METHODS",
    "KL_MIX_METHODS",
    "MARGIN_AUTO",
    "NAMED_WORLDS",
    "POLICY_GRADIENT_METHODS",
    "SAMPLED_KL_METHODS",
    "BankConfig",
    "BaselinesConfig",
    "BenchConfig",
    "ColdStartConfig",
    "CompareConfig",
    "ComparePreset",
    "ComposerConfig",
    "ConfigError",
    "CycleConfig",
    "EnvsConfig",
    "EvalConfig",
    "LopdConfig",
    "ModelConfig",
    "Params",
    "RetrievalSettings",
    "RolloutConfig",
    "ServeConfig",
    "TinyModelConfig",
    "TrackingConfig",
    "WarmStartConfig",
    "_installed_env_plugins",
    "apply_override",
    "env_conflict_message",
    "installed_env_conflicts",
    "installed_env_plugins",
    "load_params",
    "params_yaml",
    "read_params_file",
    "settings_listing",
]


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `section.key=value` to the raw mapping in place (value parsed as YAML)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected section.key=value")
    dotted, text = assignment.split("=", 1)
    if "\n" in text or "\r" in text:  # YAML folds a line break in a plain value into a space: said, not done
        raise ConfigError(
            f"{dotted.strip()}: the --set value {text!r} holds a line break, which YAML would turn "
            "into a space; give a one-line value, or write it in the params file"
        )
    parts = dotted.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {assignment!r}: expected section.key=value")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part!r} is not a section (value {child!r})")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{dotted}: value {text!r} is not valid YAML ({exc})") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: plain YAML keeps the last one, so a
    setting written twice (a copied section, a merge gone wrong) silently loses one of its values."""

    def construct_mapping(self, node, deep=False):
        first_line: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` supplies defaults; explicit keys override them by design
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first_line.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it with its position
            line = key_node.start_mark.line + 1
            if seen is not None:
                raise ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first given on line {seen}), a mapping holds each key once",
                    key_node.start_mark,
                )
            first_line[key] = line
        return super().construct_mapping(node, deep)


def _yaml_error(path: Path, exc: yaml.YAMLError) -> ConfigError:
    """One line: file:line:column and what is wrong, without PyYAML's multi-line context."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    what = f"{problem} ({context})" if context else problem
    return ConfigError(f"{where}: not valid YAML: {what}; fix the file or pass another with --params")


def read_params_file(path: Path) -> dict:
    """The raw mapping of a params file, every way it can be unreadable reported as one ConfigError naming it."""
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, expected a params YAML file (--params)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a text file (byte {exc.start} is not UTF-8), expected a params YAML file (--params)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if "\0" in text:
        raise ConfigError(f"{path}: not a text file (it holds NUL bytes), expected a params YAML file (--params)")
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: plain data only
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    if loaded is None:
        raise ConfigError(
            f"{path}: holds no settings (it is empty, or only comments), expected a mapping of "
            "sections (the repository's params.yaml lists them all)"
        )
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(loaded).__name__}")
    return loaded


DEFAULT_PARAMS = "params.yaml"


def load_params(
    path: str | Path = DEFAULT_PARAMS, overrides: list[str] | tuple[str, ...] = (), *, must_exist: bool | None = None
) -> Params:
    """Read a params file, apply overrides, validate, return typed Params. Only the implicit default (`params.yaml`
    in the working directory) may be missing, meaning all defaults; any other path must exist (`must_exist`:
    True for a path the user named, even that one; None: every path but the default)."""
    path = Path(path)
    raw: dict = {}
    implicit = str(path) == DEFAULT_PARAMS and not must_exist
    if path.exists() or path.is_symlink():
        raw = read_params_file(path)
    elif not implicit:
        raise ConfigError(
            f"{path}: no such params file (--params); only the default {DEFAULT_PARAMS} may be "
            "missing, meaning every default"
        )
    for assignment in overrides:
        apply_override(raw, assignment)
    return build(Params, raw, "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write-params"] and len(argv) <= 2:
        path = Path(argv[1] if len(argv) == 2 else DEFAULT_PARAMS)
        path.write_text(params_yaml(Params()), encoding="utf-8")
        print(f"wrote {path}")
        return 0
    if argv == ["--list"]:
        print("\n".join(settings_listing(Params())))
        return 0
    print("usage: python -m lopd_core.config --write-params [PATH] | --list", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
