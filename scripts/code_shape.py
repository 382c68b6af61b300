"""Print the shape of the code a maintainer reads: the largest files, the longest functions, the training
path's files and functions over their limits, and the package's functions over the function limit.

Why a script: the reviews that asked for smaller files and functions (issues "one definition of each thing",
"the step a newcomer can read") want before/after figures anyone can print; this is the one definition of how
they are counted. Repeated blocks of code are counted by the `duplicates` tool, not here. The packages counted
are the ones pyproject.toml installs, read from it, so a new package is counted without an edit here.

    python scripts/code_shape.py                    # top 10 of each
    python scripts/code_shape.py --most 25
    python scripts/code_shape.py --check            # exit 1 if a training-path file or function is over its limit
    python scripts/code_shape.py --check-package    # exit 1 if any function of the package is over its limit
"""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def installed_packages() -> tuple[str, ...]:
    """The top-level packages pyproject.toml installs (`[tool.setuptools.packages.find] include`)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    return tuple(pattern.rstrip("*").rstrip(".") for pattern in include)


PACKAGES = installed_packages()
# The training path: what one LOPD step runs through, from the stream of tasks to the optimizer step (the method
# resolved from its table, the settings it reads, the rollout, the distillation step).
TRAINING_PATH = (
    "lopd_core/distill",
    "lopd_core/methods.py",
    "lopd_core/rollout",
    "lopd_core/config.py",
    "lopd_core/settings",
)
FILE_LIMIT, FUNCTION_LIMIT = 400, 60
# Over the limit on purpose: the reference update is the one LOPD step read top to bottom in cleanrl's order,
# the oracle the optimised update is tested against; cut into helpers it would no longer read in one place.
OVER_ON_PURPOSE = {"lopd_core/distill/update/reference.py:reference_update"}


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py"))


def functions(path: Path) -> list[tuple[int, str]]:
    """(length in lines, qualified name) of every function and method in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str]] = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((child.end_lineno - child.lineno + 1, f"{prefix}{child.name}"))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def in_training_path(rel: str) -> bool:
    return any(rel == p or rel.startswith(p + "/") for p in TRAINING_PATH)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--most", type=int, default=10)
    parser.add_argument("--check", action="store_true", help="exit 1 if the training path is over its limits")
    parser.add_argument("--check-package", action="store_true", help="exit 1 if any function is over the limit")
    args = parser.parse_args(argv)
    files = [(len(p.read_text(encoding="utf-8").splitlines()), p.relative_to(ROOT).as_posix()) for p in source_files()]
    funcs = [(n, f"{p.relative_to(ROOT).as_posix()}:{name}") for p in source_files() for n, name in functions(p)]
    print(f"{len(files)} files, {sum(n for n, _ in files)} lines in {', '.join(PACKAGES)}")
    print(f"\nlargest files (top {args.most}):")
    for n, rel in sorted(files, reverse=True)[: args.most]:
        print(f"  {n:5d}  {rel}")
    print(f"\nlongest functions (top {args.most}):")
    for n, name in sorted(funcs, reverse=True)[: args.most]:
        print(f"  {n:5d}  {name}")
    over_files = [(n, r) for n, r in files if in_training_path(r) and n > FILE_LIMIT]
    over_funcs = [
        (n, r)
        for n, r in funcs
        if in_training_path(r.split(":")[0]) and n > FUNCTION_LIMIT and r not in OVER_ON_PURPOSE
    ]
    print(
        f"\ntraining path: {len(over_files)} files over {FILE_LIMIT} lines, "
        f"{len(over_funcs)} functions over {FUNCTION_LIMIT} lines"
    )
    for n, r in over_files + over_funcs:
        print(f"  {n:5d}  {r}")
    for n, r in funcs:
        if r in OVER_ON_PURPOSE:
            print(f"  {n:5d}  {r} (over on purpose: OVER_ON_PURPOSE says why)")
    over_anywhere = [(n, r) for n, r in funcs if n > FUNCTION_LIMIT and r not in OVER_ON_PURPOSE]
    print(f"\npackage: {len(over_anywhere)} functions over {FUNCTION_LIMIT} lines")
    for n, r in sorted(over_anywhere, reverse=True):
        print(f"  {n:5d}  {r}")
    failed = (args.check and (over_files or over_funcs)) or (args.check_package and over_anywhere)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
