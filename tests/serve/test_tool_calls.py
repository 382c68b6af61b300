"""A model that calls a tool, through the endpoint: the call comes back as OpenAI `tool_calls`, the client's
tool result extends the same trajectory, and the call's tokens are recorded as actions with their log-probs.

The tiny model is first fitted to one conversation (greedy decoding then writes the call): a random model
almost never produces a well-formed call."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from lopd_core.traces import read_traces
from lopd_serve.conversation import call_text
from tests.serve.conftest import TINY, make_server

SYSTEM = "tools: lookup(key)"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
]


def fitted_caller(tokenizer, folder):
    """A tiny model fitted to answer the first turn with lookup(key=a), and the tool result with "7"."""
    from lopd_core.model.chat import ChatCodec
    from lopd_core.model.loading import tiny_qwen3

    chat = ChatCodec(tokenizer)
    prompt = chat.start(SYSTEM, "find a").token_ids
    call = chat.action_ids(call_text("lookup", {"key": "a"}))
    after = chat.observation_ids("value 7")
    answer = chat.action_ids("7")
    ids = torch.tensor([prompt + call + after + answer])
    supervised = torch.zeros_like(ids, dtype=torch.bool)
    supervised[0, len(prompt) : len(prompt) + len(call)] = True
    supervised[0, len(prompt) + len(call) + len(after) :] = True
    torch.manual_seed(0)
    model = tiny_qwen3(TINY, tokenizer)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits[supervised[:, 1:]], ids[:, 1:][supervised[:, 1:]])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, len(call)


@pytest.mark.slow
def test_a_tool_call_round_trip_is_one_trajectory(tiny_tokenizer, tmp_path):
    folder, call_length = fitted_caller(tiny_tokenizer, tmp_path / "caller")
    with make_server(folder, tmp_path / "traces") as live:
        c = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "find a"}]
        first = c.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=32, user="caller"
        )
        assert first.choices[0].finish_reason == "tool_calls"
        call = first.choices[0].message.tool_calls[0]
        assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"key": "a"}
        none = c.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=32
        )
        assert none.choices[0].message.tool_calls is None and "lookup" in none.choices[0].message.content
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "value 7"},
        ]
        second = c.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=32, user="caller"
        )
        assert second.choices[0].message.content == "7"
        assert second.model_extra["lopd"]["trajectory_id"] == first.model_extra["lopd"]["trajectory_id"]
    traces = read_traces(tmp_path / "traces").set_index("trajectory_id")
    trace = traces.loc[first.model_extra["lopd"]["trajectory_id"]]
    assert trace["num_turns"] == 2 and json.loads(trace["tools"]) == TOOLS
    # the call's ids (its closing token included) and the answer's are the actions, nothing else
    assert sum(trace["action_mask"]) == call_length + second.usage.completion_tokens
    start = trace["prompt_length"]
    assert trace["action_mask"][start : start + call_length] == [1] * call_length
