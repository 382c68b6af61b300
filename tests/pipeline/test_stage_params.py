"""The table of what each stage reads (tasks/stage_params.py): dvc.yaml agrees with it, every key it lists moves
the stage's cache key and path-only keys do not, the code it lists is what the stage's driver imports and moves
the key, the flows hash exactly the inputs it names, retrievers take the retrieval settings whole, and
`cycle.refresh_teacher` picks the teacher."""

import ast
import copy
import dataclasses
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from lopd_core.config import Params
from tasks.caching import stage_key
from tasks.stage_params import (
    STAGES,
    UNKEYED_FIELDS,
    UNSHAPING_CODE,
    dvc_code_deps,
    dvc_data_deps,
    dvc_params,
)

ROOT = Path(__file__).resolve().parents[2]
CACHED_STAGES = ("base", "bank", "coldstart", "distill", "evaluate")  # the cycle's content-keyed stages


def _dvc_stages() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def test_dvc_yaml_lists_what_the_table_says_each_stage_reads():
    stages = _dvc_stages()
    assert set(stages) == set(STAGES)
    for name, stage in stages.items():
        assert sorted(stage.get("params", [])) == sorted(dvc_params(name)), (
            f"dvc.yaml stage {name}: params should be {dvc_params(name)} (tasks/stage_params.py)"
        )
        data = sorted(d for d in stage.get("deps", []) if not d.startswith("lopd_core"))
        assert data == dvc_data_deps(name), f"dvc.yaml stage {name}: data deps should be {dvc_data_deps(name)}"
        code = sorted(d for d in stage.get("deps", []) if d.startswith("lopd_core"))
        assert code == dvc_code_deps(name), f"dvc.yaml stage {name}: code deps should be {dvc_code_deps(name)}"


def _driver_table() -> dict[str, tuple[str, str]]:
    """lopd_core/drivers/__init__.py's table, read from its docstring: stage -> (driver module, function)."""
    doc = ast.get_docstring(ast.parse((ROOT / "lopd_core" / "drivers" / "__init__.py").read_text()))
    rows = (re.match(r"    (\w+)\s+drivers/(\w+)\.py\s+(\w+)\s", line) for line in doc.splitlines())
    return {m[1]: (f"lopd_core.drivers.{m[2]}", m[3]) for m in rows if m}


# The module that holds each stage's driver: what the stage runs is it and what it imports.
DRIVERS = {stage: module for stage, (module, _) in _driver_table().items()}


def test_the_drivers_table_is_true():
    """The map in lopd_core/drivers/__init__.py names every stage that runs code, the driver module each one's
    `code` starts from and a function that module defines; every module of the folder is named there."""
    assert set(DRIVERS) == {stage for stage, reads in STAGES.items() if reads.code}
    for stage, (module, function) in _driver_table().items():
        path = _module_file(module)
        assert STAGES[stage].code[0] == path.relative_to(ROOT).as_posix(), stage
        defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        assert function in defined, f"{module} defines no {function}"
    doc = (ROOT / "lopd_core" / "drivers" / "__init__.py").read_text()
    unnamed = [
        p.name
        for p in (ROOT / "lopd_core" / "drivers").glob("*.py")
        if p.stem != "__init__" and f"drivers/{p.name}" not in doc
    ]
    assert not unnamed, f"lopd_core/drivers/__init__.py does not say what {unnamed} are"


def _module_file(module: str) -> Path | None:
    path = ROOT / Path(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


def _imported(file: Path, module: str):
    """Every module name an import statement of `file` names (function-level imports too; `from a import b`
    yields a and a.b, since b may be a module)."""
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _unshaping(rel: str) -> bool:
    return any(_covers(entry, rel) for entry in UNSHAPING_CODE)


def _reached(entry: str) -> set[str]:
    """The lopd_core source files `entry` reaches through imports (each package's __init__ included). What an
    UNSHAPING_CODE module imports is not followed: the configuration reads the methods table to check a name,
    which does not make the table part of what `lopd base` computes."""
    seen, todo = set(), [entry]
    while todo:
        parts = todo.pop().split(".")
        if parts[0] != "lopd_core":
            continue
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            file = _module_file(name)
            if file is not None and file not in seen:
                seen.add(file)
                if not _unshaping(file.relative_to(ROOT).as_posix()):
                    todo.extend(_imported(file, name))
    return {file.relative_to(ROOT).as_posix() for file in seen}


def _covers(entry: str, file: str) -> bool:
    return file == entry or file.startswith(entry.rstrip("/") + "/")


@pytest.mark.parametrize("stage", sorted(DRIVERS))
def test_the_code_a_stage_lists_is_what_its_driver_imports(stage):
    """Issue #31: `dvc repro` missed code changes (no stage listed lopd_core/envs). Every file the driver's module
    reaches is under one of the stage's `code` entries (or in UNSHAPING_CODE), and every entry is reached: the
    list is neither short (an edit re-runs nothing) nor stale."""
    reached = {f for f in _reached(DRIVERS[stage]) if not _unshaping(f)}
    code = STAGES[stage].code
    assert _module_file(DRIVERS[stage]).relative_to(ROOT).as_posix() in reached
    missing = sorted(f for f in reached if not any(_covers(entry, f) for entry in code))
    assert not missing, f"{stage}: its driver imports {missing}, not in its `code` (tasks/stage_params.py)"
    unused = [entry for entry in code if not any(_covers(entry, f) for f in reached)]
    assert not unused, f"{stage}: `code` lists {unused}, which its driver never imports"
    assert all((ROOT / entry).exists() for entry in code)


def test_an_edit_under_envs_moves_the_keys_of_the_stages_that_run_it(tmp_path, monkeypatch):
    """A reward check edited in lopd_core/envs re-runs bank, distill and evaluate (and the base, whose warm start
    plays the pretraining worlds), and leaves the stages that never run it (export, report) cached."""
    import tasks.caching as C

    shutil.copytree(ROOT / "lopd_core", tmp_path / "lopd_core", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(C, "CODE_ROOT", tmp_path)
    stages = sorted(DRIVERS)

    def keys() -> dict[str, str]:
        return {stage: stage_key(C.key_payload(stage, {}, {})) for stage in stages}

    before = keys()
    assert keys() == before
    checks = tmp_path / "lopd_core" / "envs" / "toolworld" / "checks.py"
    checks.write_text(checks.read_text() + "\n# an edited reward check\n")
    after = keys()
    moved = {stage for stage in stages if after[stage] != before[stage]}
    assert moved == {"base", "bank", "coldstart", "fit", "teacher", "distill", "evaluate"}
    assert moved == {stage for stage in stages if "lopd_core/envs" in STAGES[stage].code}
    report = tmp_path / "lopd_core" / "run_report.py"
    report.write_text(report.read_text() + "\n# a new caption\n")
    assert {stage for stage in stages if keys()[stage] != after[stage]} == {"report"}


def _leaves(value, prefix: str):
    """Every leaf key under `prefix` (a nested dataclass is walked; a list or mapping is one leaf)."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), f"{prefix}.{f.name}")
    else:
        yield prefix


def _get(params, dotted: str):
    node = params
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _changed(params: Params, dotted: str) -> Params:
    """A copy of params with the leaf at `dotted` set to some other value of its type."""
    out = copy.deepcopy(params)
    *parents, last = dotted.split(".")
    node = out
    for part in parents:
        node = getattr(node, part)
    old = getattr(node, last)
    if isinstance(old, bool):
        new = not old
    elif isinstance(old, (int, float)):
        new = old * 2 + 1
    elif isinstance(old, str):
        new = old + "-other"
    elif isinstance(old, list):
        new = old[:-1] if old else ["other"]
    elif isinstance(old, dict):
        new = {**old, "other": 1.0}
    else:
        raise TypeError(f"{dotted}: no rule to change a {type(old).__name__}")
    object.__setattr__(node, last, new)  # past the frozen section's checks: only a different value matters here
    return out


def _key(params: Params, stage: str) -> str:
    from flows.stage_flows import stage_payload

    return stage_key(stage_payload(params, stage, dict.fromkeys(STAGES[stage].inputs)))


@pytest.mark.parametrize("stage", CACHED_STAGES)
def test_every_listed_key_moves_the_stage_key_and_path_fields_do_not(stage):
    params = Params()
    reads = STAGES[stage]
    key = _key(params, stage)
    listed = [leaf for dotted in (*reads.params, *reads.cycle_params) for leaf in _leaves(_get(params, dotted), dotted)]
    assert listed
    for leaf in listed:
        moved = _key(_changed(params, leaf), stage) != key
        if leaf in UNKEYED_FIELDS:
            assert not moved, f"{stage}: unkeyed field {leaf} (a path or a reaction) changed the cache key"
        else:
            assert moved, f"{stage}: {leaf} is read but does not change the cache key"


@pytest.mark.parametrize(
    "stage, leaf",
    [
        ("distill", "bank.same_world"),
        ("distill", "baselines.skill_kl"),
        ("distill", "bank.ef_search"),
        ("distill", "cycle.refresh_teacher"),
        ("distill", "envs.mix"),
        ("coldstart", "envs.pretrain_worlds"),
        ("coldstart", "bank.ef_search"),
        ("bank", "bank.min_reward"),
        ("evaluate", "bench.limit"),
    ],
)
def test_the_keys_the_review_found_missing_now_move_the_key(stage, leaf):
    assert _key(_changed(Params(), leaf), stage) != _key(Params(), stage)


@pytest.mark.parametrize(
    "stage, leaf",
    [
        ("distill", "bank.dir"),
        ("distill", "lopd.csv"),
        ("distill", "lopd.out_dir"),
        ("distill", "model.base_dir"),
        ("coldstart", "coldstart.out"),
        ("evaluate", "eval.out"),
        ("bank", "bank.index_dir"),
        ("distill", "tracking.experiment"),
        ("distill", "eval.n_per_split"),  # not read by distillation at all
        ("distill", "lopd.resume_mismatch"),  # refuse or warn on a stale checkpoint: the outputs are the same
    ],
)
def test_paths_and_unread_keys_leave_the_key_alone(stage, leaf):
    assert _key(_changed(Params(), leaf), stage) == _key(Params(), stage)


def test_inputs_other_than_the_tables_are_refused():
    from flows.stage_flows import stage_payload

    with pytest.raises(ValueError, match="tasks/stage_params.py"):
        stage_payload(Params(), "distill", {"policy": None, "bank": None, "phi0": None})  # no teacher


def test_distill_flow_hashes_the_teacher_and_passes_it_on(monkeypatch, tmp_path):
    from flows import stage_flows as S
    from tasks.tracking import NULL_TRACKER

    teacher = tmp_path / "base"
    teacher.mkdir()
    (teacher / "w").write_text("weights")
    seen = {}

    def fake_run_cached(task, params, stage, inputs, extra=None, **kwargs):
        seen.update(stage=stage, inputs=inputs, kwargs=kwargs)
        return {"csv": str(tmp_path / "d.csv")}, False

    monkeypatch.setattr(S, "run_cached", fake_run_cached)
    S.distill_flow.fn(
        Params(),
        "hub/model",
        {"bank_dir": str(tmp_path), "index_dir": str(tmp_path)},
        "phi0.pt",
        str(teacher),
        tracker=NULL_TRACKER,
    )
    assert seen["stage"] == "distill" and seen["inputs"]["teacher"] == str(teacher)
    assert seen["kwargs"]["teacher"] == str(teacher)


def test_refresh_teacher_picks_the_cycles_teacher():
    from lopd_core.drivers.cycle_record import Champion, teacher_for

    refresh, keep = Params(), Params()
    keep.cycle = replace(keep.cycle, refresh_teacher=False)
    assert refresh.cycle.refresh_teacher is True  # the default: what the cycle always did
    champion, first = Champion(model="data/cycles/work/distill-x/student", generation=1), Champion(model="data/base")
    assert teacher_for(refresh, champion, "data/base") is None  # the champion teaches (the student's start)
    assert teacher_for(keep, champion, "data/base") == "data/base"
    assert teacher_for(keep, first, "data/base") is None  # the champion is the base: nothing to keep apart


def test_make_retriever_reads_the_retrieval_settings_whole():
    from lopd_core.drivers.distill import make_retriever

    calls = []

    class Hit:
        experience_text = "a past success"

    class Bank:
        def retrieve(self, tasks, j, allow_self_retrieval=True, same_world=False):
            calls.append((j, allow_self_retrieval, same_world))
            return [[Hit()] * j for _ in tasks]

    params = Params()
    params.bank = replace(params.bank, top_j=2, same_world=False, allow_self_retrieval=False)
    assert make_retriever(Bank(), params.bank.retrieval)(["task"]) == [["a past success"] * 2]
    assert calls == [(2, False, False)]


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_separate_teacher_is_frozen_and_is_what_teaches(tiny_model, mode):
    """cycle.refresh_teacher false: the student starts from the champion, the teacher is other (frozen) weights."""
    import torch

    from lopd_core.distill.scoring.models import make_student_and_teacher

    champion, first_base = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in champion.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the champion has moved away from the first base
    trainable, student, teacher = make_student_and_teacher(champion, mode=mode, lora_rank=2, teacher=first_base)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), teacher.active() as t:
        torch.testing.assert_close(t(ids).logits, tiny_model(ids).logits)
        assert not torch.allclose(student(ids).logits, tiny_model(ids).logits)
    assert not any(p.requires_grad for p in first_base.parameters())
    assert any(p.requires_grad for p in trainable.parameters())


def test_a_checkpoint_records_only_settings_the_distill_stage_reads():
    """The settings a resume must agree with (trainer.RESUME_SETTINGS) are keys of the distill stage's table, so
    a setting that moves the stage's cache key cannot be left out of one and kept in the other unnoticed."""
    from lopd_core.distill.loop.checkpoints import resume_settings

    reads = STAGES["distill"].params
    recorded = resume_settings(Params())
    assert "lopd.lr_student" in recorded and "lopd.steps" not in recorded
    for key in recorded:
        assert key not in UNKEYED_FIELDS and any(key == r or key.startswith(r + ".") for r in reads), key


def test_a_task_file_edited_in_place_moves_the_keys_of_the_stages_that_read_it(tmp_path, monkeypatch):
    """`envs.task_files` holds paths; the stages that draw deployment tasks must key on the files' content."""
    from lopd_core.config import EnvsConfig

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "envs"))  # the plugin's module: its source is keyed too
    tasks = tmp_path / "notes.jsonl"
    tasks.write_text('{"split": "train", "instruction": "Add a.", "state": {"notes": {}}, "checks": []}\n')
    params = Params()
    params.envs = EnvsConfig(
        mix={"toolworld": 1.0, "notes": 0.5},
        plugins={"notes": "_plugin_fixture:NotesEnv"},
        task_files={"notes": str(tasks)},
    )
    before = {stage: _key(params, stage) for stage in CACHED_STAGES}
    tasks.write_text('{"split": "train", "instruction": "Add b, then c.", "state": {"notes": {}}, "checks": []}\n')
    after = {stage: _key(params, stage) for stage in CACHED_STAGES}
    moved = {stage for stage in CACHED_STAGES if before[stage] != after[stage]}
    assert moved == {stage for stage in CACHED_STAGES if "envs" in STAGES[stage].params}
    assert moved  # bank, distill and evaluate draw deployment tasks


def _example_copy(tmp_path, monkeypatch, module: str):
    """The example plugin (examples/lopd-example-env) copied under another module name and registered as `library`
    through envs.plugins, so its files can be edited without touching the repository's."""
    from lopd_core.config import EnvsConfig

    shutil.copytree(
        ROOT / "examples" / "lopd-example-env" / "lopd_example_env",
        tmp_path / module,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    params = Params()
    params.envs = EnvsConfig(mix={"toolworld": 1.0, "library": 1.0}, plugins={"library": f"{module}:LibraryEnv"})
    return params, tmp_path / module


def test_editing_a_plugins_own_task_file_or_its_code_moves_the_keys_of_the_stages_that_play_it(tmp_path, monkeypatch):
    """Issue #30 item 4: only `envs.task_files` was hashed, so an edited `task_file` of the class itself, or an edited
    tool, reused the cached bank, student and evaluations. Both are now in the keys of the stages that play the env."""
    params, package = _example_copy(tmp_path, monkeypatch, "lopd_example_key_copy")

    def keys() -> dict[str, str]:
        return {stage: _key(params, stage) for stage in CACHED_STAGES}

    before = keys()
    assert keys() == before  # stable while nothing changes
    tasks = package / "tasks.jsonl"
    lines = tasks.read_text().splitlines()
    tasks.write_text("\n".join(lines + [lines[-1]]) + "\n")  # one more held-out task
    after_tasks = keys()
    code = package / "library.py"
    code.write_text(code.read_text().replace('raise ToolError("not found")', 'raise ToolError("no such title")', 1))
    after_code = keys()
    played = {stage for stage in CACHED_STAGES if "envs" in STAGES[stage].params}
    assert played == {"bank", "distill", "evaluate"}
    assert {stage for stage in CACHED_STAGES if after_tasks[stage] != before[stage]} == played
    assert {stage for stage in CACHED_STAGES if after_code[stage] != after_tasks[stage]} == played


def test_dvc_stages_that_play_plugins_depend_on_their_fingerprint(tmp_path, monkeypatch, capsys):
    """DVC cannot list a plugin's files (their paths come from params and package metadata): its `plugins` stage,
    run on every repro, writes their hashes with `lopd envs fingerprint`, and the stages that play the mix depend
    on that file, which an edit of the plugin's task file or code changes."""
    from lopd_cli.main import main
    from tasks.stage_params import PLUGIN_FINGERPRINT

    stages = _dvc_stages()
    assert stages["plugins"]["always_changed"] is True
    assert stages["plugins"]["cmd"] == f"lopd envs fingerprint --out {PLUGIN_FINGERPRINT}"
    for name in ("bank", "distill", "evaluate"):
        assert PLUGIN_FINGERPRINT in stages[name]["deps"], name
    _, package = _example_copy(tmp_path, monkeypatch, "lopd_example_dvc_copy")
    out = tmp_path / "plugins.json"
    argv = [
        "envs",
        "fingerprint",
        "--out",
        str(out),
        "--set",
        "envs.mix={toolworld: 1.0, library: 1.0}",
        "--set",
        'envs.plugins={library: "lopd_example_dvc_copy:LibraryEnv"}',
    ]
    assert main(argv) == 0
    first = json.loads(out.read_text())
    assert set(first) == {"library"} and len(first["library"]["task_file"]) == 1
    tasks = package / "tasks.jsonl"
    tasks.write_text(tasks.read_text() + "# an edited task file\n")
    assert main(argv) == 0
    second = json.loads(out.read_text())
    assert second["library"]["task_file"] != first["library"]["task_file"]
    assert second["library"]["source"] != first["library"]["source"]  # the task file lives in the package
