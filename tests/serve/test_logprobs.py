"""Log-probs and token ids over the API equal the engine's: the completions endpoint on token ids (sampled ids,
their log-probs, top-k, vLLM's `return_token_ids` and "token_id:N" tokens), chat's `logprobs`, and prompt scoring
(`prompt_logprobs`) equal to the in-process teacher pass at the action tokens."""

from __future__ import annotations

import httpx
import openai
import torch
from _float_paths import check_stream_picks, full_forward_logits

from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.decode import generate_turn, sampling_logprobs
from lopd_core.rollout.served_scoring import action_topk, served_scores
from lopd_core.rollout.trajectory import Sampling
from lopd_core.traces import read_traces
from lopd_serve.models import load_checkpoint


def _prompt(tokenizer) -> list[int]:
    task = make_tasks("toolworld", "test_id", 1, seed=3)[0]
    return ChatCodec(tokenizer).start("tools: lookup(key)", task.instruction).token_ids


def _engine_turn(model, chat, prompt, *, top_k: int, temperature: float = 0.0, seed: int = 0):
    tops = []
    [(ids, lps)] = generate_turn(
        model,
        [prompt],
        sampling=Sampling(temperature=temperature, max_new_tokens=12),
        stop_id=chat.im_end_id,
        pad_id=chat.pad_id,
        generator=[torch.Generator().manual_seed(seed)],
        on_token=lambda row, t, lp, top: tops.append(top),
        top_logprobs=top_k,
    )
    return ids, lps, tops


def test_completions_on_ids_return_the_engines_ids_logprobs_and_topk(live, tiny_checkpoints):
    loaded = load_checkpoint(tiny_checkpoints[0], device="cpu")
    prompt = _prompt(loaded.tokenizer)
    for temperature, seed in ((0.0, 0), (0.8, 17)):  # greedy, and sampled with the request's seed
        ids, lps, tops = _engine_turn(loaded.model, loaded.chat, prompt, top_k=3, temperature=temperature, seed=seed)
        r = httpx.post(
            live.url + "/completions",
            json={
                "model": "a",
                "prompt": prompt,
                "max_tokens": 12,
                "temperature": temperature,
                "seed": seed,
                "logprobs": 3,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        served, got = choice["token_ids"], choice["logprobs"]
        assert choice["prompt_token_ids"] == prompt and got["tokens"] == [f"token_id:{t}" for t in served]
        # The server decodes in a continuous batch, the engine a turn alone: two float paths (STYLE habit 12).
        # Each turn is what the request's stream picks from one full forward pass's distribution (greedy: its
        # argmax) up to the first draw near an edge (tests/_float_paths.py), so the two agree on that prefix,
        # and there the log-probs agree to 1e-5 and the top-3 ids wherever no near tie (1e-4) can swap them.
        sampling = Sampling(temperature=temperature, max_new_tokens=12)
        cut = min(check_stream_picks(loaded.model, prompt, turn, sampling, seed) for turn in (served, ids))
        assert cut >= 0.9 * len(ids) and served[:cut] == ids[:cut]
        assert max(abs(a - b) for a, b in zip(got["token_logprobs"][:cut], lps[:cut])) < 1e-5
        logits, _ = full_forward_logits(loaded.model, prompt + ids, [0] * len(prompt) + [1] * len(ids))
        full = sampling_logprobs(logits, sampling).topk(4, dim=-1)  # (N, 4): the shown 3 and the next one
        for n, (served_top, engine_top) in enumerate(zip(got["top_logprobs"][:cut], tops[:cut])):
            assert max(abs(v - lp) for v, (_, lp) in zip(served_top.values(), engine_top)) < 1e-5
            gaps = full.values[n, :-1] - full.values[n, 1:]  # (3,) each rank's gap to the next
            for rank, (served_id, (engine_id, _)) in enumerate(zip(served_top, engine_top)):
                if gaps[rank] > 1e-4 and (rank == 0 or gaps[rank - 1] > 1e-4):
                    assert served_id == f"token_id:{engine_id}" == f"token_id:{int(full.indices[n, rank])}"


def test_chat_logprobs_are_the_recorded_ones(live):
    c = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0)
    r = c.chat.completions.create(
        model="a",
        messages=[{"role": "user", "content": "find key a"}],
        max_tokens=8,
        seed=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
        extra_headers={"X-Session-Id": "lp"},
    )
    content = r.choices[0].logprobs.content
    token_ids = r.choices[0].model_extra["token_ids"]
    assert [e.token for e in content] == [f"token_id:{t}" for t in token_ids]
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    trace = read_traces(live.app.state.store.dir).set_index("trajectory_id").loc[r.model_extra["lopd"]["trajectory_id"]]
    recorded = [lp for lp, m in zip(trace["sample_logprobs"], trace["action_mask"]) if m]
    assert len(recorded) == len(content)
    assert max(abs(e.logprob - lp) for e, lp in zip(content, recorded)) < 1e-6


def test_prompt_scoring_equals_the_in_process_teacher_pass(live, tiny_checkpoints):
    from lopd_core.distill.scoring.teacher import action_logits, build_batch

    loaded = load_checkpoint(tiny_checkpoints[0], device="cpu")
    prompt = _prompt(loaded.tokenizer)
    ids, _, _ = _engine_turn(loaded.model, loaded.chat, prompt, top_k=0)
    sequences = [prompt + ids, prompt + ids[:3]]
    masks = [[0] * len(prompt) + [1] * (len(s) - len(prompt)) for s in sequences]
    with torch.no_grad():
        logprobs = torch.log_softmax(action_logits(loaded.model, build_batch(loaded.model, sequences, masks)), -1)
    want_values = logprobs.topk(5, dim=-1).values  # (N, 5)
    want_taken = logprobs.gather(
        -1, torch.tensor([t for s, m in zip(sequences, masks) for t, on in zip(s, m) if on])[:, None]
    ).squeeze(-1)
    values, indices, taken = action_topk(served_scores([live.url], sequences, top_k=5), masks)
    # Served scoring (one sequence alone) and the teacher pass (a padded batch) are two float paths: the top-5
    # are compared by value to 1e-5, and each served id must carry its served value in the teacher pass, so it
    # is a top-5 id up to ties within 1e-5 (comparing the ids themselves would fail on a near tie's last bit).
    assert torch.allclose(values, want_values, atol=1e-5) and torch.allclose(taken, want_taken, atol=1e-5)
    assert torch.allclose(logprobs.gather(-1, indices), values, atol=1e-5)


def test_completions_limits_are_4xx(live, tiny_checkpoints):
    def post(**body):
        return httpx.post(live.url + "/completions", json={"model": "a", "prompt": [1, 2, 3], **body}, timeout=30)

    assert post(prompt=[10**9]).json()["error"]["code"] == "invalid_token_id"
    assert post(logprobs=10**3).json()["error"]["param"] == "logprobs"
    assert post(stream=True).status_code == 400
    assert post(stop_token_ids=[5, 6]).json()["error"]["param"] == "stop_token_ids"
    assert post(prompt=[[1, 2], [3]]).status_code == 400
    assert post(max_tokens=1, echo=True, logprobs=1).status_code == 200
