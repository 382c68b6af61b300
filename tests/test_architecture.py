"""The layers of the code, checked: every import points down, no two parts import each other, and no file imports
itself back through other files.

Why a test: the review that split the trainer and moved the tree (issue "one definition of each thing") found
the configuration importing the trainer's package and the trainer's package importing the stage drivers, a
cycle that made every part reach every other. The next review (issue 40) found circles the package check
cannot see, inside one package: the nine trainer modules, losses.py and pg_losses.py, envs/guarded.py and
envs/isolated.py. Imports inside functions and under `if TYPE_CHECKING:` count: a deferred import is still a
dependency, only a slower one to find, and a reader follows it all the same.
"""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lopd_core", "tasks", "flows", "lopd_serve", "lopd_cli")

# Bottom to top. A part may import parts of its own layer or below; lopd_core never imports what is above it.
LAYERS: list[set[str]] = [
    {"lopd_core", "errors", "offline", "names", "methods", "outputs", "jsonio", "locks", "experience", "stopping"},
    {"settings", "config"},
    {"envs", "distributed"},
    {"model"},
    {"rollout", "sharding"},
    {"bank", "traces"},
    {"bench"},
    {"evaluation", "export", "run_report", "outcomes", "gate", "sign_flip"},
    {"distill"},
    {"drivers"},
    {"compare"},
    {"tasks"},
    {"flows", "lopd_serve"},
    {"lopd_cli"},
]
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str | None:
    """The part a dotted module belongs to: a top-level package, or lopd_core's module or sub-package."""
    head, *rest = module.split(".")
    if head not in PACKAGES:
        return None
    if head != "lopd_core":
        return head
    return rest[0] if rest else "lopd_core"


def imports(path: Path, module: str):
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from lopd_core import distributed` names the module lopd_core.distributed
            yield from (f"{base}.{alias.name}" for alias in node.names) if base == "lopd_core" else (base,)


def part_graph() -> dict[str, dict[str, str]]:
    """part -> {imported part: one file that imports it}."""
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            here = part_of(module)
            for name in imports(path, module):
                there = part_of(name)
                if there and there != here:
                    graph[here].setdefault(there, rel.as_posix())
    return graph


def test_every_part_has_a_layer():
    graph = part_graph()
    parts = set(graph) | {p for edges in graph.values() for p in edges}
    assert parts <= set(LAYER), f"add to LAYERS in tests/test_architecture.py: {sorted(parts - set(LAYER))}"


def test_imports_point_down_the_layers():
    upward = [
        f"{where}: {here} (layer {LAYER[here]}) imports {there} (layer {LAYER[there]})"
        for here, edges in part_graph().items()
        for there, where in edges.items()
        if LAYER.get(there, -1) > LAYER.get(here, -1)
    ]
    assert not upward, "\n".join(upward)


def test_no_two_parts_import_each_other():
    graph = part_graph()

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), {}):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(f"{a} -> {b} ({graph[a][b]}) and back" for a in graph for b in graph[a] if a in reaches(b))
    assert not cycles, "\n".join(cycles)


def module_files() -> dict[str, Path]:
    """Every module of the packages -> its file (a package is its __init__.py)."""
    files = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            files[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return files


def file_graph(files: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """module -> the modules of the packages it imports. `from a.b import c` is an import of the module a.b.c
    where c is one, else of a.b; an import of a.b.c that names no file is one of its nearest enclosing module."""
    files = module_files() if files is None else files
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].add(name)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others (the strongly connected
    components of more than one module, Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_no_file_imports_itself_back_through_others():
    """Within a package too: a step a reader follows down never leads back to a file already left."""
    circles = import_circles(file_graph())
    assert not circles, "files that import each other:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_finds_a_circle():
    """The check itself, on a circle made on purpose (a imports b, b imports c, c imports a) beside a chain."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]


def test_the_library_never_imports_the_orchestration():
    """lopd_core is usable without Prefect, MLflow or the HTTP server: the arrows point down only."""
    heavy = ("prefect", "mlflow", "fastapi", "uvicorn")
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "lopd_core").rglob("*.py"))
        for name in imports(path, "lopd_core")
        if name.split(".")[0] in heavy
    ]
    assert not found, "\n".join(found)


def test_the_training_path_keeps_its_files_and_functions_small():
    """No file of the training path over 400 lines, and no function of the package over 60 (scripts/code_shape.py
    counts them and names the one exception and why)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "code_shape.py"), "--check", "--check-package", "--most", "0"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout


def positional_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters a caller may pass by position, a method's `self` or `cls` not counted."""
    names = [a.arg for a in function.args.posonlyargs + function.args.args]
    return names[1:] if names and names[0] in ("self", "cls") else names


def test_no_distill_function_takes_more_than_five_positional_parameters():
    """Issue #45 (typed seams): past five, a call is read by counting commas; what is more is a setting, passed by
    name (keyword-only), or belongs in a typed container (inputs.py's StepSetup, update.py's UpdateParts)."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({', '.join(positional_parameters(node))})"
        for path in sorted((ROOT / "lopd_core" / "distill").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(positional_parameters(node)) > 5
    ]
    assert not found, "make the extras keyword-only or pass a dataclass:\n" + "\n".join(found)


def test_the_positional_check_counts_what_a_caller_passes_by_position():
    tree = ast.parse("def f(a, b, /, c, *args, d, e=1, **kw): ...\nclass K:\n    def m(self, a, *, b): ...")
    f, method = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    assert positional_parameters(f) == ["a", "b", "c"]
    assert positional_parameters(method) == ["a"]


# distill/'s parts, bottom to top (lopd_core/distill/__init__.py says what each holds): a part imports only the
# ones below it, so a reader of the update never needs the loop, nor a reader of the composer the update.
DISTILL_PARTS = ["scoring", "composer", "teacher", "update", "loop"]


def test_distill_parts_import_down_only():
    package = ROOT / "lopd_core" / "distill"
    assert sorted(p.name for p in package.iterdir() if (p / "__init__.py").exists()) == sorted(DISTILL_PARTS)
    assert sorted(p.name for p in package.glob("*.py")) == ["__init__.py"], "every module of distill/ is in a part"
    rank = {f"lopd_core.distill.{part}": i for i, part in enumerate(DISTILL_PARTS)}

    def part(module: str) -> str | None:
        return next((p for p in rank if module == p or module.startswith(p + ".")), None)

    upward = sorted(
        f"{module} ({DISTILL_PARTS[rank[here]]}) imports {name} ({DISTILL_PARTS[rank[there]]})"
        for module, names in file_graph().items()
        if (here := part(module))
        for name in names
        if (there := part(name)) and rank[there] > rank[here]
    )
    assert not upward, "\n".join(upward)


def test_distill_parts_init_files_hold_only_their_docstring():
    """No re-export hub: a name is imported from the module that defines it, never from a part's __init__.py."""
    for path in sorted((ROOT / "lopd_core" / "distill").rglob("__init__.py")):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), path
