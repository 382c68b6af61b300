"""A past success as compact text: the task, then its action -> result chain.

This is what the base reads as plain-text experience in its first user turn (warm start, evaluation with
experience) and what the experience bank stores and the composer encodes. It is deliberately short: a tiny
model pays for every token, and what an experience must carry is the world's conventions — which tool, which
argument format, which extra step, in which order — all visible in the call chain. Observations are clipped.
"""

from __future__ import annotations

import json

MAX_OBSERVATION_CHARS = 48


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
