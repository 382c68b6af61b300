"""The one read-JSON and write-JSON pair (lopd_core/jsonio.py) and the atomic writer under it (outputs.py)."""

import os

import pytest

from lopd_core.jsonio import read_json, write_json
from lopd_core.outputs import OutputPathError, atomic_write


def test_read_json_gives_the_default_until_a_file_is_there(tmp_path):
    path = tmp_path / "state" / "history.json"
    assert read_json(path) is None and read_json(None, []) == [] and read_json("", {}) == {}
    assert read_json(path, []) == []
    assert write_json(path, [{"cycle": 1, "score": 0.5}]) == path
    assert read_json(path, []) == [{"cycle": 1, "score": 0.5}]
    assert path.read_text() == '[\n  {\n    "cycle": 1,\n    "score": 0.5\n  }\n]'  # indent=2 unless told
    write_json(path, {"b": 1, "a": 2}, sort_keys=True, indent=None)
    assert path.read_text() == '{"a": 2, "b": 1}'


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "champion.json"
    write_json(path, {"version": 1})
    with pytest.raises(RuntimeError, match="stop"), atomic_write(path, text=True) as f:
        f.write('{"version": 2')
        raise RuntimeError("stop")
    assert read_json(path) == {"version": 1} and os.listdir(tmp_path) == ["champion.json"]


def test_atomic_write_follows_a_symlink_and_refuses_a_folder(tmp_path):
    real = tmp_path / "real.csv"
    real.write_text("old\n")
    link = tmp_path / "link.csv"
    link.symlink_to(real)
    with atomic_write(link, text=True) as f:
        f.write("step,loss\r\n1,0.5\r\n")  # text mode translates no newline (csv writes its own)
    assert link.is_symlink() and real.read_bytes() == b"step,loss\r\n1,0.5\r\n"
    with pytest.raises(OutputPathError, match="it is a folder"), atomic_write(tmp_path) as f:
        f.write(b"x")
