"""Sessions: which trajectory a conversation is on, and whether a request extends it or starts a new one.

A session is named by the `X-Session-Id` header or the request's `user` field; a request with neither is a
session of its own (one turn, not kept). The table holds at most `max_sessions`; when it is full, sessions
that were labeled (feedback came: the conversation is over for its client) make room first, oldest first, then
sessions idle longer than `idle_s`, then the least recently used session not answering a turn; only when every
session is answering a turn is a new one refused (429). One client address holds at most `per_client` of them
(beyond, its own least recently used idle session closes), so one client cannot fill the table for the others.
A closed session's conversation goes on in a new trajectory; feedback can still name the old one by id.
A labeled session that speaks again is live again, in a new trajectory
(origin `after_label`): a label judges the turns it was given, and extending the judged trajectory would let it
cover turns nobody judged.
Turns of one session are answered one at a time (its lock): two requests racing on one conversation could
otherwise both claim to extend it.
After a rotation (`lopd serve store rotate`) a session's earlier turns are in the archive: its next turn, planned to
extend them, is written as a new trajectory instead (origin `rotated`, parent the archived one) whose turn 0 carries
the whole history, its sampled ids with their action mask and log-probs as they were (`keep_turn`), so the live
store never holds a turn without its turn 0; feedback naming the archived trajectory labels the one that carries it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from lopd_core.model.chat import TrajectoryIds
from lopd_core.traces import TraceStore
from lopd_core.traces.errors import Rotated
from lopd_serve.conversation import Parsed, render, reply_digest
from lopd_serve.protocol import ApiError

REPLIES_KEPT = 64  # replies a session remembers as its own when a branch renders them again


@dataclass
class Session:
    id: str
    trajectory_id: str = ""
    version: str = ""
    tools_key: str = ""
    keys: list[str] = field(default_factory=list)  # the trajectory's messages, the replies it sampled included
    replies: tuple[str, ...] = ()  # digests of the latest replies this session was given (the model's own text)
    ids: TrajectoryIds = field(default_factory=TrajectoryIds)
    num_turns: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    labeled: bool = False  # feedback came after its last turn: first to make room (module docstring)
    judged: str = ""  # the trajectory a label judged: the session's next turn starts a new one
    client: str = ""  # the address that opened it: a client's share of the table is counted by it
    epoch: int = 0  # the store epoch its trajectory's turn 0 was written in (a rotation since: it is archived)
    prompt_length: int = 0  # its trajectory's prompt (what a turn 0 carrying it records)
    started: float = 0.0  # wall-clock time of its trajectory's turn 0
    messages: list[dict] = field(default_factory=list)  # its trajectory's messages as recorded
    head: dict = field(default_factory=dict)  # its tools, tokenizer and last finish reason (`carry_for_label`)

    def advance(self, plan: Plan, segment: TrajectoryIds, *, version: str, tools_key: str, keys: list[str]) -> None:
        """Take the recorded turn as the session's state: a new trajectory replaces the old one."""
        if plan.turn == 0:
            self.trajectory_id, self.version, self.tools_key = plan.trajectory_id, version, tools_key
            self.ids, self.num_turns = TrajectoryIds(), 0
            self.epoch, self.prompt_length = plan.epoch, plan.prompt_length
            self.started = plan.started
        self.ids.token_ids += segment.token_ids
        self.ids.action_mask += segment.action_mask
        self.ids.sample_logprobs += segment.sample_logprobs
        self.keys = keys
        self.replies = (*self.replies, reply_digest(keys[-1]))[-REPLIES_KEPT:]
        self.num_turns += 1 + plan.carried


@dataclass
class Plan:
    """What one request adds: a segment of forced ids, and whether it opens a new trajectory."""

    trajectory_id: str
    turn: int
    origin: str  # "extends" or one of lopd_core/traces/schema.ORIGINS
    parent: str
    segment: TrajectoryIds
    context: list[int]  # every id the model reads before sampling
    new_messages: int  # how many of the request's messages the segment renders (from the end)
    prompt_length: int = 0  # a turn 0's forced ids before its first sampled one
    carried: int = 0  # turns of the parent a turn 0 carries whole before its own (origin "rotated")
    epoch: int = 0  # the store epoch its record was written in (set once written: keep_turn)
    started: float = 0.0  # a carried trajectory's start: its parent's

    @property
    def turns_after(self) -> int:
        """The trajectory's turns once this one is recorded (what a label posted then judges)."""
        return self.turn + 1 + self.carried


class SessionTable:
    def __init__(self, max_sessions: int, idle_s: float, per_client: int | None = None):
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self.per_client = per_client or max_sessions
        self.sessions: dict[str, Session] = {}

    def get(self, session_id: str | None, client: str = "") -> Session:
        if session_id is None:
            return Session(id="anon-" + uuid.uuid4().hex, client=client)
        session = self.sessions.get(session_id)
        if session is None:
            own = [s for s in self.sessions.values() if s.client == client]
            if len(own) >= self.per_client and not self._close_least_recent(own):
                raise ApiError(
                    429,
                    f"this client holds {len(own)} sessions (serve.max_sessions_per_client), each answering a turn: "
                    "retry later",
                    "too_many_sessions",
                    kind="rate_limit_error",
                )
            if len(self.sessions) >= self.max_sessions:
                self._make_room()
            if len(self.sessions) >= self.max_sessions:
                raise ApiError(
                    429,
                    f"{len(self.sessions)} sessions are open (serve.max_sessions), every one answering a turn: "
                    "retry later",
                    "too_many_sessions",
                    kind="rate_limit_error",
                )
            session = self.sessions[session_id] = Session(id=session_id, client=client)
        session.last_used, session.labeled = time.monotonic(), False
        return session

    def _close_least_recent(self, candidates: list[Session]) -> bool:
        idle = [s for s in candidates if not s.lock.locked()]
        if not idle:
            return False
        del self.sessions[min(idle, key=lambda s: s.last_used).id]
        return True

    def _make_room(self) -> None:
        """Close the labeled sessions (the oldest first, down to 90 % of the cap, so the next requests do not each
        scan the table), then every session idle past `idle_s`, then, still full, the least recently used one
        that is not answering a turn: a table full of abandoned one-turn sessions must not refuse a new client
        for `idle_s`. A session answering a turn (its lock) stays."""
        free = [(s.last_used, sid) for sid, s in self.sessions.items() if s.labeled and not s.lock.locked()]
        for _, sid in sorted(free)[: max(1, len(self.sessions) - self.max_sessions * 9 // 10)]:
            del self.sessions[sid]
        now = time.monotonic()
        for sid, s in list(self.sessions.items()):
            if now - s.last_used > self.idle_s and not s.lock.locked():
                del self.sessions[sid]
        if len(self.sessions) >= self.max_sessions:
            self._close_least_recent(list(self.sessions.values()))

    def find(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)


def plan_turn(session: Session, parsed: Parsed, tools_key: str, chat, version: str) -> Plan:
    """Extend the session's trajectory when the request repeats it exactly (same model version, same tools,
    every earlier message and reply) and only adds tool or user messages; else start a new trajectory."""
    known = session.keys
    repeats = session.trajectory_id and len(parsed.keys) > len(known) and parsed.keys[: len(known)] == known
    judged = session.trajectory_id and session.judged == session.trajectory_id
    if repeats and session.version == version and session.tools_key == tools_key and not judged:
        start = len(known) - 2  # index into parsed.rest (keys hold system and first user before rest)
        segment = render(chat, parsed, start)
        return Plan(
            session.trajectory_id,
            session.num_turns,
            "extends",
            "",
            segment,
            session.ids.token_ids + segment.token_ids,
            len(parsed.rest) - start,
        )
    if not session.trajectory_id:
        origin = "new"
    elif judged and repeats:  # a label judges the turns it was given: what follows is another trajectory
        origin = "after_label"
    elif session.version != version:
        origin = "model_changed"
    else:
        first_diff = next((i for i, (a, b) in enumerate(zip(known, parsed.keys)) if a != b), None)
        differs_at_reply = first_diff is not None and parsed.keys[first_diff].startswith('["assistant"')
        origin = "assistant_differs" if differs_at_reply else "context_differs"
    segment = render(chat, parsed, sampled=session.replies)
    return Plan(
        "traj-" + uuid.uuid4().hex,
        0,
        origin,
        session.trajectory_id if origin != "new" else "",
        segment,
        list(segment.token_ids),
        len(parsed.rest) + 2,
        prompt_length=len(segment),
    )


def carried(session: Session, plan: Plan, messages: int) -> Plan:
    """`plan`, a later turn of the session's trajectory whose earlier turns a rotation archived, as the turn 0 of a
    new trajectory that carries them whole (ids, mask and log-probs as recorded) before the turn's own segment;
    `messages`: all of the request's messages, which a turn 0 records."""
    whole = TrajectoryIds()
    for part in (session.ids, plan.segment):
        whole.token_ids += part.token_ids
        whole.action_mask += part.action_mask
        whole.sample_logprobs += part.sample_logprobs
    return replace(
        plan,
        trajectory_id="traj-" + uuid.uuid4().hex,
        turn=0,
        origin="rotated",
        parent=plan.trajectory_id,
        segment=whole,
        new_messages=messages,
        prompt_length=session.prompt_length,
        carried=session.num_turns,
        started=session.started,
    )


async def keep_turn(
    store: TraceStore,
    recorded: Recorded,
    session: Session,
    plan: Plan,
    record: Callable[[Plan], dict],
    *,
    messages: int,
) -> Plan:
    """Append the turn's record (`record(plan)`, on disk before the client hears of it) and note it for feedback;
    returns the plan as written: a later turn whose trajectory a rotation archived (before it was planned, or
    while it was decoded) is written as a turn 0 carrying it (`carried`). The caller advances the session."""
    if plan.turn and session.epoch != store.epoch:
        plan = carried(session, plan, messages)
    written = record(plan)
    try:
        epoch = await asyncio.to_thread(store.append, written, epoch=session.epoch if plan.turn else None)
    except Rotated:  # rotated while this turn was decoded
        plan = carried(session, plan, messages)
        written = record(plan)
        epoch = await asyncio.to_thread(store.append, written)
    plan.epoch, plan.started = epoch, plan.started or float(written["time"])
    if plan.turn == 0:  # what a label after a rotation carries it on with (carry_for_label)
        session.messages = []
        session.head = {"tools": written.get("tools") or [], "tokenizer": written.get("tokenizer")}
    session.messages = session.messages + written["messages"]
    session.head["finish_reason"] = written["finish_reason"]
    if plan.origin == "rotated":
        recorded.carry(plan.parent, plan.trajectory_id)
    recorded.add(plan.trajectory_id, session.id, turns=plan.turns_after, epoch=epoch)
    return plan


class Recorded:
    """Which session each trajectory this process wrote belongs to (what feedback may label), the latest `cap`.

    Why bounded: every answered request adds a trajectory (a request without a session adds one each), so an
    unbounded map grows with the server's whole traffic; the oldest entries go first, and feedback naming one of
    them is a 404 like any trajectory this process does not know."""

    def __init__(self, cap: int):
        self.cap = cap
        # trajectory -> (session, turns written, the store epoch it started in)
        self._owner: OrderedDict[str, tuple[str, int, int]] = OrderedDict()
        self._carried_by: dict[str, str] = {}  # an archived trajectory -> the one that carries it on (rotation)

    def add(self, trajectory_id: str, session_id: str, *, turns: int, epoch: int = 0) -> None:
        started = self._owner[trajectory_id][2] if trajectory_id in self._owner else epoch
        self._owner[trajectory_id] = (session_id, turns, started)
        self._owner.move_to_end(trajectory_id)
        while len(self._owner) > self.cap:
            self._carried_by.pop(self._owner.popitem(last=False)[0], None)

    def carry(self, archived: str, carrier: str) -> None:
        if archived in self._owner:
            self._carried_by[archived] = carrier

    def current(self, trajectory_id: str) -> str:
        """The trajectory that holds `trajectory_id`'s turns now: itself, or the one carrying it on after a
        rotation (a label posted for it lands there, with the turns it judges)."""
        seen = {trajectory_id}
        while trajectory_id in self._carried_by and self._carried_by[trajectory_id] not in seen:
            trajectory_id = self._carried_by[trajectory_id]
            seen.add(trajectory_id)
        return trajectory_id

    def get(self, trajectory_id: str) -> str | None:
        owner = self._owner.get(trajectory_id)
        return owner[0] if owner else None

    def turns(self, trajectory_id: str) -> int:
        """The turns of the trajectory written so far: what a label posted now judges."""
        return self._owner[trajectory_id][1]

    def epoch(self, trajectory_id: str) -> int:
        """The store epoch the trajectory started in (an earlier one than the store's: its turns are archived)."""
        return self._owner[trajectory_id][2]

    def __len__(self) -> int:
        return len(self._owner)


async def carry_for_label(store: TraceStore, recorded: Recorded, session: Session) -> str:
    """A label for the session's trajectory that a rotation archived before anything carried it on: write, in the
    live store, the turn 0 of a trajectory that carries it whole (as `carried` does, with no turn of its own) and
    return its id, which the label then lands on. Under the session's lock, so no turn of it is in flight."""
    async with session.lock:
        archived = session.trajectory_id
        if session.epoch == store.epoch or not session.messages or recorded.current(archived) != archived:
            return recorded.current(archived)  # a turn carried it meanwhile (or nothing to carry it with)
        carrier = "traj-" + uuid.uuid4().hex
        record = {
            "kind": "turn",
            "trajectory_id": carrier,
            "turn": 0,
            "session": session.id,
            "origin": "rotated",
            "parent": archived,
            "model_version": session.version,
            "tokenizer": session.head.get("tokenizer"),
            "prompt_length": session.prompt_length,
            "token_ids": session.ids.token_ids,
            "action_mask": session.ids.action_mask,
            "sample_logprobs": session.ids.sample_logprobs,
            "finish_reason": session.head["finish_reason"],
            "messages": session.messages,
            "time": time.time(),
            "tools": session.head.get("tools") or [],
            "carried_turns": session.num_turns - 1,  # the record is the last of them: no turn of its own
            "started": session.started,
        }
        session.epoch = await asyncio.to_thread(store.append, record)
        session.trajectory_id = carrier
        recorded.carry(archived, carrier)
        recorded.add(carrier, session.id, turns=session.num_turns, epoch=session.epoch)
        return carrier
