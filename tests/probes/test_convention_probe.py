"""The convention probe's tag-swap measurement (probes/convention_probe.py), checked with stand-in models that
either read the `[world]` tag or cannot see it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lopd_core.envs import WORLDS, make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.model.demos import Demo, encode_demo, play
from probes.convention_probe import tag_swap


class LookupModel:
    """Puts all its mass on the token its table gives for the prefix (keyed by `key`), else on nothing."""

    def __init__(self, vocab: int, table: dict, key):
        self.vocab, self.table, self.key = vocab, table, key

    def __call__(self, ids: torch.Tensor):
        row = ids[0].tolist()
        logits = torch.zeros((1, len(row), self.vocab))
        nxt = self.table.get(self.key(row))
        if nxt is not None:
            logits[0, -1, nxt] = 50.0
        return SimpleNamespace(logits=logits)


def _tagged(task, world: str | None) -> Demo:
    """The task's demonstration under `world`'s conventions with `world`'s tag (own world when None)."""
    demo = play(task, conventions_world=world)[0]
    if world is None:
        return demo
    return Demo(
        demo.system, demo.user.replace(f"[{task.world}]", f"[{world}]"), (), demo.actions, demo.observations, world
    )


def _table(seqs, key) -> dict:
    return {key(ids[:t]): ids[t] for ids in seqs for t in range(1, len(ids))}


def test_tag_swap_flips_for_a_tag_reader_and_not_for_a_tag_blind_model(tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    tasks = make_tasks("toolworld", "test_id", 10, 4242)
    reader_seqs = [encode_demo(_tagged(t, w if w != t.world else None), codec).token_ids for t in tasks for w in WORLDS]
    reader = LookupModel(len(tiny_tokenizer), _table(reader_seqs, tuple), tuple)
    out = tag_swap(reader, codec, tasks)
    assert out["decisions"] > 0
    assert out["margin_own_tag"] == 1.0 and out["margin_other_tag"] == -1.0

    def untagged(ids):  # the prefix as text with every world's name blanked: the tag carries nothing
        text = tiny_tokenizer.decode(ids)
        for w in WORLDS:
            text = text.replace(f"[{w}]", "[?]")
        return text

    own_seqs = [encode_demo(play(t)[0], codec).token_ids for t in tasks]
    blind = LookupModel(len(tiny_tokenizer), _table(own_seqs, untagged), untagged)
    out = tag_swap(blind, codec, tasks)
    assert out["margin_own_tag"] == out["margin_other_tag"] == 1.0
