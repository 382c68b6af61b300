"""The JSON grammar of constrained decoding (constrained.py) as a deterministic pushdown automaton over bytes: a
state is a tuple of immutable items, its top last — `Value(node)` for a value of a compiled schema node
(json_schema.py) and the object, array, string, number and literal items it expands into, `Space` (optional
whitespace), `Forced` (token ids taken by id, such as a chat format's `<tool_call>` token). Items are hashable, so
a state keys the cache of its mask.

What it writes: RFC 8259 JSON; at most MAX_SPACE whitespace characters in a row, numbers of at most MAX_DIGITS digits
before and after the point and MAX_EXPONENT_DIGITS in the exponent, strings in valid UTF-8 with no `\\u` escape of a
surrogate (the store could not write one), and none of the grammar's forbidden bytes or byte pairs in a string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lopd_core.rollout.json_schema import Node, free_array, free_json, free_object

MAX_SPACE = 12  # whitespace characters in a row (pretty-printed JSON indents; a model must not spin on blanks)
MAX_DIGITS = 16  # digits of a number before the point, and after it (a double holds 15 to 17)
MAX_EXPONENT_DIGITS = 3

WHITESPACE = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrt')
QUOTE, BACKSLASH = ord('"'), ord("\\")


# ---- the automaton's items ----------------------------------------------------------------------------------
# Each item: `byte(b, g)` / `token(t, g)` -> the items that replace it (top last), or None when it cannot take that
# input; `nullable`: it may be left out (the input then goes to the item below); `offers(g)`: the token ids it takes.
class Item:
    __slots__ = ()
    nullable = False

    def byte(self, b: int, g: Grammar):
        return None

    def token(self, t: int, g: Grammar):
        return None

    def offers(self, g: Grammar) -> tuple[int, ...]:
        return ()


@dataclass(frozen=True, slots=True)
class Space(Item):
    left: int = MAX_SPACE
    nullable = True

    def byte(self, b, g):
        if b not in WHITESPACE:
            return None
        return (Space(self.left - 1),) if self.left > 1 else ()


@dataclass(frozen=True, slots=True)
class Forced(Item):
    ids: tuple[int, ...]

    def token(self, t, g):
        if t != self.ids[0]:
            return None
        return (Forced(self.ids[1:]),) if len(self.ids) > 1 else ()

    def offers(self, g):
        return self.ids[:1]


@dataclass(frozen=True, slots=True)
class OneOf(Item):
    """One of several literal texts (true/false/null, an enum's values, a `:`), `at` bytes of it matched."""

    texts: tuple[bytes, ...]
    at: int = 0

    @property
    def nullable(self):
        return any(len(t) == self.at for t in self.texts)

    def byte(self, b, g):
        left = tuple(t for t in self.texts if len(t) > self.at and t[self.at] == b)
        if not left:
            return None
        return () if left == (left[0],) and len(left[0]) == self.at + 1 else (OneOf(left, self.at + 1),)


COLON = OneOf((b":",))


@dataclass(frozen=True, slots=True)
class Value(Item):
    node: Node

    def byte(self, b, g):
        node, kind = self.node, self.node.kind
        if kind == "enum":
            return OneOf(node.literals).byte(b, g)
        if kind == "anyof":  # the first byte tells which (compile_schema checks)
            return next((s for option in node.options if (s := Value(option).byte(b, g)) is not None), None)
        if b == ord("{") and (kind == "object" or (kind == "any" and node.depth > 0)):
            target = node if kind == "object" else free_object(node.depth)
            return (ObjectKey(target, frozenset(), first=True), Space())
        if b == ord("[") and (kind == "array" or (kind == "any" and node.depth > 0)):
            target = node if kind == "array" else free_array(node.depth)
            return (ArrayStart(target), Space())
        if b == QUOTE and kind in ("string", "any"):
            return (String(),)
        if kind in ("number", "integer", "any") and (b == ord("-") or b in DIGITS):
            return Number(START, 0, kind == "integer").byte(b, g)
        if kind in ("boolean", "any") and b in b"tf":
            return OneOf((b"true", b"false")).byte(b, g)
        if kind in ("null", "any") and b == ord("n"):
            return OneOf((b"null",)).byte(b, g)
        return None


def _member(obj: Node, used: frozenset, value: Node) -> tuple:
    """After an object's key: `:`, the value, then `,` or `}` (top last)."""
    return (ObjectNext(obj, used), Space(), Value(value), Space(), COLON, Space())


def _free_value(obj: Node) -> Node:
    return free_json(obj.depth - 1)


@dataclass(frozen=True, slots=True)
class ObjectKey(Item):
    """Where a key begins (after `{` or `,`); right after `{`, `}` ends the object if nothing is required."""

    obj: Node
    used: frozenset
    first: bool = False

    def byte(self, b, g):
        obj = self.obj
        if b == ord("}") and self.first and not obj.required:
            return ()
        if b != QUOTE:
            return None
        if obj.properties is None:  # any key: the string, then its member
            return (*_member(obj, self.used, _free_value(obj)), String())
        return (KeyName(obj, self.used, b""),) if _keys_left(obj, self.used) else None


def _keys_left(obj: Node, used: frozenset) -> bool:
    return obj.properties is None or len(used) < len(obj.properties)


@dataclass(frozen=True, slots=True)
class KeyName(Item):
    """A declared key being written, `prefix` of it so far (each key once)."""

    obj: Node
    used: frozenset
    prefix: bytes

    def byte(self, b, g):
        keys = [k for k in self.obj.properties if k not in self.used and k.startswith(self.prefix)]
        if b == QUOTE and self.prefix in keys:
            return _member(self.obj, self.used | {self.prefix}, self.obj.properties[self.prefix])
        longer = self.prefix + bytes((b,))
        return (KeyName(self.obj, self.used, longer),) if any(k.startswith(longer) for k in keys) else None


@dataclass(frozen=True, slots=True)
class ObjectNext(Item):
    obj: Node
    used: frozenset

    def byte(self, b, g):
        if b == ord(",") and _keys_left(self.obj, self.used):
            return (ObjectKey(self.obj, self.used), Space())
        if b == ord("}") and self.obj.required <= self.used:
            return ()
        return None


@dataclass(frozen=True, slots=True)
class ArrayStart(Item):
    array: Node

    def byte(self, b, g):
        if b == ord("]"):
            return ()
        started = Value(self.array.items).byte(b, g)
        return None if started is None else (ArrayNext(self.array), Space(), *started)


@dataclass(frozen=True, slots=True)
class ArrayNext(Item):
    array: Node

    def byte(self, b, g):
        if b == ord(","):
            return (ArrayNext(self.array), Space(), Value(self.array.items), Space())
        return () if b == ord("]") else None


@dataclass(frozen=True, slots=True)
class String(Item):
    """A string's content after its opening quote. `pending` continuation bytes of a UTF-8 character are due, the
    next in [lo, hi]; `last` is the previous byte when it may begin a forbidden pair (Grammar.forbidden)."""

    pending: int = 0
    lo: int = 0
    hi: int = 0
    last: int = 0

    def byte(self, b, g):
        if self.pending:
            if not self.lo <= b <= self.hi:
                return None
            return (String(self.pending - 1, 0x80, 0xBF) if self.pending > 1 else String(),)
        if b == QUOTE:
            return ()
        if b == BACKSLASH:
            return (String(), Escape())
        if b < 0x20:
            return None
        if b < 0x80:
            if g.forbidden and (bytes((b,)) in g.forbidden or bytes((self.last, b)) in g.forbidden):
                return None
            return (String(last=b if b in g.forbidden_first else 0),)
        utf8 = UTF8_LEADS.get(b)
        return None if utf8 is None else (String(*utf8),)


# a lead byte -> (continuation bytes due, the first one's range): RFC 3629, no overlong form, no surrogate
UTF8_LEADS = {
    **{b: (1, 0x80, 0xBF) for b in range(0xC2, 0xE0)},
    0xE0: (2, 0xA0, 0xBF),
    **{b: (2, 0x80, 0xBF) for b in (*range(0xE1, 0xED), 0xEE, 0xEF)},
    0xED: (2, 0x80, 0x9F),
    0xF0: (3, 0x90, 0xBF),
    **{b: (3, 0x80, 0xBF) for b in range(0xF1, 0xF4)},
    0xF4: (3, 0x80, 0x8F),
}


@dataclass(frozen=True, slots=True)
class Escape(Item):
    def byte(self, b, g):
        if b in ESCAPES:
            return ()
        return (Hex(0),) if b == ord("u") else None


@dataclass(frozen=True, slots=True)
class Hex(Item):
    """`\\u` then 4 hex digits, `seen` so far; a surrogate (D800-DFFF) is refused: it is no character."""

    seen: int
    surrogate_range: bool = False  # the first digit was d: the second must be 0-7

    def byte(self, b, g):
        if b not in HEX or (self.surrogate_range and b not in b"01234567"):
            return None
        if self.seen == 3:
            return ()
        return (Hex(self.seen + 1, self.seen == 0 and b in b"dD"),)


# a number's phases: what was written last (START: nothing yet, while Value dispatches its first byte)
START, SIGN, ZERO, INTEGER, POINT, FRACTION, E, E_SIGN, EXPONENT = range(9)
NUMBER_ENDS = frozenset({ZERO, INTEGER, FRACTION, EXPONENT})


@dataclass(frozen=True, slots=True)
class Number(Item):
    phase: int
    digits: int  # digits written in the current part (integer, fraction or exponent)
    integer: bool  # no fraction, no exponent

    @property
    def nullable(self):
        return self.phase in NUMBER_ENDS

    def byte(self, b, g):
        phase, digit, integer = self.phase, b in DIGITS, self.integer
        if phase == START:
            if b == ord("-"):
                return (Number(SIGN, 0, integer),)
            phase = SIGN
        if phase == SIGN:
            return (Number(ZERO if b == ord("0") else INTEGER, 1, integer),) if digit else None
        if digit and phase in (INTEGER, FRACTION, EXPONENT):
            cap = MAX_EXPONENT_DIGITS if phase == EXPONENT else MAX_DIGITS
            return (Number(phase, self.digits + 1, integer),) if self.digits < cap else None
        if integer:
            return None
        if b == ord(".") and phase in (ZERO, INTEGER):
            return (Number(POINT, 0, False),)
        if b in b"eE" and phase in (ZERO, INTEGER, FRACTION):
            return (Number(E, 0, False),)
        if b in b"+-" and phase == E:
            return (Number(E_SIGN, 0, False),)
        if digit and phase in (POINT, E, E_SIGN):
            return (Number(FRACTION if phase == POINT else EXPONENT, 1, False),)
        return None


State = tuple  # of items, the top last; () is a finished output


def feed_byte(state: State, b: int, g: Grammar) -> State | None:
    """The state after one byte, or None when no output continues with it."""
    return _feed(state, lambda top: top.byte(b, g))


def feed_token(state: State, t: int, g: Grammar) -> State | None:
    """The state after a token taken by id (a Forced item's), or None."""
    return _feed(state, lambda top: top.token(t, g))


def _feed(state: State, step) -> State | None:
    """The state after `step` (an item -> its replacement items, or None) taken by the topmost item that takes
    it; an item that does not may be passed only when it is nullable (it may end here)."""
    n = len(state)
    while n:
        top = state[n - 1]
        replaced = step(top)
        if replaced is not None:
            return state[: n - 1] + replaced
        if not top.nullable:
            return None
        n -= 1
    return None


def offered(state: State, g: Grammar) -> tuple[list[int], bool]:
    """The token ids the state takes by id, and whether the output may end here (every item left is nullable)."""
    ids: list[int] = []
    for item in reversed(state):
        ids += item.offers(g)
        if not item.nullable:
            return ids, False
    return ids, True


# ---- grammars -----------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint: its start state and the bytes or byte pairs no string may hold (a call's opening
    and closing tags begin with them, so an argument can never end a call or open one: `parse_calls` finds the
    first)."""

    start: State
    forbidden: frozenset[bytes] = frozenset()
    forbidden_first: frozenset[int] = field(init=False)  # the first bytes of the forbidden pairs

    def __post_init__(self):
        object.__setattr__(self, "forbidden_first", frozenset(p[0] for p in self.forbidden if len(p) == 2))
