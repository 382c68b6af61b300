"""Several tool calls in one assistant turn (OpenAI's `parallel_tool_calls`, issue #39 item 6): accepted in the
history, produced by the model where its chat format writes them, recorded, and replayed token-exact into
training — the trace's ids for each turn are the ids the server rendered and sampled for it.

The end-to-end test fits the tiny model to one conversation first (greedy decoding then writes both calls),
as tests/serve/test_tool_calls.py does for one call."""

from __future__ import annotations

import json

import httpx
import torch

from lopd_core.envs.toolworld.tools import parse_calls
from lopd_core.model.chat import CHAT_TEMPLATE, ChatCodec
from lopd_core.traces import as_trajectories, read_traces, trace_table
from lopd_core.traces.schema import episode_records
from lopd_serve.conversation import action_text, call_text, parse_messages, render, reply
from lopd_serve.protocol import ChatRequest
from tests.serve.conftest import TINY, make_server

SYSTEM = "tools: lookup(key)"
PARAMETERS = {"type": "object", "properties": {}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": PARAMETERS}}]
CALLS = [("lookup", {"key": "a"}), ("lookup", {"key": "b"})]


def _call(cid: str, name: str, arguments: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_several_calls_in_one_message_are_parsed_in_order():
    text = "Looking both up.\n" + action_text("", CALLS)
    assert parse_calls(text) == ("Looking both up.", CALLS)
    assert parse_calls("just text") == ("just text", [])
    assert parse_calls(call_text("lookup", {}) + "<tool_call>{bad") is None  # one malformed call: all text
    assert parse_calls(call_text("lookup", {}) + " </tool_call>") is None


def test_the_models_parallel_calls_come_back_as_tool_calls_and_match_their_echo(tiny_tokenizer):
    chat = ChatCodec(tiny_tokenizer)
    sampled = chat.action_ids(action_text("", CALLS))
    message, finish, key = reply(chat, sampled, stopped=True, declared={"lookup"}, tool_choice="auto")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == CALLS
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    # the client sends the turn back with both results: its key is the reply's, so the trajectory is extended
    history = [
        {"role": "user", "content": "q"},
        {**message, "tool_calls": [{**c, "id": f"mine-{k}"} for k, c in enumerate(message["tool_calls"])]},
        {"role": "tool", "tool_call_id": "mine-0", "content": "7"},
        {"role": "tool", "tool_call_id": "mine-1", "content": "8"},
    ]
    assert parse_messages(ChatRequest(messages=history, tools=TOOLS), max_messages=10).keys[2] == key
    # with parallel_tool_calls false, the first call only (vLLM's behaviour)
    first, _, _ = reply(chat, sampled, stopped=True, declared={"lookup"}, tool_choice="auto", parallel=False)
    assert len(first["tool_calls"]) == 1
    undeclared, finish, _ = reply(chat, sampled, stopped=True, declared={"other"}, tool_choice="auto")
    assert finish == "stop" and "lookup" in undeclared["content"]


def test_a_history_of_parallel_calls_renders_as_the_chat_template_does(tiny_tokenizer):
    chat = ChatCodec(tiny_tokenizer)
    calls = [_call("c0", *CALLS[0]), _call("c1", *CALLS[1])]
    req = ChatRequest(
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "find a and b"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c0", "content": "7"},
            {"role": "tool", "tool_call_id": "c1", "content": "8"},
        ],
        tools=TOOLS,
    )
    ids = render(chat, parse_messages(req, max_messages=10))
    as_text = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "find a and b"},
        {"role": "assistant", "content": action_text("", CALLS)},
        {"role": "tool", "content": "7"},
        {"role": "tool", "content": "8"},
    ]
    template = tiny_tokenizer.apply_chat_template(
        as_text, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    # the embedded template ends each turn with a newline; the ids put it after the closing token too
    assert tiny_tokenizer.decode(ids.token_ids, skip_special_tokens=False) == template
    assert ids.token_ids == chat.encode(template) and not any(ids.action_mask)


def test_a_tag_style_template_renders_and_reads_parallel_calls_as_it_writes_them():
    """A model's own template that writes `<tool_call>` tags (Hermes/Qwen-like): a history of two calls and
    their results is what `apply_chat_template` gives, and two calls the model writes come back as two."""
    from lopd_core.model.chat.template import TemplateChat
    from lopd_core.model.loading import add_experience_tokens
    from tests.model._foreign_tokenizers import hermes_tokenizer

    tok = hermes_tokenizer()
    add_experience_tokens(tok)
    chat = TemplateChat(tok)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "find a and b"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c0", *CALLS[0]), _call("c1", *CALLS[1])]},
        {"role": "tool", "tool_call_id": "c0", "content": "7"},
        {"role": "tool", "tool_call_id": "c1", "content": "8"},
    ]
    ids = render(chat, parse_messages(ChatRequest(messages=messages, tools=TOOLS), max_messages=10))
    as_template = [dict(m) for m in messages]
    as_template[2] = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in CALLS],
    }
    expected = tok.apply_chat_template(
        as_template,
        tools=[{"type": "function", "function": {"name": "lookup", "description": "", "parameters": PARAMETERS}}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **chat.template_kwargs,
    )
    assert ids.token_ids == list(expected)
    message, finish, _ = reply(
        chat, chat.action_ids(action_text("", CALLS)), stopped=True, declared={"lookup"}, tool_choice="auto"
    )
    assert finish == "tool_calls" and len(message["tool_calls"]) == 2


def _fitted_parallel_caller(tokenizer, folder):
    """A tiny model fitted to answer "find a and b" with two lookups in one turn, and the two results with 15."""
    from lopd_core.model.loading import tiny_qwen3

    chat = ChatCodec(tokenizer)
    prompt = chat.start(SYSTEM, "find a and b").token_ids
    calls = chat.action_ids(action_text("", CALLS))
    results = chat.tool_results_ids(["value 7", "value 8"])
    answer = chat.action_ids("15")
    ids = torch.tensor([prompt + calls + results + answer])
    supervised = torch.zeros_like(ids, dtype=torch.bool)
    supervised[0, len(prompt) : len(prompt) + len(calls)] = True
    supervised[0, len(prompt) + len(calls) + len(results) :] = True
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
    return folder, results


def test_the_model_writes_two_calls_and_training_replays_the_served_ids(tiny_tokenizer, tmp_path):
    folder, results = _fitted_parallel_caller(tiny_tokenizer, tmp_path / "caller")
    store = tmp_path / "traces"
    with make_server(folder, store) as live:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "find a and b"}]
        body = {"messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 48, "return_token_ids": True}
        first = httpx.post(live.url + "/chat/completions", json={**body, "user": "p"}, timeout=60).json()
        message = first["choices"][0]["message"]
        assert first["choices"][0]["finish_reason"] == "tool_calls", first
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == CALLS
        streamed = httpx.post(live.url + "/chat/completions", json={**body, "stream": True}, timeout=60).text
        deltas = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
        indexes = [c["index"] for e in deltas for c in e["choices"][0]["delta"].get("tool_calls", [])]
        assert indexes == [0, 1]  # a stream sends both calls, each with its index

        ids = [c["id"] for c in message["tool_calls"]]
        messages += [
            message,
            {"role": "tool", "tool_call_id": ids[0], "content": "value 7"},
            {"role": "tool", "tool_call_id": ids[1], "content": "value 8"},
        ]
        second = httpx.post(
            live.url + "/chat/completions", json={**body, "messages": messages, "user": "p"}, timeout=60
        ).json()
        assert second["choices"][0]["message"]["content"] == "15"
        assert second["lopd"]["trajectory_id"] == first["lopd"]["trajectory_id"]  # the same trajectory
        label = {"session": "p", "reward": 1.0, "success": True}
        assert httpx.post(live.url + "/feedback", json=label, timeout=30).status_code == 200

    # what the server rendered and sampled, turn by turn: the prompt, both calls, both results, the answer
    served = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    assert second["prompt_token_ids"] == served + results
    served = second["prompt_token_ids"] + second["choices"][0]["token_ids"]
    trace = read_traces(store).set_index("trajectory_id").loc[first["lopd"]["trajectory_id"]]
    assert list(trace["token_ids"]) == served and trace["num_turns"] == 2
    sampled = len(first["choices"][0]["token_ids"]) + len(second["choices"][0]["token_ids"])
    assert sum(trace["action_mask"]) == sampled and trace["success"]
    # replayed into training: the trajectory a distillation step reads holds exactly those ids
    (trajectory,) = [t for t in as_trajectories(trace_table(store)) if t.task.task_id == trace.name]
    assert trajectory.token_ids == served and trajectory.action_mask == list(trace["action_mask"])
    assert episode_records(json.loads(trace["messages"]))[:2] == [
        {"call": {"name": "lookup", "arguments": {"key": "a"}}, "observation": "value 7"},
        {"call": {"name": "lookup", "arguments": {"key": "b"}}, "observation": "value 8"},
    ]


def test_a_bare_json_call_syntax_refuses_several_calls_in_one_turn():
    """Llama 3's syntax is one JSON object per message: several calls cannot be written, so a history holding
    them is a 400 rather than a rendering that drops all but one."""
    import pytest

    from lopd_core.model.chat.template import TemplateChat
    from lopd_core.model.loading import add_experience_tokens
    from lopd_serve.protocol import ApiError
    from tests.model._foreign_tokenizers import llama_tokenizer

    tok = llama_tokenizer()
    add_experience_tokens(tok)
    chat = TemplateChat(tok)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "find a and b"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c0", *CALLS[0]), _call("c1", *CALLS[1])]},
        {"role": "tool", "tool_call_id": "c0", "content": "7"},
        {"role": "tool", "tool_call_id": "c1", "content": "8"},
    ]
    with pytest.raises(ApiError, match="cannot write 2 calls"):
        render(chat, parse_messages(ChatRequest(messages=messages, tools=TOOLS), max_messages=10))
    one = messages[:3] + messages[3:4]
    one[2] = {**one[2], "tool_calls": one[2]["tool_calls"][:1]}
    assert render(chat, parse_messages(ChatRequest(messages=one, tools=TOOLS), max_messages=10)).token_ids
