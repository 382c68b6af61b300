"""The official composer's two choices as options (composer.py, encoder_lora.py): the task's instruction read in
front of each experience, and an encoder LoRA that belongs to φ. What must hold: each changes what φ reads and
nothing else (the teacher's own pass is untouched), a fresh LoRA reads exactly as the base, the cold start trains
the LoRA while distillation keeps it fixed, a φ is never read another way than it was fitted, and the optimised
update still equals the reference with both on. Tiny fixtures; seconds."""

import copy
from dataclasses import asdict

import pytest
import torch
from _batches import oracle_texts, six_trajectories, step_params

from lopd_core.distill import trainer as trainer_mod
from lopd_core.distill.coldstart import train_coldstart
from lopd_core.distill.coldstart_data import oracle_trajectory
from lopd_core.distill.composer import Composer, ExperienceEncoder, compose_latents, load_weights, mean_embedding_norm
from lopd_core.distill.encoder_lora import EncoderLoRA, projections
from lopd_core.distill.models import TeacherView
from lopd_core.distill.reference import reference_update
from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec

TEXTS = ["search(query) found: row 1", "lookup(id) returned 7"]


def _composer(model, *, query=False, lora_rank=0) -> Composer:
    torch.manual_seed(0)
    return Composer(
        model.config.hidden_size,
        num_queries=2,
        num_layers=1,
        num_heads=2,
        embedding_norm=mean_embedding_norm(model),
        query_conditioned=query,
        encoder_lora=EncoderLoRA.for_model(model, lora_rank) if lora_rank else None,
    )


def _encoder(model, tokenizer) -> ExperienceEncoder:
    return ExperienceEncoder(TeacherView(model), tokenizer, max_tokens=32)


def test_a_query_conditioned_composer_reads_the_task_in_front(tiny_model, tiny_tokenizer):
    composer = _composer(tiny_model, query=True).eval()
    encoder = _encoder(tiny_model, tiny_tokenizer)
    with torch.no_grad():
        a, b = compose_latents(composer, encoder, [TEXTS, TEXTS], ["find the blue file", "count the red rows"])
        plain = compose_latents(_composer(tiny_model).eval(), _encoder(tiny_model, tiny_tokenizer), [TEXTS])[0]
    assert a.shape == b.shape == plain.shape == (2 * 2, tiny_model.config.hidden_size)
    assert not torch.allclose(a, b)  # the same rows under two tasks: two readings
    assert len(encoder.cache) == 4  # cached per (task, row)
    with pytest.raises(ValueError, match="query_conditioned"):
        compose_latents(composer, encoder, [TEXTS])


def test_a_fresh_encoder_lora_reads_as_the_base_and_leaves_the_teacher_alone(tiny_model, tiny_tokenizer):
    model = copy.deepcopy(tiny_model)
    lora = EncoderLoRA.for_model(model, 4)
    assert len(lora.names) == len(projections(model)) > 0
    ids = torch.tensor([[3, 4, 5, 6]])
    before = model.model(input_ids=ids).last_hidden_state
    with torch.no_grad(), lora.applied(model):
        fresh = model.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(fresh, before)  # B = 0: exactly the base
    with torch.no_grad():
        for b in lora.b:
            b.normal_(0, 0.1)
        with lora.applied(model):
            moved = model.model(input_ids=ids).last_hidden_state
    assert not torch.allclose(moved, before)
    torch.testing.assert_close(model.model(input_ids=ids).last_hidden_state, before)  # hooks gone: the teacher


def _coldstart(model, tokenizer, composer, steps=2):
    codec = ChatCodec(tokenizer)
    successes = [oracle_trajectory(codec, t) for t in make_tasks("toolworld", "train", 3, seed=5)]
    return train_coldstart(
        model,
        tokenizer,
        composer,
        successes,
        lambda ts: [TEXTS for _ in ts],
        steps=steps,
        batch_size=2,
        lr=1e-2,
        kl_weight=1.0,
        seed=0,
        log=lambda *_: None,
    )


def test_the_cold_start_trains_the_encoder_lora_with_a_query(tiny_model, tiny_tokenizer):
    model = copy.deepcopy(tiny_model)
    composer = _composer(model, query=True, lora_rank=4)
    before = {n: p.detach().clone() for n, p in composer.encoder_lora.named_parameters()}
    run = _coldstart(model, tiny_tokenizer, composer)
    assert run.skipped_updates == 0
    assert all(not torch.equal(p, before[n]) for n, p in composer.encoder_lora.named_parameters())


def test_a_phi_is_read_the_way_it_was_fitted(tmp_path, tiny_model):
    phi0 = _composer(tiny_model)
    path = tmp_path / "phi0.pt"
    torch.save(phi0.state_dict(), path)
    with_lora = _composer(tiny_model, lora_rank=4)
    load_weights(with_lora, path)  # φ0 without a LoRA: the fit's LoRA starts at zero
    assert all(float(b.detach().abs().sum()) == 0 for b in with_lora.encoder_lora.b)
    torch.testing.assert_close(with_lora.queries, phi0.queries)
    old = {k: v for k, v in phi0.state_dict().items() if k != "query_conditioned"}  # saved before the option
    torch.save(old, path)
    with pytest.raises(ValueError, match="query_conditioned=False, the settings say True"):
        load_weights(_composer(tiny_model, query=True), path)
    torch.save(with_lora.state_dict(), path)
    with pytest.raises(RuntimeError, match="encoder_lora"):
        load_weights(_composer(tiny_model), path)  # a LoRA the settings do not have


def _distiller(tmp_path, tiny_model, tiny_tokenizer, retriever):
    params = step_params(tmp_path, method="lopd", micro_batch=2)
    model = copy.deepcopy(tiny_model).double()
    composer = _composer(model, query=True, lora_rank=2).double()
    d = trainer_mod.Distiller(params, model, tiny_tokenizer, retriever, composer=composer, log=lambda m: None)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from φ0 and from the base, so every term has something to compare
        for q in list(d.trainable.parameters()) + list(d.composer.parameters()):
            q.add_(torch.randn(q.shape, generator=g, dtype=q.dtype) * 0.05)
    return d


def test_distillation_with_both_options_equals_the_reference_and_keeps_the_lora(tmp_path, tiny_model, tiny_tokenizer):
    tasks, trajs = six_trajectories(tiny_model, tiny_tokenizer)
    texts = oracle_texts(3)

    def retriever(ts):
        return [texts[:2] for _ in ts]

    fast = _distiller(tmp_path / "fast", tiny_model, tiny_tokenizer, retriever)
    slow = _distiller(tmp_path / "slow", tiny_model, tiny_tokenizer, retriever)
    lora0 = {n: p.detach().clone() for n, p in fast.composer.encoder_lora.named_parameters()}
    queries0 = fast.composer.queries.detach().clone()
    got = asdict(fast.update(tasks, trajs).row)
    want = asdict(reference_update(slow, tasks, trajs))
    assert fast.state.skipped_updates == 0 and got["kl_text"] > 0
    for key in ("distill_loss", "kl_phi", "delta", "anchor", "kl_text"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
    reference = dict(slow.composer.named_parameters())
    for n, p in fast.composer.named_parameters():
        torch.testing.assert_close(p, reference[n], atol=1e-5, rtol=1e-5, msg=n)
    assert not torch.equal(fast.composer.queries, queries0)  # the resampler learns
    assert all(torch.equal(p, lora0[n]) for n, p in fast.composer.encoder_lora.named_parameters())  # the LoRA not


def test_a_fit_may_start_from_a_phi_fitted_to_read_without_the_query(tmp_path, tiny_model):
    path = tmp_path / "phi0.pt"
    torch.save(_composer(tiny_model).state_dict(), path)
    conditioned = _composer(tiny_model, query=True)
    load_weights(conditioned, path, refit=True)  # `lopd fit` teaches φ0 the new reading
    assert conditioned.reads_query
