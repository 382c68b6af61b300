"""What `--out` may write (lopd_core/outputs.py): a user's files are never replaced, emptied or turned into JSON.

Each test here reproduces a loss found by a probe at 1b8e355: `lopd export --out ..` emptied the parent folder,
`--out data/lopd` deleted the checkpoint; `lopd evaluate --out` replaced a symlink, a FIFO or a device node;
`lopd report --out /` wrote into `/`; a full disk left `metrics.tmp` behind.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from lopd_core.config import Params
from lopd_core.outputs import OutputPathError, check_folder, file_target, publish_folder, write_file


def _user_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "thesis.txt").write_text("years of work")
    (path / "sub").mkdir(exist_ok=True)
    (path / "sub" / "notes.md").write_text("more")
    return path


# ---- export ---------------------------------------------------------------------------------------------------
def test_export_refuses_a_users_folder_and_leaves_it_whole(student_dir, tmp_path):
    from lopd_core.export import export_checkpoint

    folder = _user_folder(tmp_path / "mine")
    with pytest.raises(OutputPathError, match="mine"):
        export_checkpoint(student_dir, folder, rollout=Params().rollout)
    assert (folder / "thesis.txt").read_text() == "years of work" and (folder / "sub" / "notes.md").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging folder left beside it


def test_export_out_dotdot_leaves_the_parent_alone(student_dir, tmp_path, monkeypatch):
    """`lopd export --out ..` from inside a project: the parent is not a previous export, so it is refused."""
    from lopd_cli.main import main

    project = _user_folder(tmp_path / "project")
    inner = project / "work"
    inner.mkdir()
    monkeypatch.chdir(inner)
    assert main(["export", "--model", str(student_dir), "--out", ".."]) == 1
    assert (project / "thesis.txt").exists() and (project / "sub" / "notes.md").exists() and inner.is_dir()


def test_export_the_checkpoint_folder_itself_is_refused(student_dir, tmp_path):
    """`--out data/lopd`: the folder that holds the checkpoint, composer and bank."""
    from lopd_core.export import export_checkpoint

    lopd_dir = tmp_path / "lopd"
    (lopd_dir / "checkpoint").mkdir(parents=True)
    (lopd_dir / "checkpoint" / "state.pt").write_bytes(b"weights")
    (lopd_dir / "composer.pt").write_bytes(b"phi")
    with pytest.raises(OutputPathError):
        export_checkpoint(student_dir, lopd_dir, rollout=Params().rollout)
    assert (lopd_dir / "checkpoint" / "state.pt").read_bytes() == b"weights"


def test_export_replaces_an_empty_folder_and_its_own_previous_export(student_dir, tmp_path):
    from lopd_core.export import EXPORT_MARKER, export_checkpoint

    out = tmp_path / "export"
    out.mkdir()
    export_checkpoint(student_dir, out, rollout=Params().rollout)
    assert (out / EXPORT_MARKER).exists() and (out / "config.json").exists()
    (out / "stale.bin").write_bytes(b"old")  # a previous export of ours: replaced whole, no stale file survives
    export_checkpoint(student_dir, out, rollout=Params().rollout)
    assert not (out / "stale.bin").exists() and (out / "README.md").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_failed_fill_leaves_the_previous_folder_as_it_was(tmp_path):
    out = tmp_path / "out"

    def good(staging: Path) -> None:
        (staging / "a.txt").write_text("first")

    def bad(staging: Path) -> None:
        (staging / "a.txt").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    publish_folder(out, ".m", "a thing", good)
    with pytest.raises(OutputPathError, match="no space left"):
        publish_folder(out, ".m", "a thing", bad)
    assert (out / "a.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- file outputs (evaluate, bench) ---------------------------------------------------------------------------
def test_a_symlink_is_followed_not_replaced(tmp_path):
    from lopd_core.evaluation import write_metrics

    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_metrics({"toolworld": {}}, link)
    assert link.is_symlink() and json.loads(real.read_text()) == {"toolworld": {}}


def test_a_fifo_a_device_and_a_folder_are_refused(tmp_path):
    from lopd_core.evaluation import write_metrics

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target, kind in ((fifo, "FIFO"), (Path(os.devnull), "device"), (tmp_path, "folder")):
        with pytest.raises(OutputPathError, match=kind):
            write_metrics({"x": 1}, target)
    assert fifo.exists() and not fifo.is_file()
    link = tmp_path / "to_null"
    link.symlink_to(os.devnull)  # a symlink to a device: followed, and the device refused
    with pytest.raises(OutputPathError, match="device"):
        write_metrics({"x": 1}, link)
    assert link.is_symlink()


def test_evaluate_refuses_a_bad_out_before_any_work(tmp_path, capsys):
    """The check runs before the model loads: there is no model here, yet the error is the path's."""
    from lopd_cli.main import main

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code = main(["evaluate", "--out", str(fifo), "--set", f"model.base_dir={tmp_path / 'none'}"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "FIFO" in err and str(fifo) in err


def test_a_full_disk_names_the_path_and_leaves_no_temporary(tmp_path, monkeypatch):
    from lopd_core.evaluation import write_metrics

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    target = tmp_path / "metrics" / "eval.json"
    with pytest.raises(OutputPathError, match=r"eval\.json: no space left"):
        write_metrics({"x": 1}, target)
    assert list(target.parent.iterdir()) == []


def test_merge_metrics_takes_the_same_rule(tmp_path):
    from lopd_core.bench.results import merge_metrics

    with pytest.raises(OutputPathError, match="folder"):
        merge_metrics(tmp_path, "humaneval", {"pass@1": 0.5})
    path = merge_metrics(tmp_path / "eval.json", "humaneval", {"pass@1": 0.5})
    assert json.loads(path.read_text()) == {"humaneval": {"pass@1": 0.5}}


def test_file_target_of_a_missing_path_is_the_path(tmp_path):
    assert file_target(tmp_path / "new.json") == tmp_path / "new.json"
    assert write_file(tmp_path / "a" / "b.json", "{}").read_text() == "{}"


# ---- folder outputs (report, base) ----------------------------------------------------------------------------
def test_report_refuses_a_users_folder_and_reuses_its_own(tmp_path):
    from lopd_core.run_report import REPORT_MARKER, write_report

    folder = _user_folder(tmp_path / "mine")
    with pytest.raises(OutputPathError, match="not empty"):
        write_report([], [], folder)
    assert sorted(p.name for p in folder.iterdir()) == ["sub", "thesis.txt"]
    out = tmp_path / "report"
    write_report([], [], out)
    assert (out / REPORT_MARKER).exists()
    write_report([], [], out)  # a report folder of ours: written again
    legacy = tmp_path / "legacy"  # a report from before the marker: recognised by its page's footer
    legacy.mkdir()
    (legacy / "index.html").write_text("<p>Self-contained: images are inlined; no network access needed.</p>")
    write_report([], [], legacy)
    assert "No training curves" in (legacy / "index.html").read_text()


def test_report_out_root_is_refused(tmp_path, capsys):
    from lopd_cli.main import main

    csv = tmp_path / "distill.csv"
    csv.write_text("step,rollouts,delta,beta\n1,8,0.0,0.0\n")
    assert main(["report", "--out", "/", "--csv", str(csv)]) == 1
    assert "not empty" in capsys.readouterr().err
    assert not Path("/index.html").exists()


def test_base_refuses_a_users_folder_before_training(tmp_path):
    from lopd_core.model.base_build import build_base

    folder = _user_folder(tmp_path / "mine")
    with pytest.raises(OutputPathError, match="a base"):
        build_base(Params(), folder, log=lambda m: None)
    assert (folder / "thesis.txt").exists()


def test_check_folder_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match="not a folder"):
        check_folder(tmp_path / "f", ".m", "a thing")


# ---- what a second hostile probe found --------------------------------------------------------------------------
def test_base_does_not_replace_a_users_hugging_face_folder(tmp_path, student_dir):
    """Same file names as a base, but no build report: the user's own model, refused."""
    import shutil

    from lopd_core.model.base_build import build_base

    mine = tmp_path / "my-finetuned-model"
    shutil.copytree(student_dir, mine)
    before = (mine / "model.safetensors").read_bytes()
    with pytest.raises(OutputPathError, match="a base"):
        build_base(Params(), mine, log=lambda m: None)
    assert (mine / "model.safetensors").read_bytes() == before


def test_report_does_not_overwrite_a_users_index_html(tmp_path):
    from lopd_core.run_report import write_report

    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("MY HOMEPAGE")
    with pytest.raises(OutputPathError):
        write_report([], [], site)
    assert (site / "index.html").read_text() == "MY HOMEPAGE"


def test_evaluate_refuses_an_out_inside_the_model(tmp_path, student_dir, capsys):
    import shutil

    from lopd_cli.main import main

    model = tmp_path / "model"
    shutil.copytree(student_dir, model)
    config = (model / "config.json").read_text()
    assert main(["evaluate", "--set", f"model.name_or_path={model}", "--out", str(model / "config.json")]) == 1
    assert "inside" in capsys.readouterr().err and (model / "config.json").read_text() == config


def test_symlink_loops_long_names_and_empty_paths_are_one_line(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(loop)
    for bad in (loop, tmp_path / ("x" * 300), ""):
        with pytest.raises(OutputPathError):
            write_file(bad, "{}")
    assert write_file(tmp_path / ("y" * 250), "{}").read_text() == "{}"  # a long name that fits still fits


def test_a_published_folder_keeps_a_readable_mode(tmp_path):
    import stat

    out = publish_folder(tmp_path / "out", ".m", "a thing", lambda staging: (staging / "a").write_text("x"))
    assert stat.S_IMODE(out.stat().st_mode) & 0o055 == 0o055 & ~os.umask(os.umask(0))


def test_a_plugin_step_that_raises_system_exit_fails_the_episode():
    from lopd_core.envs.guarded import TimedEnv
    from lopd_core.errors import EnvironmentStepFailed

    class Exits:
        def step(self, action):
            raise SystemExit(0)

    with pytest.raises(EnvironmentStepFailed, match="SystemExit"):
        TimedEnv(Exits(), "exits", 5.0).step("x")


def test_small_bounds_the_probe_found(tmp_path, capsys):
    """`--cycles 0`, `envs check --n 100000000`, `envs.step_timeout_s=1e308` and a task-file number that overflows
    to infinity are refused up front."""
    from lopd_cli.main import main
    from lopd_core.config import ConfigError, load_params
    from lopd_core.envs.task_files import _finite_float

    for argv in (["cycle", "--cycles", "0"], ["envs", "check", "toolworld", "--n", "100000000"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
    with pytest.raises(ConfigError, match="step_timeout_s"):
        load_params("params.yaml", ["envs.step_timeout_s=1e308"])
    with pytest.raises(ValueError, match="finite"):
        _finite_float("1e999")
