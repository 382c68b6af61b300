"""Warm start: demonstrations mark only the policy's tokens, the loss is the action-token cross-entropy, and a
few steps on a tiny model lower it."""

import random

import torch

from lopd_core.model.chat import IM_END, ChatCodec
from lopd_core.model.demos import encode_demo
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
    ids, attention, labels = collate(seqs, codec.pad_id)
    assert ((labels != -100) == torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(s.action_mask, dtype=torch.bool) for s in seqs], batch_first=True)).all()
    with torch.no_grad():
        ours = action_token_loss(tiny_model, ids, attention, labels)
        reference = tiny_model(input_ids=ids, attention_mask=attention, labels=labels).loss
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_a_few_steps_lower_the_loss_and_move_every_parameter(tiny_demos, tiny_tokenizer):
    from lopd_core.config import TinyModelConfig
    from lopd_core.model.loading import tiny_qwen3

    torch.manual_seed(0)
    model = tiny_qwen3(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                       intermediate_size=64), tiny_tokenizer)
    codec = ChatCodec(tiny_tokenizer)
    ids, attention, labels = collate([encode_demo(d, codec) for d in tiny_demos[:8]], codec.pad_id)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = action_token_loss(model, ids, attention, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    unmoved = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not unmoved, unmoved


def test_max_steps_runs_exactly_that_many_steps_whatever_the_time_budget(tmp_path):
    """`model.warmstart.max_steps` is how recipes are compared on a busy machine: the time budget (here far too
    small for even one step) no longer cuts the run short."""
    from lopd_core.config import load_params
    from lopd_core.model.warmstart import build_base

    (tmp_path / "p.yaml").write_text("seed: 0\n")
    params = load_params(tmp_path / "p.yaml", ["model.warmstart.demos=40", "model.warmstart.drills=10", "model.tiny.vocab_size=400",
                                "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
                                "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
                                "model.warmstart.time_budget_s=0.001", "model.warmstart.max_steps=3"])
    report = build_base(params, tmp_path / "base", log=lambda m: None)
    assert report.steps == 3
