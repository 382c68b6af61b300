"""`/admin/reload` swaps in only a checkpoint that can serve, from where it may, for whom it may (issue #39,
item 4), and the server refuses at start a context limit its model cannot hold.

A candidate is loaded and smoke-tested before the swap: a tokenizer with ids past the embeddings would fail every
request holding one (and each batch it joins), positions short of serve.max_context would fail the longest
conversations, a config.json that does not describe the weights would serve random tensors. Each is a 4xx and
the current model stays."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.serve.conftest import make_server


def _variant(source, folder, *, config=None, edit=None):
    shutil.copytree(source, folder)
    if edit is not None:
        model = AutoModelForCausalLM.from_pretrained(folder)
        edit(model)
        model.save_pretrained(folder)
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def _nan(model):
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))


def test_a_candidate_that_cannot_serve_is_refused(live, tiny_checkpoints, tmp_path):
    source = tiny_checkpoints[1]
    before = httpx.get(live.root + "/health").json()["model_version"]
    rows = AutoModelForCausalLM.from_pretrained(source).get_input_embeddings().weight.shape[0]
    candidates = {
        "short_vocab": _variant(source, tmp_path / "v", edit=lambda m: m.resize_token_embeddings(rows - 40)),
        "short_positions": _variant(source, tmp_path / "p", config={"max_position_embeddings": 64}),
        "more_layers": _variant(source, tmp_path / "l", config={"num_hidden_layers": 3}),
        "wider": _variant(source, tmp_path / "w", config={"hidden_size": 48}),
        "nan_weights": _variant(source, tmp_path / "n", edit=_nan),
    }
    for name, folder in candidates.items():
        response = httpx.post(live.root + "/admin/reload", json={"model": str(folder)}, timeout=120)
        assert response.status_code in (400, 422), (name, response.text)
        assert response.json()["error"]["code"] in ("reload_unservable", "reload_failed"), name
        assert httpx.get(live.root + "/health").json()["model_version"] == before, name
    assert httpx.post(live.root + "/admin/reload", json={"model": str(source)}, timeout=120).status_code == 200


def test_reload_has_its_own_key_and_roots(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("LOPD_TEST_KEY", "chat")
    monkeypatch.setenv("LOPD_TEST_RELOAD_KEY", "admin")
    inside = tmp_path / "roots" / "b"
    shutil.copytree(tiny_checkpoints[1], inside)
    settings = {"api_key_env": "LOPD_TEST_KEY", "reload_key_env": "LOPD_TEST_RELOAD_KEY"}
    with make_server(tiny_checkpoints[0], tmp_path / "t", reload_roots=[str(tmp_path / "roots")], **settings) as live:
        chat, admin = ({"Authorization": f"Bearer {k}"} for k in ("chat", "admin"))
        reload = live.root + "/admin/reload"
        assert httpx.post(reload, json={"model": str(inside)}, headers=chat).status_code == 401
        outside = httpx.post(reload, json={"model": str(tiny_checkpoints[0])}, headers=admin)
        assert outside.status_code == 403 and outside.json()["error"]["code"] == "reload_outside_roots"
        sneaky = httpx.post(reload, json={"model": str(inside / ".." / ".." / "t")}, headers=admin)
        assert sneaky.status_code == 403
        assert httpx.post(reload, json={"model": str(inside)}, headers=admin, timeout=120).json()["changed"]
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        assert httpx.post(live.url + "/chat/completions", json=body, headers=admin).status_code == 200  # a trainer
    monkeypatch.delenv("LOPD_TEST_RELOAD_KEY")
    with make_server(tiny_checkpoints[0], tmp_path / "u", **settings) as live:  # behind a key, no reload key: off
        off = httpx.post(live.root + "/admin/reload", json={}, headers={"Authorization": "Bearer chat"})
        assert off.status_code == 403 and off.json()["error"]["code"] == "reload_off"


def test_a_context_limit_past_the_positions_is_refused_at_start(tiny_checkpoints, tmp_path):
    from lopd_serve.config import ServeConfig, ServeConfigError
    from lopd_serve.server import build_app

    settings = {"model": str(tiny_checkpoints[0]), "store_dir": str(tmp_path / "t"), "device": "cpu", "poll_s": 0}
    with pytest.raises(ServeConfigError, match=r"serve.max_context=4096 exceeds the model's 1024 positions"):
        build_app(ServeConfig.from_dict({**settings, "max_context": 4096}))
    assert build_app(ServeConfig.from_dict({**settings, "max_context": 1024})).state.holder  # the store lock was freed
