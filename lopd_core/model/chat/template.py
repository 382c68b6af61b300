"""A model's own chat template, spoken in token ids: any causal LM rolls out and is supervised in its format.

Why: `model.name_or_path` accepts any causal LM, and a pretrained model acts well only in the format it was
tuned on: its turn headers, its end-of-turn token, its tool-call syntax. `TemplateChat` gives the rollout
engine, the trainer and the teacher the same interface as the embedded `ChatCodec`, but every forced segment
comes from the tokenizer's own `apply_chat_template`:
  * the first turn is render([system, user], add_generation_prompt=True);
  * after an action, the observation is render([..., assistant, tool], add_generation_prompt=True) from the
    token right after the assistant turn's end token on — the tool turn and the next assistant header;
  * a demonstration action is render([..., assistant]) between the generation prompt and the end token;
so a trajectory's ids are the ones `apply_chat_template` produces for the same conversation (a test checks it
for two templates). Segments are cut only at the end-of-turn token (a special token), which no tokenizer merges
across; the one boundary inside ordinary text, generation prompt -> first action token, holds for tokenizers
that split newlines off the words after them (Llama 3, Qwen2 and ours do).

The environment speaks one action syntax, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` or a final
answer (lopd_core/envs/toolworld/tools.py). The model's syntax is learned from the template itself: it renders
a probe assistant message with `tool_calls` and reads what wraps the JSON (Hermes/Qwen3: `<tool_call>` tags;
Llama 3: a bare JSON object with `parameters`). `decode_action` translates the model's call into the
environment's, `action_ids` the other way.

Experiences sit at the head of the first user turn's content, between `<|exp_start|>` and `<|exp_end|>` as in
the embedded format; the tokenizer gets those tokens from `add_experience_tokens` (lopd_core/model/loading.py).
`user_header` is the id run that ends where the first user turn's content begins: the latent teacher splices
there (lopd_core/distill/scoring/teacher.py). Construction checks on a probe that the splice of an experience block into
a plain conversation is exactly the conversation rendered with it.

Several tool calls in one turn (a served conversation's parallel calls) render as the template writes them, where
it writes tool-call tags (Hermes, Qwen); environments take one call per turn. Not supported: templates that
rewrite earlier turns (Qwen3 drops past `<think>` blocks), several calls in a bare-JSON syntax (Llama 3), a
tool-call end token other than the turn's end (Llama 3.1's `<|eom_id|>`).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass

from lopd_core.envs.toolworld.tools import parse_calls
from lopd_core.model.chat.codec import EXP_END, EXP_START, TOOL_CALL, TOOL_CALL_END, TrajectoryIds, experience_block

PROBE_SYSTEM = "tools: probe_tool(probe_arg)"
PROBE_USER = "Find the answer."
PROBE_ANSWER = "Done."
PROBE_CALL = {"name": "probe_tool", "arguments": {"probe_arg": "probe value"}}
PROBE_OBSERVATION = '{"result": "probe observation"}'
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe_tool",
            "description": "A probe.",
            "parameters": {
                "type": "object",
                "properties": {"probe_arg": {"type": "string"}},
                "required": ["probe_arg"],
            },
        },
    }
]
# Extra template variables tried, in order, when tools do not stay in the system turn: Llama 3.1's template
# puts them in the first user message unless told otherwise, which would move the latent slot.
TOOL_PLACEMENTS: tuple[dict, ...] = ({}, {"tools_in_user_message": False})
THINK_BLOCK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


def check_chat_format(tokenizer, source: str):
    """The chat format `source`'s tokenizer speaks, probed once at load (`load_policy`), or ChatTemplateError: one
    line naming the model folder. Why: a foreign tokenizer without a template used to run silently in the
    embedded format (no stop token of its own), and a template that raised, read an undefined variable or could
    not render the `tool` role failed at the first rollout or the first tool call, deep in jinja."""
    from lopd_core.errors import ChatTemplateError
    from lopd_core.model.chat.codec import EXP_START, IM_END, IM_START, ChatCodec, is_embedded_format

    if is_embedded_format(tokenizer):
        missing = [t for t in (IM_START, IM_END, EXP_START, EXP_END) if t not in tokenizer.get_vocab()]
        if missing:
            raise ChatTemplateError(
                f"model {source!r}: its tokenizer has no chat template and is not the embedded base's (it lacks "
                f"{', '.join(missing)}): give it the chat template it was tuned with (`chat_template` in "
                "tokenizer_config.json, or chat_template.jinja beside it)"
            )
        return ChatCodec(tokenizer)
    try:
        return TemplateChat(tokenizer)
    except Exception as exc:  # noqa: BLE001  jinja syntax errors, undefined variables, raise_exception, probes
        raise ChatTemplateError(
            f"model {source!r}: its chat template cannot be used: {type(exc).__name__}: {_first_line(exc)}"
        ) from None


def toolworld_schemas(system: str) -> list[dict] | None:
    """The JSON schemas of the tools a toolworld system text lists (`tools: bank_transfer(src,dst,amount) ...`),
    in the form `apply_chat_template(tools=...)` takes; None when the text is anything else. The environment
    hands the rollout only its system text, so this is where the schemas behind it are found again."""
    if not system.startswith("tools: "):
        return None
    from lopd_core.envs import DOMAINS, tool_schemas

    known = {s["name"]: s for domain in DOMAINS for s in tool_schemas(domain)}
    names = [signature.split("(", 1)[0] for signature in system[len("tools: ") :].split()]
    if not names or any(name not in known for name in names):
        return None
    return [{"type": "function", "function": known[name]} for name in names]


def tool_call_message(name: str, arguments: dict) -> dict:
    """An assistant message carrying one tool call, in the structured form chat templates read."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


@dataclass(frozen=True)
class ToolCallSyntax:
    """How a model writes a tool call: the text around the JSON object and the key of its arguments.

    `open == ""` means a bare JSON object as the whole message (Llama 3)."""

    open: str
    close: str
    arguments_key: str

    def to_canonical(self, text: str) -> str:
        """The environment's text for a model message. A call attempt the environment must reject (malformed
        JSON, no closing tag) is still handed over as a call, so the error it returns says why."""
        if not self.open:
            return self._bare_to_canonical(text)
        start = text.find(self.open)
        if start < 0:
            return text  # an answer
        end = text.find(self.close, start + len(self.open))
        if end < 0:
            return text[:start] + TOOL_CALL + text[start + len(self.open) :]  # unclosed: the env says so
        if text.find(self.open, end) >= 0:  # several calls: the env rejects them, in its own syntax
            return text.replace(self.open, TOOL_CALL).replace(self.close, TOOL_CALL_END)
        body = text[start + len(self.open) : end]
        return text[:start] + self._call(body) + text[end + len(self.close) :]

    def _bare_to_canonical(self, text: str) -> str:
        body = text.strip()
        if not body.startswith("{"):
            return text
        try:
            payload = json.loads(body)
        except ValueError:  # a broken object is a broken call: where the syntax is bare JSON, answers are prose
            return f"{TOOL_CALL}{body}{TOOL_CALL_END}"
        if not (isinstance(payload, dict) and "name" in payload):
            return text  # an answer that happens to be JSON
        return self._call(body)

    def _call(self, body: str) -> str:
        try:
            payload = json.loads(body)
        except ValueError:
            return f"{TOOL_CALL}{body}{TOOL_CALL_END}"
        if isinstance(payload, dict) and self.arguments_key in payload and "arguments" not in payload:
            payload = {("arguments" if k == self.arguments_key else k): v for k, v in payload.items()}
        if isinstance(payload, dict) and isinstance(payload.get("arguments"), str):
            with contextlib.suppress(ValueError):  # some templates write the arguments as a JSON string
                payload["arguments"] = json.loads(payload["arguments"])
        return f"{TOOL_CALL}{json.dumps(payload)}{TOOL_CALL_END}"


CANONICAL_SYNTAX = ToolCallSyntax(TOOL_CALL, TOOL_CALL_END, "arguments")


class TemplateChat:
    """`ChatFormat` over a tokenizer's own chat template (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        missing = [t for t in (EXP_START, EXP_END) if t not in vocab]
        if missing:
            raise ValueError(f"the tokenizer lacks {missing}: call lopd_core.model.loading.add_experience_tokens")
        self.exp_start_id, self.exp_end_id = tokenizer.convert_tokens_to_ids([EXP_START, EXP_END])
        self.template_kwargs: dict = {}
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        probe = self._probe_messages()
        self._probe_prompt = self._render(probe, generation=True)
        answered = self._render(probe + [{"role": "assistant", "content": PROBE_ANSWER}])
        if answered[: len(self._probe_prompt)] != self._probe_prompt:
            raise ValueError("the chat template renders earlier turns differently once a reply follows")
        ends = [t for t in answered[len(self._probe_prompt) :] if t in special]
        if not ends:
            raise ValueError("the chat template closes an assistant turn with no special token")
        self.im_end_id = ends[0]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.im_end_id
        learned = self._learn_syntax(probe)
        self.renders_tool_calls = learned is not None  # else calls are plain text in the env's own syntax
        self.syntax = learned or CANONICAL_SYNTAX
        self._probe_assistant = (
            tool_call_message(PROBE_CALL["name"], PROBE_CALL["arguments"])
            if self.renders_tool_calls
            else {"role": "assistant", "content": PROBE_ANSWER}
        )
        self.user_header = self._learn_user_header()
        self.tools_in_template = False
        if self._render(probe, tools=PROBE_TOOLS) != self._render(probe):
            for kwargs in TOOL_PLACEMENTS:
                self.template_kwargs = kwargs
                if self._splice_holds(PROBE_TOOLS):
                    self.tools_in_template = True
                    break
            else:
                self.template_kwargs = {}
        if not self._splice_holds(None):
            raise ValueError("the chat template's first user turn cannot hold an experience block at its head")
        self._probe_tool_turn()

    def _probe_tool_turn(self) -> None:
        """A tool round trip on the probe (a call, then its observation in a `tool` turn): a template that cannot
        render the role, or drops its content, fails here at load rather than at the first tool call."""
        try:
            observed = self.tokenizer.decode(self.observation_ids(PROBE_OBSERVATION), skip_special_tokens=False)
        except Exception as exc:  # noqa: BLE001  jinja's errors, a template's raise_exception, ...
            raise ValueError(
                f"the chat template cannot render a `tool` turn ({type(exc).__name__}: {_first_line(exc)})"
            ) from None
        if PROBE_OBSERVATION not in observed:
            raise ValueError(
                "the chat template drops the content of a `tool` turn: the model would never see an observation"
            )

    # ---- ChatFormat ----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def start(
        self, system: str, user: str, experiences: list[str] | None = None, tools: list[dict] | None = None
    ) -> TrajectoryIds:
        """The template's first turn. Tools go to the template where it takes them: `tools` are the environment's
        schemas (FirstObservation.tools, what the rollout engine passes); without them, a toolworld listing in
        `system` is looked up (demonstrations carry only their system text). The system text stays as the
        environment wrote it."""
        if tools is not None:
            tools = [t if t.get("type") == "function" else {"type": "function", "function": t} for t in tools]
        elif self.tools_in_template:
            tools = toolworld_schemas(system)
        traj = TrajectoryIds()
        traj.add_forced(self.first_turn_ids(system, user, experiences, tools if self.tools_in_template else None))
        return traj

    def action_ids(self, action_text: str) -> list[int]:
        """Ids of a demonstration action in the model's syntax, closed with the end token (warm start and
        tests, not rollouts): what the template renders for that assistant message."""
        parsed = parse_calls(action_text) if self.renders_tool_calls else None
        message = {"role": "assistant", "content": action_text}
        if parsed and parsed[1]:  # one call or several (a served turn of parallel calls), as the template writes them
            content, calls = parsed
            message = {
                "role": "assistant",
                "content": content,
                "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls],
            }
        ids = self._render(self._probe_messages() + [message])
        if ids[: len(self._probe_prompt)] != self._probe_prompt:
            raise ValueError("the action's first token merges with the generation prompt")
        return ids[len(self._probe_prompt) : self._end_after(ids, len(self._probe_prompt)) + 1]

    def observation_ids(self, observation: str) -> list[int]:
        conversation = self._probe_messages() + [self._probe_assistant, {"role": "tool", "content": observation}]
        ids = self._render(conversation, generation=True)
        return ids[self._end_after(ids, len(self._probe_prompt)) + 1 :]

    def tool_results_ids(self, observations: list[str]) -> list[int]:
        """The template's rendering of consecutive tool messages after a turn of calls (templates that group
        them, as Qwen's does into one turn, group them here too), then the next assistant header."""
        tools = [{"role": "tool", "content": o} for o in observations]
        ids = self._render(self._probe_messages() + [self._probe_assistant, *tools], generation=True)
        return ids[self._end_after(ids, len(self._probe_prompt)) + 1 :]

    def decode_action(self, ids: list[int]) -> str:
        """The environment's text of the policy's ids: the end token dropped, a leading `<think>` block
        dropped, the model's tool call rewritten in the environment's syntax."""
        if ids and ids[-1] == self.im_end_id:
            ids = ids[:-1]
        text = THINK_BLOCK.sub("", self.tokenizer.decode(ids, skip_special_tokens=False), count=1)
        return self.syntax.to_canonical(text)

    # ---- rendering -----------------------------------------------------------------------------------------
    def first_turn_ids(
        self, system: str, user: str, experiences: list[str] | None = None, tools: list[dict] | None = None
    ) -> list[int]:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": experience_block(experiences) + user},
        ]
        return self._render(messages, tools=tools, generation=True)

    def _render(self, messages: list[dict], *, tools: list[dict] | None = None, generation: bool = False) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=generation,
                tokenize=True,
                return_dict=False,
                **self.template_kwargs,
            )
        )

    def _probe_messages(self) -> list[dict]:
        return [{"role": "system", "content": PROBE_SYSTEM}, {"role": "user", "content": PROBE_USER}]

    def _end_after(self, ids: list[int], at: int) -> int:
        """Index of the first end-of-turn token at or after `at`."""
        try:
            return ids.index(self.im_end_id, at)
        except ValueError:
            raise ValueError("the rendered assistant turn has no end token") from None

    def _learn_syntax(self, probe: list[dict]) -> ToolCallSyntax | None:
        """Read the tool-call syntax off a rendered probe call; None when the template renders no calls
        (the model then writes the environment's syntax as plain text, as the embedded base does)."""
        kwargs = dict(add_generation_prompt=False, tokenize=False, **self.template_kwargs)
        prompt = self.tokenizer.apply_chat_template(probe, **{**kwargs, "add_generation_prompt": True})
        try:
            full = self.tokenizer.apply_chat_template(
                probe + [tool_call_message(PROBE_CALL["name"], PROBE_CALL["arguments"])], **kwargs
            )
        except Exception:  # noqa: BLE001  a template without tool calls may raise on them in its own way
            return None
        end_text = self.tokenizer.convert_ids_to_tokens(self.im_end_id)
        if not full.startswith(prompt) or end_text not in full[len(prompt) :]:
            return None
        turn = full[len(prompt) : full.index(end_text, len(prompt))]
        at = turn.find("{")
        if at < 0:
            return None
        try:
            payload, stop = json.JSONDecoder().raw_decode(turn, at)
        except ValueError:
            return None
        if not isinstance(payload, dict) or payload.get("name") != PROBE_CALL["name"]:
            return None
        keys = [
            k
            for k, v in payload.items()
            if k != "name" and v in (PROBE_CALL["arguments"], json.dumps(PROBE_CALL["arguments"]))
        ]
        if not keys:
            return None
        return ToolCallSyntax(turn[:at].strip(), turn[stop:].strip(), keys[0])

    def _learn_user_header(self) -> list[int]:
        """The ids between the system turn's content and the first user turn's content, found with the
        experience tokens as markers (special tokens, so nothing around them merges with them)."""
        ids = self._render(
            [
                {"role": "system", "content": PROBE_SYSTEM + EXP_END},
                {"role": "user", "content": EXP_START + PROBE_USER},
            ],
            generation=True,
        )
        if ids.count(self.exp_end_id) != 1 or ids.count(self.exp_start_id) != 1:
            raise ValueError("the chat template drops or repeats message content")
        header = ids[ids.index(self.exp_end_id) + 1 : ids.index(self.exp_start_id)]
        if not header:
            raise ValueError("the chat template puts nothing between the system and the user turn")
        return header

    def user_content_start(self, token_ids: list[int]) -> int:
        """Index where the first user turn's content begins: right after the first `user_header` run."""
        n = len(self.user_header)
        for i in range(len(token_ids) - n + 1):
            if token_ids[i : i + n] == self.user_header:
                return i + n
        raise ValueError("no first user turn in these ids")

    def _splice_holds(self, tools: list[dict] | None) -> bool:
        """On a probe: the conversation with an experience block equals the plain one with the block's ids
        inserted at `user_content_start` — what the latent teacher's splice assumes."""
        plain = self.first_turn_ids(PROBE_SYSTEM, PROBE_USER, None, tools)
        with_block = self.first_turn_ids(PROBE_SYSTEM, PROBE_USER, [PROBE_ANSWER], tools)
        try:
            at = self.user_content_start(plain)
        except ValueError:
            return False
        block = [self.exp_start_id, *self.encode(PROBE_ANSWER), self.exp_end_id, *self.encode("\n")]
        return with_block == plain[:at] + block + plain[at:]
