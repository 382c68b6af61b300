"""Sessions rebuilt from the trace store when a server starts, so a conversation goes on in its trajectory.

Why from the store: the turn records already hold everything a session keeps in memory — its trajectory's ids,
action mask and log-probs (the turns' segments joined), the messages with the replies it was given (their keys),
the model version, the tools (on turn 0) — and the feedback records say which trajectories were judged. A
restarted server that read nothing would start every continued conversation as a new trajectory (origin `new`,
its history forced), and feedback could no longer name what the previous process recorded.

What is rebuilt: per named session (anonymous one-turn sessions are not kept, as in memory), the state of its
latest trajectory, the most recently used `max_sessions` of them; and the feedback targets (which session each
trajectory belongs to, how many turns it has), the latest `cap`. A label covering every turn of a session's
trajectory makes its next turn start a new one (origin `after_label`), as it would have in the old process.
A session's idle time goes on from its last record's wall-clock time. A line a reader would refuse is skipped
here (the server starts; `lopd serve store check` names it), and so is a trajectory with a turn missing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from lopd_core.model.chat import TrajectoryIds
from lopd_core.traces.records import parse_record
from lopd_core.traces.store import segments
from lopd_serve.conversation import recorded_keys, reply_digest
from lopd_serve.sessions import REPLIES_KEPT, Recorded, Session, SessionTable

ANONYMOUS = "anon-"  # the prefix of a request's own one-turn session (sessions.SessionTable.get)


@dataclass
class _Trajectory:
    session: str
    version: str = ""
    tools_key: str = ""
    ids: TrajectoryIds = field(default_factory=TrajectoryIds)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    judged_turns: int = -1  # the turns its latest label judged (-1: none)
    prompt_length: int = 0
    started: float = 0.0
    head: dict = field(default_factory=dict)  # tools, tokenizer, last finish reason
    broken: bool = False  # a turn came out of order: not continued
    last_time: float = 0.0


def _records(store_dir: Path):
    for path in segments(store_dir):
        *complete, _torn = path.read_bytes().split(b"\n")
        for raw in complete:
            if raw.strip():
                record, _ = parse_record(raw)
                if record is not None:
                    yield record


def _read_trajectories(store_dir: Path) -> tuple[dict[str, _Trajectory], dict[str, str], dict[str, list[str]]]:
    """The store's trajectories by id, each named session's latest trajectory, and the digests of the replies
    each named session was given (oldest first, the latest REPLIES_KEPT)."""
    trajectories: dict[str, _Trajectory] = {}
    latest: dict[str, str] = {}  # session -> its latest trajectory
    replies: dict[str, list[str]] = {}  # session -> digests of the replies it was given, oldest first
    for rec in _records(store_dir):
        tid = rec["trajectory_id"]
        if rec["kind"] == "feedback":
            traj = trajectories.get(tid)
            if traj is not None:
                traj.judged_turns = int(rec.get("turns", traj.turns))
            continue
        traj = trajectories.get(tid)
        if traj is None:
            if rec["turn"] != 0:
                continue  # its turn 0 is in a segment moved away: nothing to continue
            traj = trajectories[tid] = _Trajectory(rec["session"], rec["model_version"])
            traj.tools_key = json.dumps(rec.get("tools") or [], sort_keys=True)
            traj.prompt_length, traj.started = rec["prompt_length"], float(rec.get("started", rec["time"]))
            traj.head = {"tools": rec.get("tools") or [], "tokenizer": rec.get("tokenizer")}
        if traj.broken or rec["turn"] != traj.turns:
            traj.broken = True
            continue
        if not rec["session"].startswith(ANONYMOUS):  # only a named session's latest trajectory is continued
            if latest.get(rec["session"]) != tid and rec["turn"] == 0:
                previous = trajectories.get(latest.get(rec["session"], ""))
                if previous is not None:  # its ids are no longer needed: only the counts feedback reads
                    previous.ids, previous.messages = TrajectoryIds(), []
                latest[rec["session"]] = tid
            traj.ids.token_ids += rec["token_ids"]
            traj.ids.action_mask += rec["action_mask"]
            traj.ids.sample_logprobs += [float(v) for v in rec["sample_logprobs"]]
            traj.messages += rec["messages"]
            if rec["messages"]:
                given = replies.setdefault(rec["session"], [])
                given.append(reply_digest(recorded_keys([rec["messages"][-1]])[-1]))
                del given[:-REPLIES_KEPT]
        traj.head["finish_reason"] = rec["finish_reason"]
        traj.turns += 1 + rec.get("carried_turns", 0)  # a turn 0 after a rotation carries its parent's turns
        traj.last_time = float(rec["time"])
    return trajectories, latest, replies


def resume_sessions(store_dir: str | Path, sessions: SessionTable, recorded: Recorded, *, epoch: int = 0) -> int:
    """Fill `sessions` and `recorded` from the store at `store_dir` (in its rotation `epoch`: every trajectory
    continued is whole in it); returns how many sessions were rebuilt."""
    trajectories, latest, replies = _read_trajectories(Path(store_dir))
    for tid, traj in sorted(trajectories.items(), key=lambda item: item[1].last_time):
        if not traj.broken:
            recorded.add(tid, traj.session, turns=traj.turns, epoch=epoch)
    now_wall, now = time.time(), time.monotonic()
    named = sorted(
        ((s, trajectories[t]) for s, t in latest.items() if not trajectories[t].broken), key=lambda st: st[1].last_time
    )
    rebuilt = 0
    for session_id, traj in named[-sessions.max_sessions :]:
        tid = latest[session_id]
        try:
            keys = recorded_keys(traj.messages)
        except (KeyError, TypeError, ValueError):  # a record of an older shape: its conversation starts anew
            continue
        judged = traj.judged_turns >= traj.turns
        sessions.sessions[session_id] = Session(
            id=session_id,
            trajectory_id=tid,
            version=traj.version,
            tools_key=traj.tools_key,
            keys=keys,
            replies=tuple(replies.get(session_id, ())),
            ids=traj.ids,
            num_turns=traj.turns,
            last_used=now - max(now_wall - traj.last_time, 0.0),
            labeled=judged,
            judged=tid if judged else "",
            epoch=epoch,
            prompt_length=traj.prompt_length,
            started=traj.started,
            messages=list(traj.messages),
            head=traj.head,
        )
        rebuilt += 1
    return rebuilt
