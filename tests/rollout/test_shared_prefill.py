"""Prefilling each distinct context once and forking its KV cache (engine.generate_turn, share_prompts) plays
what prefilling every row does, greedy and sampled, with one sampling stream for the batch and with one per row.

The two paths round differently: the unshared prefill itself gives two identical contexts at different rows of
one batch logits that differ in the last float bit (the matmul kernels block rows by position), and the forked
rows copy one of them; how large the difference is depends on the CPU and the thread count. So the paths are
compared by what must be equal (STYLE habit 12, tests/_float_paths.py): each play's recorded log-probs equal a
full forward pass's to 1e-4 (teacher-forced), and greedy ids agree up to any top-2 margin within 1e-3; a sampled
token is never compared across the paths."""

from functools import partial, wraps
from unittest import mock

import pytest
import torch
from _float_paths import LOGPROB_ATOL, assert_same_play, greedy_clear_turn

from lopd_core.envs import make_env, make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout import engine
from lopd_core.rollout.engine import RolloutRequest, Sampling, generate_turn, rollout

GREEDY = Sampling(temperature=0.0, max_new_tokens=12, max_context=768)
SAMPLED = Sampling(temperature=1.0, top_p=0.9, max_new_tokens=12, max_context=768)


def _requests(tasks: int, samples: int) -> list[RolloutRequest]:
    return [
        RolloutRequest(t, sample_index=g)
        for t in make_tasks("toolworld", "train", tasks, seed=7)
        for g in range(samples)
    ]


def _play(model, codec, requests, sampling, *, shared: bool, per_row: bool):
    seeds = [100 + i for i in range(len(requests))] if per_row else None
    turn = partial(engine.generate_turn, share_prompts=shared)
    with mock.patch.object(engine, "generate_turn", turn):
        return rollout(
            model, codec, requests, sampling=sampling, batch_size=len(requests), seed=3, seeds=seeds, keep_cache=False
        )  # the path that calls generate_turn every turn


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("per_row", [False, True], ids=["batch-stream", "row-streams"])
def test_shared_prefill_plays_what_per_row_prefill_plays(tiny_model, tiny_tokenizer, sampling, per_row):
    codec = ChatCodec(tiny_tokenizer)
    requests = _requests(tasks=3, samples=4)  # 3 prompts of different lengths, 4 samples each
    shared = _play(tiny_model, codec, requests, sampling, shared=True, per_row=per_row)
    plain = _play(tiny_model, codec, requests, sampling, shared=False, per_row=per_row)
    assert_same_play(tiny_model, shared, plain, sampling)
    if sampling.temperature > 0:  # the samples of a task did diverge: the fork gave each row its own cache
        assert len({tuple(t.token_ids) for t in shared[:4]}) > 1


def test_only_identical_contexts_are_prefilled_once(tiny_model, tiny_tokenizer):
    """Two distinct prompts among five rows: two prefill rows; a row with the same ids but other input
    embeddings (a teacher reading other latents) is prefilled on its own."""
    codec = ChatCodec(tiny_tokenizer)
    tasks = make_tasks("toolworld", "train", 2, seed=7)
    firsts = [make_env(t).reset(t) for t in tasks]
    prompts = [codec.start(f.system, f.user).token_ids for f in firsts]
    contexts = [prompts[0], prompts[1], prompts[0], prompts[1], prompts[0]]
    batches = []
    forward = tiny_model.forward

    @wraps(forward)  # keeps the signature the engine inspects for its cache keyword
    def counting(*args, **kwargs):
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if x.shape[1] > 1:
            batches.append(x.shape[0])
        return forward(*args, **kwargs)

    with mock.patch.object(tiny_model, "forward", counting):
        turns = generate_turn(
            tiny_model,
            contexts,
            sampling=GREEDY,
            stop_id=codec.im_end_id,
            pad_id=codec.pad_id,
            generator=torch.Generator().manual_seed(0),
        )
    assert batches == [2]
    # Rows that share a prompt decode the same greedy ids up to any near tie (top-2 margin within 1e-3), and
    # their log-probs agree to 1e-4: identical rows at different places of one batched matmul may differ in the
    # last bit (how much depends on the CPU and the thread count).
    for a, b in ((0, 2), (0, 4), (1, 3)):
        cut = greedy_clear_turn(tiny_model, contexts[a], turns[a][0])
        assert cut > 0 and turns[a][0][:cut] == turns[b][0][:cut]
        if cut == len(turns[a][0]):
            torch.testing.assert_close(torch.tensor(turns[a][1]), torch.tensor(turns[b][1]), atol=LOGPROB_ATOL, rtol=0)

    embed = tiny_model.get_input_embeddings()
    with torch.no_grad():
        same = embed(torch.tensor(prompts[0]))
    other = same.clone()
    other[1] += 1.0
    assert engine._first_with_same_context([prompts[0]] * 3, [same, other, same.clone()]) == [0, 1, 0]
