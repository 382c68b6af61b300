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

Supported shapes: [system] user (assistant (tool+ | user))* ending in a user or tool message. An assistant
message may hold several tool calls (OpenAI's parallel tool calls), each answered by a tool message naming its id;
the results of one turn render together (`tool_results_ids`), in the order the client sent them.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

from lopd_core.envs.toolworld.tools import parse_calls
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


Call = tuple[str, dict]  # (tool name, arguments)


def message_key(role: str, text: str, calls: tuple[Call, ...] | list[Call] | None = ()) -> str:
    """What identifies a message when a later request repeats it: role, text, and its calls in order (arguments
    parsed, so a client that re-serializes them still matches). Tool-call ids are the client's and are ignored."""
    role = "system" if role == "developer" else role
    return json.dumps([role, text, [[name, arguments] for name, arguments in calls or ()] or None], sort_keys=True)


def action_text(text: str, calls: tuple[Call, ...] | list[Call]) -> str:
    """An assistant message in the environment's action syntax: its text, then each call (several: one per line,
    as tag-style templates write parallel calls)."""
    written = "\n".join(call_text(name, arguments) for name, arguments in calls)
    return f"{text}\n{written}" if text and written else text or written


def recorded_keys(messages: list[dict]) -> list[str]:
    """The keys of a recorded conversation (a trajectory's messages, replies included), as `parse_messages` keys
    the request that repeats it: what a restarted server matches the next request against (resume.py)."""
    keys = [] if messages and messages[0].get("role") in ("system", "developer") else [message_key("system", "")]
    for m in messages:
        content = m.get("content")
        text = "".join(p.get("text", "") for p in content) if isinstance(content, list) else content or ""
        calls = tuple(
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls") or ()
        )
        keys.append(message_key(m["role"], text, calls))
    return keys


@dataclass
class Parsed:
    """A validated request: its messages as keys (for matching) and the pieces rendering needs."""

    system: str
    user: str
    tools: list[dict]  # OpenAI tool objects ({"type": "function", "function": {...}})
    keys: list[str]
    rest: list[tuple[str, str, tuple[Call, ...]]] = field(default_factory=list)  # after the first user


def _check_fields(m: Message, n: int) -> None:
    """The fields OpenAI allows `m`'s role, each with a meaning here: a 400 naming the first one that is not."""
    where = f"messages[{n}]"
    for name in ("name", "refusal", "audio", "function_call"):
        if getattr(m, name) is not None:
            raise ApiError(
                400,
                f"{where}.{name}: not rendered by the model's chat format, so the model would never see it "
                "(leave it out)",
                "unsupported_field",
                param=f"{where}.{name}",
            )
    if m.content is None and m.role != "assistant":
        raise ApiError(400, f"{where}.content: a {m.role} message needs content", "invalid_messages", param=where)
    if m.role == "assistant" and m.content is None and not m.tool_calls:
        raise ApiError(400, f"{where}: an assistant message needs content or tool_calls", "invalid_messages")
    if m.tool_calls is not None and (m.role != "assistant" or not m.tool_calls):
        raise ApiError(
            400, f"{where}.tool_calls: only an assistant message holds calls, one or more", "invalid_messages"
        )
    if m.tool_call_id is not None and m.role != "tool":
        raise ApiError(400, f"{where}.tool_call_id: only a tool message answers a call", "invalid_messages")


def _calls(m: Message, n: int, declared: set[str]) -> tuple[tuple[Call, ...], set[str]]:
    """The calls of an assistant message, and the ids its tool messages must answer."""
    calls, ids = [], []
    for k, tc in enumerate(m.tool_calls or ()):
        fn = tc.function
        if fn.name not in declared:
            raise ApiError(
                400,
                f"messages[{n}].tool_calls[{k}]: call to undeclared tool {fn.name!r} (declared: {sorted(declared)})",
                "undeclared_tool",
            )
        calls.append((fn.name, _arguments(fn.arguments, f"messages[{n}].tool_calls[{k}]")))
        ids.append(tc.id)
    if len(set(ids)) != len(ids):
        raise ApiError(400, f"messages[{n}].tool_calls: two calls share an id", "invalid_tool_call")
    return tuple(calls), set(ids)


def parse_messages(req: ChatRequest, *, max_messages: int) -> Parsed:
    """Check the conversation's shape as OpenAI does, and key and split it for rendering. An assistant message
    with calls must be followed by one tool message per call (`tool_call_id` naming it, in any order); a tool
    message after a plain reply is an observation (the rollout engine renders every one as a tool turn)."""
    messages: list[Message] = req.messages
    if len(messages) > max_messages:
        raise ApiError(
            400,
            f"{len(messages)} messages: at most {max_messages} per request (serve.max_messages)",
            "too_many_messages",
            param="messages",
        )
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    declared = {t["function"]["name"] for t in tools}
    if len(declared) != len(tools):
        raise ApiError(400, "tools: two tools share a name", "invalid_tools", param="tools")
    for n, m in enumerate(messages):
        _check_fields(m, n)
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
        [message_key("system", system), message_key("user", messages[i].text())],
    )
    _add_rest(parsed, messages, i + 1, declared)
    return parsed


def _add_rest(parsed: Parsed, messages: list[Message], first: int, declared: set[str]) -> None:
    """The messages after the first user message, checked in order (roles alternate; a tool message follows an
    assistant one; a call names a declared tool) and added to `parsed` with their keys."""
    previous = "user"
    awaiting: set[str] = set()  # call ids of the last assistant message no tool message answered yet
    answers_calls = False  # the tool messages in a row answer an assistant message's calls
    for n, m in enumerate(messages[first:], start=first):
        calls: tuple[Call, ...] = ()
        if awaiting and m.role != "tool":
            raise ApiError(
                400,
                f"messages[{n}]: the calls {sorted(awaiting)} of the assistant message before have no tool message",
                "invalid_messages",
            )
        if m.role in ("system", "developer"):
            raise ApiError(400, f"messages[{n}]: a system message only comes first", "invalid_messages")
        if m.role == "assistant":
            if previous == "assistant":
                raise ApiError(400, f"messages[{n}]: two assistant messages in a row", "invalid_messages")
            calls, awaiting = _calls(m, n, declared)
            answers_calls = bool(calls)
        elif m.role == "tool":
            if answers_calls:
                if m.tool_call_id not in awaiting:
                    raise ApiError(
                        400,
                        f"messages[{n}].tool_call_id: {m.tool_call_id!r} answers no open call of the assistant "
                        f"message before (open: {sorted(awaiting)})",
                        "invalid_messages",
                        param=f"messages[{n}].tool_call_id",
                    )
                awaiting.discard(m.tool_call_id)
            elif previous != "assistant":
                raise ApiError(
                    400, f"messages[{n}]: a tool message must follow an assistant message", "invalid_messages"
                )
        elif previous in ("user", "tool"):
            raise ApiError(400, f"messages[{n}]: two user messages in a row", "invalid_messages")
        previous = m.role
        parsed.rest.append((m.role, m.text(), calls))
        parsed.keys.append(message_key(m.role, m.text(), calls))
    if awaiting:
        raise ApiError(
            400,
            f"messages: the calls {sorted(awaiting)} of the last assistant message have no tool message",
            "invalid_messages",
        )
    if previous == "assistant":
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
    for n, (role, text, calls) in enumerate(parsed.rest[start:], start=start):
        where = f"{role} message #{n + 1} after the first user message"
        if role == "assistant" and reply_digest(parsed.keys[n + 2]) in sampled:
            continue
        for name, arguments in calls:
            pieces.append((where + " tool call", json.dumps({"name": name, "arguments": arguments}), set()))
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
    rest, n = parsed.rest, start
    while n < len(rest):
        role, text, calls = rest[n]
        if role == "assistant":
            ids.add_forced(_action_ids(chat, text, calls, n))
        elif role == "tool":  # the results of one turn's calls render together (a template may group them)
            results = [text]
            while n + 1 < len(rest) and rest[n + 1][0] == "tool":
                n += 1
                results.append(rest[n][1])
            ids.add_forced(chat.tool_results_ids(results) if len(results) > 1 else chat.observation_ids(text))
        else:
            ids.add_forced(followup_ids(chat, role, text))
        n += 1
    return ids


def _action_ids(chat, text: str, calls: tuple[Call, ...], n: int) -> list[int]:
    """An assistant message's forced ids; several calls only where the chat format can write them: a bare-JSON
    call syntax (Llama 3) holds one call per message, and its templates drop or refuse the others."""
    refused = ApiError(
        400,
        f"assistant message #{n + 1} after the first user message: the model's chat format cannot write "
        f"{len(calls)} calls in one turn",
        "invalid_tool_call",
    )
    syntax = getattr(chat, "syntax", None)
    if len(calls) > 1 and getattr(chat, "renders_tool_calls", False) and syntax is not None and not syntax.open:
        raise refused
    try:
        return chat.action_ids(action_text(text, calls))
    except Exception:  # a template's own refusal (Llama 3.1's: one call per turn)
        if len(calls) < 2:
            raise
        raise refused from None


def reply(
    chat,
    sampled: list[int],
    *,
    stopped: bool,
    declared: set[str],
    tool_choice: str | None,
    parallel=True,
    stop_string: str | None = None,
    verbatim: bool = False,
):
    """The OpenAI assistant message for a sampled turn, its finish_reason and its key. A turn a stop string ended
    is its text up to the stop string (left out, as OpenAI does), finish_reason "stop". A `verbatim` turn (a
    constrained JSON answer) is its text as it decodes: no call syntax is read into it. Calls to declared tools
    (unless tool_choice is "none"), one or several, become `tool_calls`, with the text beside them as content;
    anything else, a turn with a call to an undeclared tool or a malformed one included, is content: the server
    never runs a tool, and never invents one the client did not declare. With `parallel` false (the request's
    `parallel_tool_calls`), a turn holding several calls returns the first (as vLLM does); the trace keeps every
    sampled token."""
    if verbatim:
        ids = sampled[:-1] if sampled and sampled[-1] == chat.im_end_id else sampled
        text = chat.tokenizer.decode(ids, skip_special_tokens=False)
    else:
        text = chat.decode_action(sampled)
    if stop_string is not None and stop_string in text:
        text = text[: text.index(stop_string)]
    found = None if verbatim else parse_calls(text)
    if found and found[1] and all(name in declared for name, _ in found[1]) and tool_choice != "none":
        content, calls = found[0], found[1] if parallel else found[1][:1]
        message = {
            "role": "assistant",
            "content": content or None,
            "tool_calls": [
                {
                    "id": "call_" + uuid.uuid4().hex[:24],
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
                for name, arguments in calls
            ],
        }
        return message, "tool_calls", message_key("assistant", content, tuple(calls))
    finish = "stop" if stopped or stop_string is not None else "length"
    return {"role": "assistant", "content": text}, finish, message_key("assistant", text)
