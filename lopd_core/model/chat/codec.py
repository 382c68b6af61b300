"""The chat format, built on token ids: what the policy reads and which tokens it wrote.

Why ids and not text: training must supervise exactly the tokens the policy sampled. Re-rendering a
conversation as text and tokenizing it again can merge or split tokens differently at turn boundaries, which
silently misaligns the supervised spans (the official LOPD code does this). Here a trajectory is grown by
appending id segments: forced segments (system, user, tool observation, turn framing) with action_mask 0 and
the policy's own tokens with action_mask 1. Every forced segment starts or ends at a special token, so the ids
are also exactly what the tokenizer's chat template produces for the same conversation (a test checks it).

Layout (Qwen-style):
    <|im_start|>system\n{tools}<|im_end|>\n
    <|im_start|>user\n[<|exp_start|>{experience 1}\n{experience 2}<|exp_end|>\n]{instruction}<|im_end|>\n
    <|im_start|>assistant\n{action}<|im_end|>\n            <- action tokens (and <|im_end|>) have mask 1
    <|im_start|>tool\n{observation}<|im_end|>\n
    <|im_start|>assistant\n ...
The experience block sits between framing tokens in the first user turn: that is where the latent teacher
later splices its latent vectors in place of the text.

That layout is the embedded base's own. A model with its own chat template (Qwen3, Llama 3, ...) talks through
`TemplateChat` (lopd_core/model/chat/template.py) instead, which renders every forced segment with the model's
template; both implement `ChatFormat`, and `make_chat` (the package's __init__) picks one by looking at the
tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EXP_START = "<|exp_start|>"
EXP_END = "<|exp_end|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PAD = "<|pad|>"
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [PAD, EOS, IM_START, IM_END, EXP_START, EXP_END, TOOL_CALL, TOOL_CALL_END]

# Jinja chat template saved with the tokenizer: renders the same text as `first_turn_text` / `TrajectoryIds`, so a
# plain Hugging Face user (`apply_chat_template`) talks to the exported student in the format it was trained on.
# Messages may carry `experiences` (a list of strings) on the first user turn.
CHAT_TEMPLATE = (
    r"{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    r"{% if m.get('experiences') %}{{ '<|exp_start|>' + (m['experiences'] | join('\n')) + '<|exp_end|>\n' }}{% endif %}"
    r"{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def experience_block(experiences: list[str] | None) -> str:
    """Retrieved experiences as text at the head of the first user turn ("" when there are none)."""
    return f"{EXP_START}{chr(10).join(experiences)}{EXP_END}\n" if experiences else ""


def first_turn_text(system: str, user: str, experiences: list[str] | None = None) -> str:
    """The forced prefix of a conversation up to and including the first assistant header."""
    exp = experience_block(experiences)
    return f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{exp}{user}{IM_END}\n{IM_START}assistant\n"


def observation_text(observation: str) -> str:
    """Forced tokens after an action's <|im_end|>: the tool turn, then the next assistant header."""
    return f"\n{IM_START}tool\n{observation}{IM_END}\n{IM_START}assistant\n"


@dataclass
class TrajectoryIds:
    """A conversation as ids, grown segment by segment, with the policy's tokens marked.

    `action_mask[i] == 1` iff token i was produced by the policy; `sample_logprobs[i]` is its log-probability
    under the distribution it was sampled from (0.0 at forced positions).
    """

    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    sample_logprobs: list[float] = field(default_factory=list)

    def add_forced(self, ids: list[int]) -> None:
        self.token_ids.extend(ids)
        self.action_mask.extend([0] * len(ids))
        self.sample_logprobs.extend([0.0] * len(ids))

    def add_action(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        self.token_ids.extend(ids)
        self.action_mask.extend([1] * len(ids))
        self.sample_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def __len__(self) -> int:
        return len(self.token_ids)


class ChatCodec:
    """Turns conversation pieces into ids with one tokenizer; the only place text meets ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.im_end_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode_action(self, ids: list[int]) -> str:
        """Text of an action for the environment: the policy's ids without the closing <|im_end|>."""
        if ids and ids[-1] == self.im_end_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def start(
        self, system: str, user: str, experiences: list[str] | None = None, tools: list[dict] | None = None
    ) -> TrajectoryIds:
        """The forced first turn; `tools` is ignored: the embedded format lists the tools in `system`."""
        traj = TrajectoryIds()
        traj.add_forced(self.encode(first_turn_text(system, user, experiences)))
        return traj

    def action_ids(self, action_text: str) -> list[int]:
        """Ids of a demonstration action, closed with <|im_end|> (warm start and tests, not rollouts)."""
        return self.encode(action_text) + [self.im_end_id]

    def observation_ids(self, observation: str) -> list[int]:
        return self.encode(observation_text(observation))

    def tool_results_ids(self, observations: list[str]) -> list[int]:
        """Forced ids after a turn of several tool calls: one tool turn per result, in order, then the next
        assistant header (one result: `observation_ids`)."""
        turns = "".join(f"{IM_START}tool\n{o}{IM_END}\n" for o in observations)
        return self.encode(f"\n{turns}{IM_START}assistant\n")


class ChatFormat(Protocol):
    """What the rollout engine, the trainer and the teacher need of a chat format (all of it in token ids)."""

    tokenizer: object
    im_end_id: int  # the token that closes an assistant turn: generation of one turn stops at it
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def start(
        self, system: str, user: str, experiences: list[str] | None = None, tools: list[dict] | None = None
    ) -> TrajectoryIds:
        """Forced ids up to and including the first assistant header. `tools` (the environment's tool schemas)
        is for formats whose template renders them; the embedded format lists tools in `system`."""

    def action_ids(self, action_text: str) -> list[int]:
        """Ids of a demonstration action given in the environment's text, closed with `im_end_id`."""

    def observation_ids(self, observation: str) -> list[int]:
        """Forced ids after an action's closing token: the tool turn, then the next assistant header."""

    def tool_results_ids(self, observations: list[str]) -> list[int]:
        """Forced ids after a turn of several tool calls (a served conversation's parallel calls): every result's
        tool turn, then the next assistant header."""

    def decode_action(self, ids: list[int]) -> str:
        """The environment's text for the policy's ids of one turn."""


def is_embedded_format(tokenizer) -> bool:
    """True for the embedded base's tokenizer (its chat template is ours, or it has none)."""
    return not tokenizer.chat_template or tokenizer.chat_template == CHAT_TEMPLATE
