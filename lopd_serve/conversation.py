"""OpenAI messages <-> the ids-only chat layer, and how a request continues a session's trajectory.

Why ids: a trace must hold exactly what the model saw and sampled, as a rollout does (lopd_core/model/chat/codec.py).
The conversation is rendered segment by segment through the model's `ChatFormat`: the first turn with
`start(system, user, tools=...)` as the rollout engine does, a tool result with `observation_ids`, a later user
message the same way with the `user` role, an assistant message the client sends back with `action_ids` of the
environment's action syntax. Sampled turns are never rendered again: when a request repeats a session's
messages and the replies it was given, the session's recorded ids (with their action mask and log-probs) are
extended by the new messages only. A request whose history differs (an edited assistant message, another
system or user text, another model version) starts a new trajectory, rendered whole with every earlier reply as
forced ids, and names the one it branched from.

Supported shapes: [system] user (assistant (tool | user))* ending in a user or tool message; one tool call per
assistant message (the chat layer's limit: lopd_core/model/chat/template.py).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

from lopd_core.envs.toolworld.tools import parse_action
from lopd_core.model.chat import IM_END, IM_START, TOOL_CALL, TOOL_CALL_END, TrajectoryIds
from lopd_serve.protocol import ApiError, ChatRequest, Message, utf8_text


def call_text(name: str, arguments: dict) -> str:
    """A tool call in the environment's action syntax (what `decode_action` yields and `action_ids` takes)."""
    return f"{TOOL_CALL}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CALL_END}"


def _arguments(raw: str, where: str) -> dict:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # a string nested past the parser's limit is bad input, not a crash
        raise ApiError(400, f"{where}: arguments are not JSON (or nested too deep)", "invalid_tool_call") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{where}: arguments must be a JSON object", "invalid_tool_call")
    try:  # the string's own escapes may spell a lone surrogate, which the request's check could not see
        return utf8_text(value)
    except ValueError as exc:
        raise ApiError(400, f"{where}: arguments {exc}", "invalid_tool_call") from None


def message_key(role: str, text: str, call: tuple[str, dict] | None) -> str:
    """What identifies a message when a later request repeats it: role, text, and the call (arguments parsed,
    so a client that re-serializes them still matches). Tool-call ids are the client's and are ignored."""
    role = "system" if role == "developer" else role
    return json.dumps([role, "" if call else text, [call[0], call[1]] if call else None], sort_keys=True)


@dataclass
class Parsed:
    """A validated request: its messages as keys (for matching) and the pieces rendering needs."""

    system: str
    user: str
    tools: list[dict]  # OpenAI tool objects ({"type": "function", "function": {...}})
    keys: list[str]
    rest: list[tuple[str, str, tuple[str, dict] | None]] = field(default_factory=list)  # after the first user


def parse_messages(req: ChatRequest, *, max_messages: int) -> Parsed:
    messages: list[Message] = req.messages
    if len(messages) > max_messages:
        raise ApiError(
            400,
            f"{len(messages)} messages: at most {max_messages} per request (serve.max_messages)",
            "too_many_messages",
            param="messages",
        )
    tools = [t.model_dump() for t in req.tools or []]
    declared = {t["function"]["name"] for t in tools}
    if len(declared) != len(tools):
        raise ApiError(400, "tools: two tools share a name", "invalid_tools", param="tools")
    system = ""
    i = 0
    if messages[0].role in ("system", "developer"):
        system, i = messages[0].text(), 1
    if i >= len(messages) or messages[i].role != "user":
        raise ApiError(
            400, "messages: expected [system] then a user message first", "invalid_messages", param="messages"
        )
    parsed = Parsed(
        system,
        messages[i].text(),
        tools,
        [message_key("system", system, None), message_key("user", messages[i].text(), None)],
    )
    _add_rest(parsed, messages, i + 1, declared)
    return parsed


def _add_rest(parsed: Parsed, messages: list[Message], first: int, declared: set[str]) -> None:
    """The messages after the first user message, checked in order (roles alternate; a tool message follows an
    assistant one; a call names a declared tool) and added to `parsed` with their keys."""
    previous = "user"
    for n, m in enumerate(messages[first:], start=first):
        call = None
        if m.role in ("system", "developer"):
            raise ApiError(400, f"messages[{n}]: a system message only comes first", "invalid_messages")
        if m.role == "assistant":
            if previous == "assistant":
                raise ApiError(400, f"messages[{n}]: two assistant messages in a row", "invalid_messages")
            if m.tool_calls:
                if len(m.tool_calls) > 1:
                    raise ApiError(
                        400, f"messages[{n}]: one tool call per assistant message is supported", "invalid_tool_call"
                    )
                fn = m.tool_calls[0].function
                if fn.name not in declared:
                    raise ApiError(
                        400,
                        f"messages[{n}]: tool call to undeclared tool {fn.name!r} (declared: {sorted(declared)})",
                        "undeclared_tool",
                    )
                call = (fn.name, _arguments(fn.arguments, f"messages[{n}].tool_calls[0]"))
        elif m.role == "tool":
            if previous != "assistant":  # after a plain reply too: the rollout engine renders every
                # observation as a tool turn, and a client replaying an environment must be able to send it
                raise ApiError(
                    400, f"messages[{n}]: a tool message must follow an assistant message", "invalid_messages"
                )
        elif previous == "user":
            raise ApiError(400, f"messages[{n}]: two user messages in a row", "invalid_messages")
        previous = m.role if m.role != "tool" else "user"  # a tool result, like a user turn, awaits a reply
        parsed.rest.append((m.role, m.text(), call))
        parsed.keys.append(message_key(m.role, m.text(), call))
    if previous != "user":
        raise ApiError(400, "messages: the last message must be a user or tool message", "invalid_messages")


def followup_ids(chat, role: str, text: str) -> list[int]:
    """Forced ids after an assistant turn's end token: a tool or user turn, then the next assistant header."""
    if role == "tool":
        return chat.observation_ids(text)
    if hasattr(chat, "_render"):  # a model's own template: rendered as `observation_ids` renders a tool turn
        conversation = chat._probe_messages() + [chat._probe_assistant, {"role": "user", "content": text}]
        ids = chat._render(conversation, generation=True)
        return ids[chat._end_after(ids, len(chat._probe_prompt)) + 1 :]
    return chat.encode(f"\n{IM_START}user\n{text}{IM_END}\n{IM_START}assistant\n")


def control_tokens(tokenizer) -> list[str]:
    """The strings the tokenizer reads as one added token each (its special and added tokens): chat framing,
    the experience block's markers, the call syntax."""
    return sorted(t for t in tokenizer.get_added_vocab() if t)


def reply_digest(key: str) -> str:
    """A reply's key, short: what a session keeps of the replies it was given (`refuse_control_tokens`)."""
    return hashlib.sha256(key.encode()).hexdigest()


def refuse_control_tokens(chat, parsed: Parsed, start: int = 0, sampled: Collection[str] = ()) -> None:
    """Refuse client text that would be rendered with a control token in it: the tokenizer reads such a string as
    the token itself, so a user could close its own turn and forge a system, assistant or experience block in
    the ids the trace records. OpenAI treats it as text; the chat layer cannot (it renders text through the
    tokenizer), so it is a 400 rather than a silent rewrite. An assistant message may hold the call syntax: it is
    the model's own action vocabulary (a reply the server returned as content is sent back as such); and a reply
    this session was given (its key's digest in `sampled`) may hold any: the model sampled those tokens itself, and a
    conversation re-rendered after a hot swap or an edit replays it."""
    tokens = control_tokens(chat.tokenizer)
    if not tokens:
        return
    allowed_in_reply = {TOOL_CALL, TOOL_CALL_END}
    pieces: list[tuple[str, str, set]] = []
    if start == 0:
        pieces += [("system message", parsed.system, set()), ("first user message", parsed.user, set())]
        pieces.append(("tools", json.dumps(parsed.tools), set()))
    for n, (role, text, call) in enumerate(parsed.rest[start:], start=start):
        where = f"{role} message #{n + 1} after the first user message"
        if call:
            pieces.append((where + " tool call", json.dumps({"name": call[0], "arguments": call[1]}), set()))
        elif role == "assistant" and reply_digest(parsed.keys[n + 2]) in sampled:
            continue
        else:
            pieces.append((where, text, allowed_in_reply if role == "assistant" else set()))
    for where, text, allowed in pieces:
        found = next((t for t in tokens if t not in allowed and t in text), None)
        if found is not None:
            raise ApiError(
                400,
                f"{where} contains {found!r}, a control token of the model's chat format (it would be read as "
                "framing, not text): remove or escape it",
                "control_token_in_content",
                param="messages",
            )


def render(chat, parsed: Parsed, start: int = 0, sampled: Collection[str] = ()) -> TrajectoryIds:
    """Forced ids of the whole conversation (start == 0), or of its messages from `rest[start]` on; client text
    holding a control token is refused first (`refuse_control_tokens`; `sampled`: digests of the session's replies)."""
    refuse_control_tokens(chat, parsed, start, sampled)
    ids = TrajectoryIds()
    if start == 0:
        tools = [t["function"] for t in parsed.tools] or None
        ids.add_forced(chat.start(parsed.system, parsed.user, tools=tools).token_ids)
    for role, text, call in parsed.rest[start:]:
        if role == "assistant":
            ids.add_forced(chat.action_ids(call_text(*call) if call else text))
        else:
            ids.add_forced(followup_ids(chat, role, text))
    return ids


def reply(chat, sampled: list[int], *, stopped: bool, declared: set[str], tool_choice: str | None):
    """The OpenAI assistant message for a sampled turn, its finish_reason and its key. A call to a declared tool
    (unless tool_choice is "none") becomes `tool_calls`; anything else, a call to an undeclared tool included,
    is content: the server never runs a tool, and never invents one the client did not declare."""
    text = chat.decode_action(sampled)
    kind, name, arguments = parse_action(text)
    if kind == "call" and name in declared and tool_choice != "none":
        call_id = "call_" + uuid.uuid4().hex[:24]
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            ],
        }
        return message, "tool_calls", message_key("assistant", "", (name, arguments))
    finish = "stop" if stopped else "length"
    return {"role": "assistant", "content": text}, finish, message_key("assistant", text, None)
