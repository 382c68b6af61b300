"""`POST /v1/feedback`: a reward (and success) for a conversation this process served, appended to the store.

A label judges the turns it was given: the record keeps how many (`turns`), and the session's next turn starts a
new trajectory (sessions.py `plan_turn`), so a label never covers turns nobody judged. A label may land only on
a trajectory this process recorded for that session (among the latest `Recorded.cap`), so a client cannot label
another's conversation by guessing its id.

After a rotation (`lopd serve store rotate`), a label for a trajectory that a later turn carried on into the live
store lands on the trajectory that carries it (the answer names it); one for the archived trajectory its session is
still on is preceded by a turn 0 that carries it whole into the live store (sessions.carry_for_label), and lands
there. One for an archived trajectory whose session is gone (closed, or gone on in another trajectory) is written
to the live store all the same: nothing is lost, but a reader of either store alone skips it with a warning.
"""

from __future__ import annotations

import asyncio
import math
import time

from fastapi import APIRouter, Depends

from lopd_serve.deps import RecordedTrajectories, Sessions, Store, authorized, ensure_room
from lopd_serve.protocol import ApiError, Feedback
from lopd_serve.responses import FeedbackAnswer
from lopd_serve.sessions import carry_for_label

router = APIRouter(dependencies=[Depends(authorized)])


def _check_reward(fb: Feedback) -> None:
    if not math.isfinite(fb.reward) or not 0.0 <= fb.reward <= 1.0:
        raise ApiError(422, f"reward={fb.reward}: expected a number in [0, 1]", "invalid_reward", param="reward")
    if fb.success and fb.reward != 1.0:
        raise ApiError(
            422,
            f"success with reward={fb.reward}: a success passes every check (reward 1)",
            "invalid_reward",
            param="success",
        )


@router.post("/v1/feedback")
async def feedback(fb: Feedback, sessions: Sessions, store: Store, recorded: RecordedTrajectories) -> FeedbackAnswer:
    _check_reward(fb)
    session = sessions.find(fb.session)
    # a trajectory a rotation archived and a later turn carried on: the label lands on the carrier (sessions.py)
    trajectory_id = recorded.current(fb.trajectory_id or (session.trajectory_id if session else ""))
    if not trajectory_id:
        raise ApiError(
            404,
            f"session {fb.session!r}: no conversation recorded (or it was closed for idleness: name trajectory_id)",
            "unknown_session",
            param="session",
        )
    if recorded.get(trajectory_id) != fb.session:  # a label must land on a conversation of that session
        raise ApiError(
            404,
            f"trajectory {trajectory_id!r}: not a conversation of session {fb.session!r} in this server's "
            f"store (among its latest {recorded.cap})",
            "unknown_trajectory",
            param="trajectory_id",
        )
    ensure_room(store, feedback=True)  # labels of conversations already answered may pass the bound (its reserve)
    if session is not None and session.trajectory_id == trajectory_id and recorded.epoch(trajectory_id) != store.epoch:
        trajectory_id = await carry_for_label(store, recorded, session)  # its turns archived: carried on first
    turns = recorded.turns(trajectory_id)
    record = {
        "kind": "feedback",
        "session": fb.session,
        "trajectory_id": trajectory_id,
        "reward": fb.reward,
        "success": fb.success,
        "checks": fb.checks,
        "time": time.time(),
        "turns": turns,  # the turns this label judges; a turn recorded after them clears it (store.py)
    }
    await asyncio.to_thread(store.append, record)
    if session is not None and session.trajectory_id == trajectory_id:
        session.labeled = True  # its conversation is judged: the first to make room (sessions.py)
        session.judged = trajectory_id  # and its next turn starts a new trajectory (plan_turn)
    return FeedbackAnswer(trajectory_id=trajectory_id, turns=turns)
