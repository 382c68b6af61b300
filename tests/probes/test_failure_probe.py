"""The failure probe's bookkeeping (probes/failure_probe.py): exact reproductions, the first wrong token's
kind, and the two "what if" rates, checked with stand-in models whose argmax is known token by token."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.model.demos import encode_demo, play
from probes.failure_probe import classify, convention_positions, drill_exact_share, probe


class ScriptedModel:
    """Predicts the true next token everywhere, except that `wrong(ids, j)` positions predict token 0."""

    def __init__(self, vocab: int, wrong=lambda ids, j: False):
        self.vocab, self.wrong = vocab, wrong

    def __call__(self, ids: torch.Tensor):
        row = ids[0].tolist()
        logits = torch.zeros((1, len(row), self.vocab))
        for t in range(len(row) - 1):
            logits[0, t, 0 if self.wrong(row, t + 1) else row[t + 1]] = 1.0
        return SimpleNamespace(logits=logits)


def _tasks(n=12):
    return make_tasks("toolworld", "test_id", n, 4242)


def test_a_model_that_reproduces_the_oracle_is_exact_everywhere(tiny_tokenizer):
    out = probe(ScriptedModel(len(tiny_tokenizer)), tiny_tokenizer, _tasks())
    assert out["exact"] == 1.0 and out["no_convention_error"] == 1.0 and out["no_other_error"] == 1.0
    assert out["first_error"] == {} and out["wrong_tokens_per_task"] == 0.0


def test_errors_only_at_convention_decisions_are_classed_as_conventions(tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    tasks = _tasks()
    decisions = {}
    for task in tasks:
        seq = encode_demo(play(task)[0], codec)
        decisions[tuple(seq.token_ids)] = convention_positions(task, seq, codec)
    with_decision = sum(bool(d) for d in decisions.values())
    assert with_decision > 0  # some of these tasks do part ways between worlds

    model = ScriptedModel(len(tiny_tokenizer), lambda ids, j: j in decisions.get(tuple(ids), set()))
    out = probe(model, tiny_tokenizer, tasks)
    assert out["first_error"] == {"convention": with_decision}
    assert out["no_other_error"] == 1.0
    assert out["no_convention_error"] == round(1 - with_decision / len(tasks), 3)
    assert out["exact"] == out["no_convention_error"]


def test_classify_tells_copies_from_the_instruction_and_from_observations(tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    task = next(t for t in _tasks(40) if t.template == "bank_balance_answer")
    seq = encode_demo(play(task)[0], codec)
    ids = seq.token_ids
    text = [tiny_tokenizer.decode([i]) for i in ids]
    actions = [j for j in range(len(ids)) if seq.action_mask[j]]
    # the account id in the second call was read from the first observation, not from the instruction
    id_pos = next(j for j in actions[len(actions) // 3 :] if text[j].isdigit())
    assert classify(tiny_tokenizer, ids, id_pos, set()) == "copy_observation"
    assert classify(tiny_tokenizer, ids, id_pos, {id_pos}) == "convention"  # a decision position wins
    first = actions[0]  # `<tool_call>`: in neither the instruction nor an observation
    assert classify(tiny_tokenizer, ids, first, set()) == "other"


def test_drill_share_is_one_for_a_model_that_knows_every_answer(tiny_tokenizer):
    shares = drill_exact_share(ScriptedModel(len(tiny_tokenizer)), tiny_tokenizer, n=30)
    assert set(shares) <= {"copy", "lookup_id", "lookup_value"} and "copy" in shares
    assert all(v == 1.0 for v in shares.values())
    shares = drill_exact_share(ScriptedModel(len(tiny_tokenizer), lambda ids, j: True), tiny_tokenizer, n=30)
    assert all(v == 0.0 for v in shares.values())
