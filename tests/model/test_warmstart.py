"""Warm start: demonstrations mark only the policy's tokens, the loss is the action-token cross-entropy, and a
few steps on a tiny model lower it."""

import random

import pytest
import torch

from lopd_core.model.chat import IM_END, ChatCodec
from lopd_core.model.demos import encode_demo
from lopd_core.model.muon import StackedMuon
from lopd_core.model.warmstart import action_token_loss, collate, pack_batches


def test_demo_mask_covers_exactly_the_actions(tiny_demos, tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    for demo in tiny_demos[:20]:
        traj = encode_demo(demo, codec)
        sampled = [t for t, m in zip(traj.token_ids, traj.action_mask) if m]
        assert tiny_tokenizer.decode(sampled) == "".join(a + IM_END for a in demo.actions)
        assert tiny_tokenizer.decode(traj.token_ids) == demo.text()


def test_demos_mix_experience_and_noise(tiny_demos):
    with_exp = [d for d in tiny_demos if d.experiences]
    assert 0 < len(with_exp) < len(tiny_demos)
    # Experience demonstrations name a synthetic world, never a real one, so they teach reading rules from
    # the experiences rather than which real world has which rules.
    from lopd_core.envs import WORLDS

    for d in with_exp:
        assert not any(w in d.user for w in WORLDS)
    noisy = [d for d in tiny_demos if not d.experiences and d.world_followed not in d.user]
    assert noisy, "some demonstrations follow another world's conventions"


def test_pack_batches_respects_the_token_budget(tiny_demos, tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    seqs = [encode_demo(d, codec) for d in tiny_demos]
    batches = pack_batches(seqs, 2048, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(len(seqs)))
    for b in batches:
        assert len(b) == 1 or max(len(seqs[i]) for i in b) * len(b) <= 2048


def test_action_token_loss_equals_masked_cross_entropy(tiny_demos, tiny_tokenizer, tiny_model):
    codec = ChatCodec(tiny_tokenizer)
    seqs = [encode_demo(d, codec) for d in tiny_demos[:4]]
    ids, attention, labels, _ = collate(seqs, codec.pad_id)
    assert (
        (labels != -100)
        == torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(s.action_mask, dtype=torch.bool) for s in seqs], batch_first=True
        )
    ).all()
    with torch.no_grad():
        ours = action_token_loss(tiny_model, ids, attention, labels)
        reference = tiny_model(input_ids=ids, attention_mask=attention, labels=labels).loss
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_context_loss_on_a_share_of_positions_estimates_the_full_term(tiny_demos, tiny_tokenizer, tiny_model):
    """`context_fraction` < 1 scores the context on a random share of its positions: the same term, estimated.
    Fraction 1 is the full mean; 0 leaves only the action loss; in between the estimate is reproducible under
    torch's seed and, averaged over draws, close to the full term."""
    codec = ChatCodec(tiny_tokenizer)
    ids, attention, labels, _ = collate([encode_demo(d, codec) for d in tiny_demos[:4]], codec.pad_id)
    with torch.no_grad():
        actions = action_token_loss(tiny_model, ids, attention, labels)
        full = action_token_loss(tiny_model, ids, attention, labels, 1.0, 1.0) - actions
        assert full > 0
        torch.testing.assert_close(action_token_loss(tiny_model, ids, attention, labels, 1.0, 0.0), actions)
        draws = []
        for seed in range(40):
            torch.manual_seed(seed)
            draws.append(action_token_loss(tiny_model, ids, attention, labels, 1.0, 0.3) - actions)
        torch.manual_seed(0)
        again = action_token_loss(tiny_model, ids, attention, labels, 1.0, 0.3) - actions
    assert torch.equal(again, draws[0])
    assert len({round(d.item(), 6) for d in draws}) > 1
    assert abs(torch.stack(draws).mean() - full) < 0.02 * full


def _tiny_model(tokenizer):
    from lopd_core.config import TinyModelConfig
    from lopd_core.model.loading import tiny_qwen3

    torch.manual_seed(0)
    return tiny_qwen3(
        TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), tokenizer
    )


@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_a_few_steps_lower_the_loss_and_move_every_parameter(tiny_demos, tiny_tokenizer, kind):
    from lopd_core.config import WarmStartConfig
    from lopd_core.model.warmstart import make_optimizers

    model = _tiny_model(tiny_tokenizer)
    codec = ChatCodec(tiny_tokenizer)
    ids, attention, labels, _ = collate([encode_demo(d, codec) for d in tiny_demos[:8]], codec.pad_id)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizers = make_optimizers(model, WarmStartConfig(optimizer=kind, lr=1e-2, muon_lr=1e-2))
    losses = []
    for _ in range(15):
        loss = action_token_loss(model, ids, attention, labels)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    unmoved = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not unmoved, unmoved


@pytest.mark.parametrize("ns_dtype, tolerance", [(torch.bfloat16, 0.01), (None, 0.04)])
def test_stacked_muon_steps_as_torch_muon_does(ns_dtype, tolerance):
    """Batching the Newton–Schulz iteration over same-shaped matrices changes the cost, not the update: after
    three steps on random gradients the weights agree with torch.optim.Muon's (match_rms_adamw) to bf16 rounding.
    In bfloat16, as torch computes it, they agree to 1 % of the distance moved; in float32 (our CPU default)
    to the few per cent bfloat16's rounding makes torch's own update differ from the exact one."""
    torch.manual_seed(0)
    shapes = [(16, 16), (8, 16), (48, 16), (16, 48), (16, 16)]
    ours = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    opt_ours = StackedMuon(ours, lr=1e-2, weight_decay=0.01, ns_dtype=ns_dtype)
    opt_theirs = torch.optim.Muon(theirs, lr=1e-2, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    for a, b, s in zip(ours, theirs, start):
        assert (a - b).norm() <= tolerance * (b - s).norm()  # agree far more closely than either moved
    with pytest.raises(ValueError, match="matrices only"):
        StackedMuon([torch.nn.Parameter(torch.zeros(4))])


def test_newton_schulz_runs_in_float32_on_the_cpu():
    """bfloat16 products take a slow path on CPUs without bf16 instructions (20-27× float32's on AVX2), which cut
    a time-budgeted warm start to an eighth of its steps: the CPU iterates in float32, an accelerator in bf16."""
    from lopd_core.model.muon import iteration_dtype, orthogonalise

    assert iteration_dtype(torch.device("cpu")) == torch.float32
    assert iteration_dtype(torch.device("cuda", 0)) == torch.bfloat16
    x = torch.randn(3, 8, 24)
    ortho = orthogonalise(x)
    assert ortho.dtype == torch.float32
    singular = torch.linalg.svdvals(ortho)  # the quintic drives every singular value into ≈ [0.7, 1.2]
    assert singular.min() > 0.6 and singular.max() < 1.25


def test_muon_takes_the_layer_matrices_and_adamw_the_rest(tiny_tokenizer):
    """Muon orthogonalises 2-D updates: right for attention and MLP projections, wrong for the embedding (one row
    per token, tied to the output head) and for the norms' gain vectors, which stay with AdamW."""
    from lopd_core.config import WarmStartConfig
    from lopd_core.model.warmstart import make_optimizers

    model = _tiny_model(tiny_tokenizer)
    adamw, muon = make_optimizers(model, WarmStartConfig(optimizer="muon", lr=3e-3, muon_lr=1e-3))
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, StackedMuon)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_muon | in_adamw == set(names.values()) and not in_muon & in_adamw
    assert in_muon == {n for n, p in model.named_parameters() if p.ndim == 2 and n != "model.embed_tokens.weight"}
    assert any("q_norm" in n for n in in_adamw) and "model.embed_tokens.weight" in in_adamw
    assert [g["initial_lr"] for g in adamw.param_groups + muon.param_groups] == [3e-3, 1e-3]


def test_max_steps_runs_exactly_that_many_steps_whatever_the_time_budget(tmp_path):
    """`model.warmstart.max_steps` is how recipes are compared on a busy machine: the time budget (here far too
    small for even one step) no longer cuts the run short."""
    from lopd_core.config import load_params
    from lopd_core.model.base_build import build_base

    (tmp_path / "p.yaml").write_text("seed: 0\n")
    params = load_params(
        tmp_path / "p.yaml",
        [
            "model.warmstart.demos=40",
            "model.warmstart.drills=10",
            "model.tiny.vocab_size=400",
            "model.tiny.hidden_size=32",
            "model.tiny.intermediate_size=64",
            "model.tiny.num_heads=2",
            "model.tiny.num_kv_heads=1",
            "model.warmstart.time_budget_s=0.001",
            "model.warmstart.max_steps=3",
        ],
    )
    report = build_base(params, tmp_path / "base", log=lambda m: None)
    assert report.steps == 3


def test_copy_weight_marks_values_seen_in_the_context_and_weights_the_mean(tiny_demos, tiny_tokenizer, tiny_model):
    """A copied value (an amount from the instruction, an id from an observation) is marked; call syntax and a
    value not yet in the context are not. Weight 1 is the plain mean; the weighted loss is sum(w·ce) / sum(w)."""
    from lopd_core.model.chat import TrajectoryIds
    from lopd_core.model.warmstart import copy_targets, value_tokens

    is_value = value_tokens(tiny_tokenizer)
    codec = ChatCodec(tiny_tokenizer)
    word = tiny_tokenizer.convert_tokens_to_ids("bank_transfer")
    brace = tiny_tokenizer.convert_tokens_to_ids("{")
    assert bool(is_value[word]) and not bool(is_value[brace])
    seq = TrajectoryIds([brace, word, brace, word, word], [0, 0, 1, 1, 0], [0.0] * 5)
    assert copy_targets(seq, is_value) == [False, False, False, True, False]
    fresh = TrajectoryIds([brace, word], [0, 1], [0.0] * 2)
    assert copy_targets(fresh, is_value) == [False, False]

    seqs = [encode_demo(d, codec) for d in tiny_demos[:4]]
    ids, attention, labels, plain = collate(seqs, codec.pad_id, is_value, 1.0)
    _, _, _, weighted = collate(seqs, codec.pad_id, is_value, 3.0)
    assert torch.equal(plain, torch.ones_like(plain)) and set(weighted.unique().tolist()) == {1.0, 3.0}
    with torch.no_grad():
        mean = action_token_loss(tiny_model, ids, attention, labels)
        torch.testing.assert_close(action_token_loss(tiny_model, ids, attention, labels, weights=plain), mean)
        logits = tiny_model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        where = labels[:, 1:] != -100
        ce = torch.nn.functional.cross_entropy(logits[where], labels[:, 1:][where], reduction="none")
        w = weighted[:, 1:][where]
        torch.testing.assert_close(
            action_token_loss(tiny_model, ids, attention, labels, weights=weighted),
            (w * ce).sum() / w.sum(),
            atol=1e-5,
            rtol=1e-5,
        )
