"""A distillation run with `rollout.backend: openai` rolls out on `lopd serve` and keeps the server on the
student's weights: the server reloads before each step's rollouts once the student has changed, and the run's
rows are what a run produces."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from _batches import oracle_texts, step_params

from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import loop as loop_mod
from lopd_core.distill.loop import trainer as trainer_mod
from tests.serve.conftest import make_server


@pytest.mark.slow
def test_a_distillation_run_rolls_out_on_the_server_and_syncs_each_update(
    tmp_path, tiny_model, tiny_tokenizer, monkeypatch
):
    folder = tmp_path / "start"
    tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    with make_server(folder, tmp_path / "traces") as server:
        params = step_params(tmp_path, steps=2)
        params.rollout = dataclasses.replace(params.rollout, backend="openai", servers=[server.url])
        model = copy.deepcopy(tiny_model)
        torch.manual_seed(0)
        composer = Composer(
            model.config.hidden_size,
            num_queries=4,
            num_layers=1,
            num_heads=2,
            embedding_norm=mean_embedding_norm(model),
        )
        texts = oracle_texts(3)
        d = trainer_mod.Distiller(
            params, model, tiny_tokenizer, lambda ts: [texts[:2] for _ in ts], composer=composer, log=lambda m: None
        )
        holder = server.app.state.holder
        reloads = []
        real = holder.reload
        monkeypatch.setattr(holder, "reload", lambda path=None: reloads.append(path) or real(path))
        loop_mod.run_distill(d, steps=2)
        assert len(reloads) == 2  # before step 1 (the run's student), before step 2 (after the first update)
        assert server.app.state.batcher.rows >= 2 * params.lopd.tasks_per_step * params.lopd.samples_per_task
        assert all(math.isfinite(h["row"]["reward_mean"]) for h in d.state.history)
