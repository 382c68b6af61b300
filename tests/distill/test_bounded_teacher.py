"""No teacher pass reads more than `rollout.max_context` positions (issue #30 item 5): the student's rollouts keep
room for the latents the teacher splices in, even when an environment floods every turn with observations."""

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from lopd_core.config import EnvsConfig, Params
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.distill.update import step as step_mod
from lopd_core.envs import registry


@pytest.fixture(autouse=True)
def clean_registry():
    yield
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))


def test_every_teacher_row_fits_max_context_with_its_latents(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    p = Params()
    p.envs = EnvsConfig(mix={"flood": 1.0}, plugins={"flood": "_faulty_envs:FloodEnv"})
    p.rollout = replace(p.rollout, max_new_tokens=8, max_context=200, max_observation_tokens=64)
    p.lopd = replace(
        p.lopd,
        tasks_per_step=2,
        samples_per_task=2,
        steps=1,
        out_dir=str(tmp_path / "lopd"),
        csv=str(tmp_path / "distill.csv"),
    )
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    texts = ["search(query) found: lorem ipsum", "search(query) found: dolor"]
    d = trainer_mod.Distiller(
        p, model, tiny_tokenizer, lambda tasks: [texts for _ in tasks], composer=composer, log=lambda m: None
    )
    seen = []
    score = step_mod.score_teacher

    def recording(lm, ids, masks, context, keys, **kwargs):
        seen.extend(len(row) + (0 if context is None or not len(c) else len(c) + 3) for row, c in zip(ids, context))
        return score(lm, ids, masks, context, keys, **kwargs)

    monkeypatch.setattr(step_mod, "score_teacher", recording)
    out = d.step()
    assert seen and max(seen) <= 200, seen
    assert max(len(t.token_ids) for t in out.trajectories) > 100  # the flood did fill the contexts
