"""The shipped base (lopd_core/model/shipped.py): installed where the settings are its own, checked file by file,
rebuilt from the code on request with a verdict on whether the rebuild matches."""

import json
from dataclasses import replace

import pytest

from lopd_core.config import Params
from lopd_core.errors import StateError
from lopd_core.model import shipped as SH


def _fake_shipped(folder, params, weights=b"weights"):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text("{}")
    (folder / "build_report.json").write_text(json.dumps({"final_loss": 0.3, "steps": 10}))
    SH.write_manifest(folder, params, commit="abc1234")
    return folder


def test_the_repository_ships_a_base_whose_files_match_their_manifest():
    manifest = SH.check_shipped()  # every file's sha256 against SHIPPED.json
    assert manifest["settings"] == SH.build_settings(Params())  # the default's own build settings
    assert set(manifest["files"]) >= {"model.safetensors", "tokenizer.json", "config.json"}


def test_install_copies_the_checked_base_and_refuses_a_corrupted_one(tmp_path):
    params = Params()
    folder = _fake_shipped(tmp_path / "shipped", params)
    manifest = SH.install_shipped(tmp_path / "base", folder)
    assert (tmp_path / "base" / "model.safetensors").read_bytes() == b"weights"
    assert SH.weights_sha256(tmp_path / "base") == manifest["files"]["model.safetensors"]
    (folder / "model.safetensors").write_bytes(b"tampered")
    with pytest.raises(StateError, match="does not match SHIPPED.json"):
        SH.install_shipped(tmp_path / "other", folder)


def test_the_shipped_base_answers_only_to_its_own_settings(tmp_path):
    params = Params()
    folder = _fake_shipped(tmp_path / "shipped", params)
    assert SH.shipped_for(params, folder) is not None
    other = Params()
    other.model = replace(other.model, warmstart=replace(other.model.warmstart, max_steps=10))
    assert SH.shipped_for(other, folder) is None  # another warm start: built from the code
    built = Params()
    built.model = replace(built.model, base_source="build")
    assert SH.shipped_for(built, folder) is None
    threads = Params()
    threads.model = replace(threads.model, threads=1)  # the thread count is not a build setting of the shipped base
    assert SH.shipped_for(threads, folder) is not None


def test_a_rebuild_says_whether_it_matches(tmp_path):
    params = Params()
    folder = _fake_shipped(tmp_path / "shipped", params)
    same = _fake_shipped(tmp_path / "same", params)
    other = _fake_shipped(tmp_path / "other", params, weights=b"other weights")
    assert "matches the shipped base" in SH.rebuild_verdict(same, folder)
    assert "differ from the shipped base" in SH.rebuild_verdict(other, folder)
