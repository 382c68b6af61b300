"""The official composer's two choices as options (composer.py, encoder_lora.py): the task's instruction read in
front of each experience, and an encoder LoRA that belongs to φ. What must hold: each changes what φ reads and
nothing else (the teacher's own pass is untouched), a fresh LoRA reads exactly as the base, the cold start trains
the LoRA while distillation keeps it fixed, a φ is never read another way than it was fitted (its configuration
saved as JSON beside its weights and checked on load), no cache serves states read under other LoRA weights, the
caches are bounded, and the optimised update still equals the reference with both on. Tiny fixtures; seconds."""

import copy
import json
from dataclasses import asdict

import pytest
import torch
from _batches import oracle_texts, six_trajectories, step_params

from lopd_core.distill.composer.coldstart import train_coldstart
from lopd_core.distill.composer.coldstart_data import oracle_trajectory
from lopd_core.distill.composer.composer import (
    Composer,
    ExperienceEncoder,
    PhiConfig,
    compose_latents,
    config_path,
    load_weights,
    mean_embedding_norm,
    save_composer,
    saved_config,
)
from lopd_core.distill.composer.encoder_lora import EncoderLoRA, projections
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.distill.scoring.models import TeacherView
from lopd_core.distill.update.inputs import AnchorLatents
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
    path = save_composer(phi0, tmp_path / "phi0.pt")
    with_lora = _composer(tiny_model, lora_rank=4)
    load_weights(with_lora, path)  # φ0 without a LoRA: the fit's LoRA starts at zero
    assert all(float(b.detach().abs().sum()) == 0 for b in with_lora.encoder_lora.b)
    torch.testing.assert_close(with_lora.queries, phi0.queries)
    with pytest.raises(ValueError, match=r"query_conditioned: fitted with False, the settings give True"):
        load_weights(_composer(tiny_model, query=True), path)
    save_composer(with_lora, path)
    with pytest.raises(ValueError, match=r"encoder_lora_rank: fitted with 4, the settings give 0"):
        load_weights(_composer(tiny_model), path)  # a LoRA the settings do not have


def test_a_saved_phi_round_trips_its_configuration(tmp_path, tiny_model):
    """The configuration lies beside the weights as JSON (as PEFT's adapter_config.json) and comes back equal."""
    phi = _composer(tiny_model, query=True, lora_rank=2)
    path = save_composer(phi, tmp_path / "phi.pt")
    assert config_path(path) == tmp_path / "phi.config.json"
    assert json.loads(config_path(path).read_text()) == asdict(phi.config)
    assert (
        saved_config(path)
        == phi.config
        == PhiConfig(
            lm_width=tiny_model.config.hidden_size,
            num_queries=2,
            width=tiny_model.config.hidden_size,
            num_layers=1,
            num_heads=2,
            query_conditioned=True,
            encoder_lora_rank=2,
            encoder_lora_scale=2.0,  # α = 2r by default
        )
    )
    again = _composer(tiny_model, query=True, lora_rank=2)
    with torch.no_grad():
        again.queries.zero_()
    load_weights(again, path)
    for (name, p), q in zip(phi.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), name
    assert "query_conditioned" not in phi.state_dict()  # the configuration is no tensor of the state


def test_a_configuration_mismatch_names_the_field(tmp_path, tiny_model):
    path = save_composer(_composer(tiny_model), tmp_path / "phi0.pt")
    other_heads = Composer(
        tiny_model.config.hidden_size, num_queries=2, num_layers=1, num_heads=4, embedding_norm=1.0
    )  # the same shapes: load_state_dict alone would take it
    with pytest.raises(ValueError, match=r"num_heads: fitted with 2, the settings give 4 \(from composer.num_heads\)"):
        load_weights(other_heads, path)
    more_queries = Composer(tiny_model.config.hidden_size, num_queries=3, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="num_queries: fitted with 2, the settings give 3"):
        load_weights(more_queries, path)
    config = json.loads(config_path(path).read_text())
    config_path(path).write_text(json.dumps({k: v for k, v in config.items() if k != "num_layers"}))
    with pytest.raises(ValueError, match="phi0.config.json: expected the fields"):
        load_weights(_composer(tiny_model), path)


def test_a_phi_saved_without_its_configuration_is_refused(tmp_path, tiny_model):
    """The documented choice for files from before the configuration was recorded: a clear error, not a guess."""
    path = tmp_path / "phi0.pt"
    torch.save(_composer(tiny_model).state_dict(), path)
    with pytest.raises(ValueError, match=r"no phi0.config.json beside it.*`lopd coldstart`"):
        load_weights(_composer(tiny_model), path)


def test_a_changed_lora_misses_the_encoders_cache(tiny_model, tiny_tokenizer):
    """The LoRA's fingerprint is in every key: states read under other LoRA weights are never served."""
    composer = _composer(tiny_model, lora_rank=2).requires_grad_(False)
    lora, encoder = composer.encoder_lora, _encoder(tiny_model, tiny_tokenizer)
    first, _ = encoder.encode(TEXTS, lora=lora)
    again, _ = encoder.encode(TEXTS, lora=lora)
    assert (encoder.misses, encoder.hits) == (2, 2) and torch.equal(first, again)
    fingerprint = lora.fingerprint()
    with torch.no_grad():
        lora.b[0].normal_(0, 0.5)  # as a fit would leave it
    assert lora.fingerprint() != fingerprint
    moved, _ = encoder.encode(TEXTS, lora=lora)
    assert (encoder.misses, encoder.hits) == (4, 2) and not torch.equal(moved, first)
    plain, _ = _encoder(tiny_model, tiny_tokenizer).encode(TEXTS)
    encoder.encode(TEXTS)  # no LoRA: the base's states, a key of their own
    assert encoder.misses == 6 and torch.equal(encoder.encode(TEXTS)[0], plain)


def test_a_changed_lora_misses_the_anchor_cache(tiny_model, tiny_tokenizer):
    composer = _composer(tiny_model, lora_rank=2).requires_grad_(False)
    anchor = AnchorLatents(composer, _encoder(tiny_model, tiny_tokenizer))
    before = anchor([TEXTS])[0]
    assert len(anchor.cache) == 2
    with torch.no_grad():
        anchor.composer.encoder_lora.b[0].normal_(0, 0.5)
    after = anchor([TEXTS])[0]
    assert len(anchor.cache) == 4 and not torch.allclose(before, after)


def test_the_encoders_cache_is_bounded(tiny_model, tiny_tokenizer):
    """At capacity the least recently used encoding goes; a call that reads more texts than the cache keeps
    still gets all of them."""
    encoder = ExperienceEncoder(TeacherView(tiny_model), tiny_tokenizer, max_tokens=32, cache_capacity=2)
    texts = [*TEXTS, "open(path) read 3 lines"]
    states, _ = encoder.encode(texts)
    assert states.shape[0] == 3 and len(encoder.cache) == 2
    assert encoder.cache.keys() == [encoder.key(t) for t in texts[1:]]  # the first read went first
    encoder.encode(texts[1:2])  # a hit: now the most recently used
    encoder.encode(texts[:1])  # a miss: drops the least recently used, texts[2]
    assert encoder.cache.keys() == [encoder.key(texts[1]), encoder.key(texts[0])]


def _distiller(tmp_path, tiny_model, tiny_tokenizer, retriever, *, simple: bool = False):
    """`simple`: the configuration the trainer runs reference.py in; else the optimised path, in chunks of 2."""
    knobs = {"micro_batch": 0, "share_prompt": False} if simple else {"micro_batch": 2}
    params = step_params(tmp_path, method="lopd", **knobs)
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
    slow = _distiller(tmp_path / "slow", tiny_model, tiny_tokenizer, retriever, simple=True)
    assert slow.setup.runs_reference
    lora0 = {n: p.detach().clone() for n, p in fast.composer.encoder_lora.named_parameters()}
    queries0 = fast.composer.queries.detach().clone()
    got = asdict(fast.update(tasks, trajs).row)
    want = asdict(slow.update(tasks, trajs).row)
    assert fast.state.skipped_updates == 0 and got["kl_text"] > 0
    for key in ("distill_loss", "kl_phi", "delta", "anchor", "kl_text"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
    reference = dict(slow.composer.named_parameters())
    for n, p in fast.composer.named_parameters():
        torch.testing.assert_close(p, reference[n], atol=1e-5, rtol=1e-5, msg=n)
    assert not torch.equal(fast.composer.queries, queries0)  # the resampler learns
    assert all(torch.equal(p, lora0[n]) for n, p in fast.composer.encoder_lora.named_parameters())  # the LoRA not


def test_a_fit_may_start_from_a_phi_fitted_to_read_without_the_query(tmp_path, tiny_model):
    path = save_composer(_composer(tiny_model), tmp_path / "phi0.pt")
    conditioned = _composer(tiny_model, query=True)
    load_weights(conditioned, path, refit=True)  # `lopd fit` teaches φ0 the new reading
    assert conditioned.reads_query
