"""An environment's observation bounded to a token budget before it joins a trajectory."""

from __future__ import annotations

# Characters of an observation tokenized at most to find its first `max_observation_tokens` tokens: a token
# rarely spans more, and a multi-megabyte observation is never tokenized whole.
CHARS_PER_TOKEN_BOUND = 16
TRUNCATION_MARK = "\n[observation truncated: {n} more characters not shown]"


def bounded_observation(codec, text: str, cap: int) -> str:
    """`text` when it is at most `cap` tokens; else its head and a mark saying how many characters were cut, at
    most `cap` tokens together. Why: an environment's observation has no size limit of its own, and a huge one
    became one huge context (in the rollout, then in every teacher pass over it); the mark tells the model the
    view is partial rather than letting it read a cut-off text as whole."""
    text = text.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate would crash the tokenizer
    if 2 * len(text.encode("utf-8")) <= cap:  # tokens hardly ever hold less than a byte: it fits, untokenized
        return text
    head = text[: cap * CHARS_PER_TOKEN_BOUND]
    ids = codec.encode(head)
    if len(head) == len(text) and len(ids) <= cap:
        return text
    keep = min(len(ids), cap)
    for _ in range(8):  # decoding a cut and encoding it again can differ by a token or two at the seam
        shown = codec.tokenizer.decode(ids[:keep], skip_special_tokens=False)
        out = shown + TRUNCATION_MARK.format(n=max(len(text) - len(shown), 1))
        excess = len(codec.encode(out)) - cap
        if excess <= 0:
            return out
        keep = max(keep - excess, 0)
    return TRUNCATION_MARK.format(n=len(text)).strip()[:cap]


def _bounded_episode(episode: list[dict], codec, cap: int) -> list[dict]:
    """The environment's episode record with each observation as the model saw it (`bounded_observation`): a
    huge observation is not carried on into the trajectory table and the bank either."""
    out = []
    for entry in episode:
        obs = entry.get("observation") if isinstance(entry, dict) else None
        if isinstance(obs, str) and len(obs) > cap:
            entry = {**entry, "observation": bounded_observation(codec, obs, cap)}
        out.append(entry)
    return out
