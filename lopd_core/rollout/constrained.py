"""Constrained decoding: at each step only the tokens that keep a turn a valid prefix of its required output can be
sampled — a JSON answer (OpenAI's `response_format`) or a call of a declared tool in the chat format's call syntax
(`tool_choice: "required"` or a named function). `lopd serve`'s continuous batch masks a row's logits with
`Constrained.mask` before it samples and feeds the sampled token back with `Constrained.advance`
(lopd_core/rollout/continuous.py).

Four modules, read in this order: json_schema.py compiles the JSON Schema subset (a keyword outside it is a
SchemaError naming it); json_grammar.py recognizes JSON byte by byte, a deterministic pushdown automaton whose
state is a tuple of immutable items; turn_grammar.py says what a turn must be (`OutputConstraint`) and builds its
grammar (a call between the chat format's tags, another call, a call or a JSON answer); this one reads the
tokenizer's pieces as bytes and finds each state's mask.

A token is allowed when its bytes (`Vocabulary`: the byte-level BPE or SentencePiece pieces, added tokens excluded:
their text is never spelled out) lead the automaton to a state, or when an item takes it by id (a tag's token); the
end-of-turn token when every item left may be empty. The vocabulary is walked as a sorted list of byte strings (a
trie in ranges), so every piece sharing a prefix is cut at its first byte no state takes; inside a string the
pieces that are plain text (no quote, backslash, control character or partial UTF-8) keep the state as it was and
come as one precomputed mask. Masks are cached by state. The state depends on the sampled ids only, so a replay of
a recorded turn (same ids, same constraint) rebuilds the same masks.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
import threading
from collections import OrderedDict
from functools import lru_cache

import torch

from lopd_core.rollout.json_grammar import BACKSLASH, QUOTE, Grammar, State, String, feed_byte, feed_token, offered
from lopd_core.rollout.turn_grammar import OutputConstraint, build_grammar

log = logging.getLogger("lopd.rollout")

MASKS_KEPT = 256  # masks cached per vocabulary (each one bool per token)
VOCABULARIES_KEPT = 4  # tokenizers whose byte pieces are kept (a hot swap adds one)


# ---- the vocabulary as bytes --------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE piece writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _pieces_kind(tokenizer) -> str | None:
    """byte_level, sentencepiece, or None (a tokenizer whose pieces this module cannot read as bytes)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return None
    decoder = json.loads(decoder.__getstate__())
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"Metaspace", "ByteFallback"}:
        return "sentencepiece"
    return None


class Vocabulary:
    """A tokenizer's tokens as the bytes they write (added tokens excluded: their text is never spelled out), sorted
    for the walk, and the masks found so far."""

    def __init__(self, tokenizer):
        self.size = len(tokenizer)
        self.kind = _pieces_kind(tokenizer)
        added = set(tokenizer.added_tokens_decoder)
        pieces = tokenizer.convert_ids_to_tokens(list(range(self.size)))
        self.bytes: list[bytes | None] = [
            None if piece is None or i in added else _piece_bytes(piece, self.kind) for i, piece in enumerate(pieces)
        ]
        self.single = {piece[0] for piece in self.bytes if piece is not None and len(piece) == 1}
        written = sorted((piece, i) for i, piece in enumerate(self.bytes) if piece)
        self.sorted = [piece for piece, _ in written]
        self.sorted_ids = [i for _, i in written]
        self._lock = threading.Lock()
        self._masks: OrderedDict = OrderedDict()
        self._plain: dict[frozenset, tuple[torch.Tensor, list[bytes], list[int]]] = {}

    def cannot_write(self) -> str | None:
        """Why this vocabulary cannot write constrained JSON, or None: every printable ASCII character must be a
        token of its own (JSON's punctuation, digits and escapes are written byte by byte)."""
        if self.kind is None:
            return "its tokenizer is neither byte-level BPE nor SentencePiece (its pieces cannot be read as bytes)"
        missing = [chr(b) for b in range(0x20, 0x7F) if b not in self.single]
        return f"its vocabulary has no token for {missing[0]!r}" if missing else None

    def mask(self, grammar: Grammar, state: State | None, end_id: int, size: int) -> torch.Tensor:
        """(size,) bool: the tokens that lead `state` to a state (the end token where the output may end)."""
        key = (grammar, state, end_id, size)
        with self._lock:
            if key in self._masks:
                self._masks.move_to_end(key)
                return self._masks[key]
        allowed = torch.zeros(size, dtype=torch.bool)
        ids, may_end = offered(state, grammar) if state is not None else ([], True)
        ids += [end_id] if may_end else []
        top = state[-1] if state else None  # None: the output is finished, or went wrong (it can only end)
        plain = isinstance(top, String) and not top.pending and not top.last  # plain text keeps the state as it is
        if plain:
            text, rest, rest_ids = self._plain_text(grammar)
            allowed[: min(size, self.size)] = text[:size]
            ids += _walk(rest, rest_ids, state, grammar)
        elif top is not None:
            ids += _walk(self.sorted, self.sorted_ids, state, grammar)
        if not ids and not plain:  # no token of this vocabulary continues (a piece it lacks): the turn can only end
            log.warning("no token continues the constrained output; the turn ends")
            ids = [end_id]
        allowed[torch.tensor([i for i in ids if i < size], dtype=torch.long)] = True
        with self._lock:
            self._masks[key] = allowed
            while len(self._masks) > MASKS_KEPT:
                self._masks.popitem(last=False)
        return allowed

    def _plain_text(self, grammar: Grammar):
        """The tokens a string takes whole without changing its state (valid UTF-8 text with no quote, backslash,
        control character or byte a forbidden pair begins with), as a mask, and the others sorted for the walk."""
        key = grammar.forbidden
        with self._lock:
            if key in self._plain:
                return self._plain[key]
        stops = {QUOTE, BACKSLASH, *range(0x20), *grammar.forbidden_first}
        stops |= {p[0] for p in grammar.forbidden if len(p) == 1}
        plain_ids, rest, rest_ids = [], [], []
        for piece, i in zip(self.sorted, self.sorted_ids):
            if _is_text(piece) and stops.isdisjoint(piece):
                plain_ids.append(i)
            else:
                rest.append(piece)
                rest_ids.append(i)
        plain = torch.zeros(self.size, dtype=torch.bool)
        plain[torch.tensor(plain_ids, dtype=torch.long)] = True
        with self._lock:
            self._plain[key] = (plain, rest, rest_ids)
        return plain, rest, rest_ids

    def feed(self, grammar: Grammar, state: State | None, token_id: int) -> State | None:
        """The state after a sampled token (by id when an item takes it so, else byte by byte)."""
        if state is None:
            return None
        after = feed_token(state, token_id, grammar)
        piece = self.bytes[token_id] if token_id < self.size else None
        if after is not None or piece is None:
            return after
        for b in piece:
            state = feed_byte(state, b, grammar)
            if state is None:
                return None
        return state


def _piece_bytes(piece: str, kind: str | None) -> bytes | None:
    if kind == "byte_level":
        table = _unicode_to_byte()
        return bytes(table[c] for c in piece) if all(c in table for c in piece) else None
    if kind == "sentencepiece":
        byte = SP_BYTE.fullmatch(piece)
        return bytes((int(byte.group(1), 16),)) if byte else piece.replace("\u2581", " ").encode()
    return None


def _is_text(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _walk(pieces: list[bytes], ids: list[int], state: State, grammar: Grammar) -> list[int]:
    """The ids of the sorted `pieces` whose bytes the state takes, one byte at a time: the pieces that share a
    prefix are a range of the sorted list, cut whole at its first byte no state takes."""
    allowed: list[int] = []
    todo = [(0, len(pieces), 0, state)]  # pieces[lo:hi] share their first `depth` bytes, which led to `at`
    while todo:
        lo, hi, depth, at = todo.pop()
        while lo < hi and len(pieces[lo]) == depth:  # pieces that ended here (counted one level up)
            lo += 1
        while lo < hi:
            b = pieces[lo][depth]
            end = hi if b == 255 else bisect.bisect_left(pieces, pieces[lo][:depth] + bytes((b + 1,)), lo, hi)
            after = feed_byte(at, b, grammar)
            if after is not None:
                first = lo
                while first < end and len(pieces[first]) == depth + 1:
                    allowed.append(ids[first])
                    first += 1
                if first < end:
                    todo.append((first, end, depth + 1, after))
            lo = end
    return allowed


_vocabularies: OrderedDict[int, tuple[object, Vocabulary]] = OrderedDict()
_grammars: OrderedDict[tuple, Grammar] = OrderedDict()
_cache_lock = threading.Lock()
GRAMMARS_KEPT = 64


def vocabulary(tokenizer) -> Vocabulary:
    """The tokenizer's Vocabulary, built once (the tokenizer is kept with it, so its id is not reused)."""
    with _cache_lock:
        if id(tokenizer) in _vocabularies:
            _vocabularies.move_to_end(id(tokenizer))
            return _vocabularies[id(tokenizer)][1]
    built = Vocabulary(tokenizer)
    with _cache_lock:
        _vocabularies[id(tokenizer)] = (tokenizer, built)
        while len(_vocabularies) > VOCABULARIES_KEPT:
            _vocabularies.popitem(last=False)
    return built


def grammar(constraint: OutputConstraint, tokenizer) -> Grammar:
    """The constraint's grammar for this tokenizer, compiled once: equal requests share it, and its cached masks."""
    key = (constraint, id(tokenizer))
    with _cache_lock:
        if key in _grammars:
            _grammars.move_to_end(key)
            return _grammars[key]
    built = build_grammar(constraint, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    with _cache_lock:
        _grammars[key] = built
        while len(_grammars) > GRAMMARS_KEPT:
            _grammars.popitem(last=False)
    return built


class Constrained:
    """One turn's constrained output: the state after the ids sampled so far. `mask(V)` before sampling a token,
    `advance(id)` after."""

    def __init__(self, constraint: OutputConstraint, tokenizer, end_id: int):
        self.grammar = grammar(constraint, tokenizer)
        self.vocabulary = vocabulary(tokenizer)
        self.end_id = end_id
        self.state: State | None = self.grammar.start

    def mask(self, size: int) -> torch.Tensor:
        """(size,) bool on the CPU: the tokens that keep the output a valid prefix (size: the logits' width)."""
        return self.vocabulary.mask(self.grammar, self.state, self.end_id, size)

    def advance(self, token_id: int) -> None:
        if token_id == self.end_id:
            self.state = ()
            return
        self.state = self.vocabulary.feed(self.grammar, self.state, token_id)

    @property
    def done(self) -> bool:
        """The output so far is complete (the end token may close it)."""
        return self.state is not None and offered(self.state, self.grammar)[1]
