"""A past success as compact text: the task, then its action -> result chain.

This is what the base reads as plain-text experience in its first user turn (warm start, evaluation with
experience) and what the experience bank stores and the composer encodes. It is deliberately short: a tiny
model pays for every token, and what an experience must carry is the world's conventions — which tool, which
argument format, which extra step, in which order — all visible in the call chain. Observations are clipped.
"""

from __future__ import annotations

import json

MAX_OBSERVATION_CHARS = 48
MAX_CODE_CHARS = 600  # a codegen success keeps its whole function: clipped code teaches nothing


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_experience(instruction: str, episode: list[dict]) -> str:
    """`instruction` and the episode record (one dict per assistant turn, as environments keep it)."""
    lines = [instruction]
    for turn in episode:
        call = turn.get("call")
        if call is not None:
            args = json.dumps(call.get("arguments", {}))
            lines.append(f"{call['name']} {args} -> {_clip(turn.get('observation', ''), MAX_OBSERVATION_CHARS)}")
        else:
            lines.append(f"answer: {_clip(turn.get('action', ''), MAX_OBSERVATION_CHARS)}")
    return "\n".join(lines)


def format_code_experience(instruction: str, episode: list[dict]) -> str:
    """A codegen success: the instruction and the code of its last (passing) attempt, whole.

    Unlike a tool chain, code cannot be clipped to a few characters and stay useful, and the earlier failed
    attempts are left out: what the experience must carry is a function that passed (families' references are
    150-400 characters)."""
    code = episode[-1].get("action", "") if episode else ""
    code = code if len(code) <= MAX_CODE_CHARS else code[: MAX_CODE_CHARS - 3] + "..."
    return f"{instruction}\nanswer:\n{code.strip()}"


def experience_text(task, episode: list[dict]) -> str:
    """The experience text of a success of `task` (a lopd_core.envs.Task), in its environment's format."""
    if task.env == "codegen":
        return format_code_experience(task.instruction, episode)
    return format_experience(task.instruction, episode)
