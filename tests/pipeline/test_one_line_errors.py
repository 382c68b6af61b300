"""One-line errors the README promises, for what issue #30 found late or as tracebacks (items 12-16): the mix's
environments resolved at config load, the MLflow store probed before a cycle, a full disk during distill, and
the small ones (a line break in --set, threads:0, envs check --n 0, a params file that is not there, lopd.top_k
against the vocabulary, evaluate's summary)."""

import copy
import os
import sqlite3
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lopd_cli.main import main
from lopd_core import errors
from lopd_core.envs import registry
from lopd_core.errors import StateError

MISSING_BASE = "model.base_dir=/nonexistent/lopd-base"  # a command that got past its checks stops at once


@pytest.fixture(autouse=True)
def clean_registry():
    yield
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))


def _one_line(err: str) -> str:
    """The one line a command printed on stderr (progress bars of model loading aside)."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- item 12: every environment of the mix resolved before any work ------------------------------------------
@pytest.mark.parametrize(
    "plugin, why",
    [
        ("lopd_example_env:LibraryEnvv", "AttributeError"),
        ("no_such_module_anywhere:Env", "ModuleNotFoundError"),
    ],
)
def test_a_plugin_typo_fails_the_configuration_check(capsys, plugin, why):
    rc = main(
        [
            "bank",
            "--set",
            f"envs.plugins={{library: '{plugin}'}}",
            "--set",
            "envs.mix={toolworld: 1, library: 1}",
            "--set",
            MISSING_BASE,
        ]
    )
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and line.startswith("lopd: invalid configuration: envs: environment 'library'") and why in line


def test_a_bad_task_line_fails_the_configuration_check(tmp_path, capsys):
    pytest.importorskip("lopd_example_env")
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"split": "train", "instruction": "x", "state": {}, "checks": [{"op": "nope"}]}\n')
    rc = main(
        [
            "bank",
            "--set",
            "envs.mix={library: 1}",
            "--set",
            f"envs.task_files={{library: '{bad}'}}",
            "--set",
            MISSING_BASE,
        ]
    )
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and f"{bad}:1: checks[0]: unknown check op 'nope'" in line


def test_a_plugin_that_exits_while_imported_is_reported_not_obeyed(tmp_path, monkeypatch, capsys):
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = "envs.plugins={exits: 'exits_at_import:Env'}"
    assert main(["bank", "--set", plugins, "--set", "envs.mix={exits: 1}", "--set", MISSING_BASE]) == 2
    assert "called sys.exit(3) while being imported" in _one_line(capsys.readouterr().err)
    assert main(["envs", "check", "exits", "--set", plugins]) == 1
    assert "sys.exit(3)" in capsys.readouterr().out


# ---- item 13: the MLflow store probed at the start -------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_tracking_server_is_one_line_with_the_way_out(monkeypatch):
    from lopd_core.config import TrackingConfig
    from tasks.tracking import probe_tracking

    uri = f"http://127.0.0.1:{_free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(errors.TrackingUnavailable) as caught:
        probe_tracking(TrackingConfig(), timeout_s=2)
    assert str(caught.value).startswith(f"MLflow tracking store {uri}: unreachable") and "--no-mlflow" in str(
        caught.value
    )


def test_a_corrupt_sqlite_store_stops_lopd_cycle_before_any_work(tmp_path, monkeypatch, capsys):
    import flows.cycle

    db = tmp_path / "mlflow.db"
    db.write_bytes(b"this is not a database\n" * 200)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.setattr(flows.cycle, "cycle_flow", lambda **_: pytest.fail("the cycle started"))
    assert main(["cycle", "--set", f"cycle.dir={tmp_path / 'cycles'}"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert f"MLflow tracking store sqlite:///{db}: the database file cannot be used" in line and "--no-mlflow" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only file anyway")
def test_a_read_only_sqlite_store_is_one_line(tmp_path, monkeypatch):
    from lopd_core.config import TrackingConfig
    from tasks.tracking import probe_tracking

    db = tmp_path / "mlflow.db"
    sqlite3.connect(db).execute("CREATE TABLE t (x)").connection.close()
    db.chmod(0o444)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    with pytest.raises(errors.TrackingUnavailable, match="readonly|read-only"):
        probe_tracking(TrackingConfig())


# ---- item 14: a full disk during distill -----------------------------------------------------------------------
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_while_checkpointing_names_the_path_and_leaves_no_tmp(
    tmp_path, tiny_model, tiny_tokenizer, monkeypatch
):
    from lopd_core import outputs
    from lopd_core.config import Params
    from lopd_core.distill.composer.composer import Composer
    from lopd_core.distill.loop.trainer import Distiller

    p = Params()
    p.lopd = replace(p.lopd, out_dir=str(tmp_path / "lopd"))
    composer = Composer(tiny_model.config.hidden_size, num_queries=2, num_layers=1, num_heads=2)
    d = Distiller(
        p,
        copy.deepcopy(tiny_model),
        tiny_tokenizer,
        lambda tasks: [[] for _ in tasks],
        composer=composer,
        log=lambda m: None,
    )
    made = []

    def full_temporary(dir, prefix, suffix):  # the writer's temporary is /dev/full: a real ENOSPC on write
        path = Path(dir) / f"{prefix}full{suffix}"
        path.symlink_to("/dev/full")
        made.append(path)
        return os.open(path, os.O_WRONLY), str(path)

    monkeypatch.setattr(outputs.tempfile, "mkstemp", full_temporary)
    with pytest.raises(StateError) as caught:
        d.save_checkpoint()
    message = str(caught.value)
    assert str(d.checkpoint_path()) in message and "no space left" in message and "\n" not in message
    assert made and not any(p.exists() or p.is_symlink() for p in made) and not d.checkpoint_path().exists()


# ---- item 15: the small ones ---------------------------------------------------------------------------------------
def test_a_line_break_in_a_set_value_is_refused_not_folded(capsys):
    assert main(["envs", "list", "--set", "eval.out=metrics/a\nb.json"]) == 2
    assert "line break" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("spec", ["threads:0", "threads:-2", "threads:x", "thread:4"])
def test_a_bad_task_runner_is_one_line(spec):
    from flows.evaluate_sharded import task_runner_for

    with pytest.raises(SystemExit) as caught:
        task_runner_for(spec)
    assert "--task-runner" in str(caught.value.code) and spec in str(caught.value.code)


def test_envs_check_needs_at_least_one_task(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["envs", "check", "toolworld", "--n", "0"])
    assert caught.value.code == 2 and "--n: got '0', expected a whole number from 1 to 10000" in capsys.readouterr().err


# ---- item 16: --params, lopd.top_k, evaluate's summary ---------------------------------------------------------------
def test_a_params_file_that_is_not_there_is_refused_unless_it_is_the_implicit_default(tmp_path, monkeypatch, capsys):
    assert main(["envs", "list", "--params", str(tmp_path / "some" / "dir" / "params.yaml")]) == 2
    assert "no such params file" in _one_line(capsys.readouterr().err)
    monkeypatch.chdir(tmp_path)  # no params.yaml here: the implicit default means every default
    assert main(["envs", "list"]) == 0
    assert main(["envs", "list", "--params", "params.yaml"]) == 2  # named, so it must exist


def _saved_base(folder: Path, tiny_model, tiny_tokenizer) -> Path:
    tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def test_top_k_beyond_the_vocabulary_is_named_before_a_missing_composer(tmp_path, tiny_model, tiny_tokenizer, capsys):
    base = _saved_base(tmp_path / "base", tiny_model, tiny_tokenizer)
    rc = main(
        [
            "distill",
            "--set",
            f"model.base_dir={base}",
            "--set",
            "lopd.top_k=100000000",
            "--set",
            f"coldstart.out={tmp_path / 'no_phi0.pt'}",
            "--set",
            f"lopd.out_dir={tmp_path / 'lopd'}",
        ]
    )
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and "lopd.top_k: got 100000000, expected fewer than the model's vocabulary" in line


def test_evaluate_prints_a_compact_table_not_the_whole_file(tmp_path, tiny_model, tiny_tokenizer, capsys):
    torch.manual_seed(0)
    base = _saved_base(tmp_path / "base", tiny_model, tiny_tokenizer)
    out = tmp_path / "eval.json"
    rc = main(
        [
            "evaluate",
            "--out",
            str(out),
            "--set",
            f"model.base_dir={base}",
            "--set",
            "eval.n_per_split=2",
            "--set",
            "eval.splits=[test_id]",
            "--set",
            "eval.with_experience=false",
            "--set",
            "rollout.max_new_tokens=8",
        ]
    )
    printed = capsys.readouterr().out.strip().splitlines()
    table = printed[printed.index(next(line for line in printed if line.startswith("environment split"))) :]
    assert rc == 0 and out.exists()
    assert len(table) == 3 and table[1].startswith("toolworld test_id  greedy") and "{" not in "".join(printed)
