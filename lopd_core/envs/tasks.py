"""Task sets by environment name: the one door every consumer (warm start, bank, distillation, evaluation)
draws tasks through, so an environment's tasks are the same wherever they are used.

Instance ``i`` of a split depends only on (env, seed, split, i): a larger ``n`` extends a smaller one. Plugin
environments (registry.py) draw from their own ``make_tasks`` or their task file; a task file's held-out splits
may return fewer than ``n`` (task_files.py).
"""

from __future__ import annotations

from .base import SPLITS, Task


def make_tasks(env: str, split: str, n: int, seed: int, worlds: dict[str, dict] | None = None) -> list[Task]:
    """``n`` tasks of ``split`` for ``env``. ``worlds`` (name -> conventions) is toolworld's: which worlds the
    split cycles over (default the named worlds); codegen reads only whether they are the pretraining worlds (its
    train tasks there are not carved: held_out.py); plugins have no worlds and ignore it."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if env == "codegen":
        from .codegen import make_codegen_tasks

        return make_codegen_tasks(split, n, seed, worlds=worlds)
    if env == "toolworld":
        from .toolworld.tasks import make_toolworld_tasks

        return make_toolworld_tasks(split, n, seed, worlds)
    from .registry import plugin_tasks

    return plugin_tasks(env, split, n, seed)
