"""Rendering and replies in ids: a served conversation's ids are the rollout engine's for the same turns, and a
sampled tool call comes back as OpenAI `tool_calls` only for a declared tool."""

from __future__ import annotations

import json

import pytest

from lopd_core.model.chat import ChatCodec
from lopd_serve.conversation import call_text, parse_messages, render, reply
from lopd_serve.protocol import ChatRequest

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def test_render_matches_the_engine_layout(tiny_tokenizer):
    chat = ChatCodec(tiny_tokenizer)
    call = {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"key": "a"})}}
    req = ChatRequest(
        messages=[
            {"role": "system", "content": "tools: lookup(key)"},
            {"role": "user", "content": "find a"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "7"},
        ],
        tools=TOOLS,
    )
    ids = render(chat, parse_messages(req, max_messages=10))
    # what the rollout engine builds for the same episode: start, the action closed by <|im_end|>, observation
    expected = chat.start("tools: lookup(key)", "find a").token_ids
    expected += chat.action_ids(call_text("lookup", {"key": "a"})) + chat.observation_ids("7")
    assert ids.token_ids == expected and not any(ids.action_mask)


def test_reply_maps_calls_to_declared_tools_only(tiny_tokenizer):
    chat = ChatCodec(tiny_tokenizer)
    sampled = chat.action_ids(call_text("lookup", {"key": "a"}))
    message, finish, _ = reply(chat, sampled, stopped=True, declared={"lookup"}, tool_choice="auto")
    assert finish == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "lookup"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"key": "a"}
    message, finish, _ = reply(chat, sampled, stopped=True, declared={"other"}, tool_choice="auto")
    assert finish == "stop" and "lookup" in message["content"]  # never a call to an undeclared tool
    message, finish, _ = reply(chat, sampled, stopped=True, declared={"lookup"}, tool_choice="none")
    assert finish == "stop" and message["content"]
    message, finish, _ = reply(chat, chat.encode("partial"), stopped=False, declared=set(), tool_choice=None)
    assert finish == "length"


def test_an_echoed_tool_call_matches_the_reply_it_came_from(tiny_tokenizer):
    """A client sends the call back with its own id and re-serialized arguments: still the same message."""
    chat = ChatCodec(tiny_tokenizer)
    sampled = chat.action_ids(call_text("lookup", {"key": "a", "n": 2}))
    _, _, key = reply(chat, sampled, stopped=True, declared={"lookup"}, tool_choice="auto")
    echoed = {
        "role": "assistant",
        "tool_calls": [
            {"id": "mine", "type": "function", "function": {"name": "lookup", "arguments": '{"n":2,  "key":"a"}'}}
        ],
    }
    req = ChatRequest(
        messages=[{"role": "user", "content": "q"}, echoed, {"role": "tool", "tool_call_id": "mine", "content": "7"}],
        tools=TOOLS,
    )
    assert parse_messages(req, max_messages=10).keys[2] == key


@pytest.mark.parametrize("builder", ["hermes", "llama"])
def test_a_later_user_turn_renders_as_the_models_own_template(builder):
    """With a model's own chat template, the whole forced conversation, a second user message included, is
    what `apply_chat_template` gives for it."""
    from lopd_core.model.chat.template import TemplateChat
    from lopd_core.model.loading import add_experience_tokens
    from tests.model._foreign_tokenizers import hermes_tokenizer, llama_tokenizer

    tok = {"hermes": hermes_tokenizer, "llama": llama_tokenizer}[builder]()
    add_experience_tokens(tok)
    chat = TemplateChat(tok)
    messages = [
        {"role": "system", "content": "tools: lookup(key)"},
        {"role": "user", "content": "find a"},
        {"role": "assistant", "content": "It is 7."},
        {"role": "user", "content": "and b?"},
    ]
    ids = render(chat, parse_messages(ChatRequest(messages=messages), max_messages=10))
    expected = list(
        tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **chat.template_kwargs
        )
    )
    assert ids.token_ids == expected
