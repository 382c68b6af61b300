"""The latent teacher acting: embeddings in the prefill play exactly as the ids they stand for.

The shared tiny model answers every prompt with newlines in one turn, which would make any two conditions agree
trivially; these tests use a copy with large random weights, whose greedy actions depend on every context token
and whose episodes run several turns (the later turns' prefills read the embeddings again).
"""

import copy

import pytest
import torch

from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.scoring.teacher import Framing, splice_position
from lopd_core.distill.teacher.teacher_rollout import latent_rollout, task_latents
from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

GREEDY = Sampling(temperature=0.0, max_new_tokens=24, max_context=768)


@pytest.fixture(scope="module")
def tasks():
    return make_tasks("toolworld", "test_id", 4, seed=10)


@pytest.fixture(scope="module")
def scrambled(tiny_model):
    model = copy.deepcopy(tiny_model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def _actions(traj) -> list[int]:
    return [t for t, m in zip(traj.token_ids, traj.action_mask) if m]


def test_plain_embeddings_in_the_prefill_play_as_the_ids(scrambled, tiny_tokenizer, tasks):
    codec = ChatCodec(tiny_tokenizer)
    requests = [RolloutRequest(t) for t in tasks]
    embed = scrambled.get_input_embeddings()
    by_ids = rollout(scrambled, codec, requests, sampling=GREEDY, batch_size=4)
    by_embeds = rollout(
        scrambled,
        codec,
        requests,
        sampling=GREEDY,
        batch_size=4,
        context_embedder=lambda i, ids: embed(torch.tensor(ids)),
    )
    assert [t.token_ids for t in by_embeds] == [t.token_ids for t in by_ids]
    assert [t.reward for t in by_embeds] == [t.reward for t in by_ids]
    assert sum(t.num_turns for t in by_ids) > len(tasks)  # multi-turn: later prefills read embeddings too


def test_latents_equal_to_an_experience_text_play_as_that_text(scrambled, tiny_tokenizer, tasks):
    """The latent slot sits where text experiences sit: latents that are the text's own token embeddings must
    give the teacher the very conversation the text version gives it, so the same greedy actions."""
    codec = ChatCodec(tiny_tokenizer)
    framing = Framing.from_tokenizer(tiny_tokenizer)
    embed = scrambled.get_input_embeddings()
    experience = "Book a table: call search then book. Done."
    latents, text_requests = [], []
    for task in tasks:
        first = codec.start(*_first_turn(task)).token_ids
        with_text = codec.start(*_first_turn(task), [experience]).token_ids
        at = splice_position(first, framing)
        inner = with_text[at + 1 : len(with_text) - (len(first) - at) - 2]  # between <|exp_start|> and <|exp_end|>\n
        assert with_text == first[:at] + [framing.exp_start] + inner + [framing.exp_end, framing.newline] + first[at:]
        latents.append(embed(torch.tensor(inner)).detach())
        text_requests.append(RolloutRequest(task, experiences=(experience,)))
    by_text = rollout(scrambled, codec, text_requests, sampling=GREEDY, batch_size=4)
    by_latents = latent_rollout(
        scrambled, tiny_tokenizer, [RolloutRequest(t) for t in tasks], latents, sampling=GREEDY, batch_size=4
    )
    assert [_actions(t) for t in by_latents] == [_actions(t) for t in by_text]
    assert [t.reward for t in by_latents] == [t.reward for t in by_text]
    plain = rollout(scrambled, codec, [RolloutRequest(t) for t in tasks], sampling=GREEDY, batch_size=4)
    assert [_actions(t) for t in plain] != [_actions(t) for t in by_text]  # the experience changes the play
    assert [t.token_ids for t in by_latents] != [t.token_ids for t in by_text]  # ids stay the student's
    assert all(lt.token_ids[: lt.prompt_length] == p.token_ids[: p.prompt_length] for lt, p in zip(by_latents, plain))


def test_composed_latents_have_the_slot_shape_and_mismatches_are_refused(tiny_model, tiny_tokenizer, tasks):
    torch.manual_seed(0)
    width = tiny_model.config.hidden_size
    composer = Composer(width, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(tiny_model))
    latents = task_latents(tiny_model, tiny_tokenizer, composer, [["a"], ["b", "c"], []], max_tokens=32)
    assert [tuple(x.shape) for x in latents] == [(4, width), (8, width), (0, width)]
    assert not any(x.requires_grad for x in latents)
    with pytest.raises(ValueError, match="latents"):
        latent_rollout(tiny_model, tiny_tokenizer, [RolloutRequest(tasks[0])], [], sampling=GREEDY)
    with pytest.raises(ValueError, match="as latents"):
        latent_rollout(
            tiny_model, tiny_tokenizer, [RolloutRequest(tasks[0], experiences=("x",))], latents[:1], sampling=GREEDY
        )


def _first_turn(task):
    from lopd_core.envs import make_env

    first = make_env(task).reset(task)
    return first.system, first.user
