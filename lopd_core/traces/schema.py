"""Trace tables: served conversations as a pandas frame guarded by a pandera schema, and their view as rollouts.

A trace is one trajectory of `lopd serve` (lopd_serve/): the ids the model saw and sampled, assembled from the
store's turn records (lopd_core/traces/store.py), with the version that served it and the feedback it got.
Why a schema of its own: a trace carries what a rollout row does not (session, parent trajectory, serving
version, whether anyone labeled it) and may be unlabeled. `traces_as_trajectories` maps it onto the rollout
table's columns (lopd_core/rollout/table.py), validated by that table's own schema, so whatever reads rollout
trajectories (the bank, distillation) reads traces the same way: its episode is the environment-style record an
experience text is built from, its world the one its instruction names. Unlabeled traces are left out there
unless asked for, and then carry reward 0 and success False — an unlabeled conversation is never a success.

Experience is what the model did: an assistant message the client wrote into the history (or a reply replayed
into a new trajectory) is rendered as forced ids (action mask 0), so it is context and never a distillation
target; and a trace holding one is never a success in the rollout view (the bank takes successes only), whatever
its label says — the model sampled only part of it. Each turn record adds exactly one sampled reply (a turn 0
carrying its parent's turns after a rotation counts as those turns too), so the forced ones number (assistant
messages − turns).
"""

from __future__ import annotations

import hashlib
import json
import re

import pandas as pd
import pandera.pandas as pa

from lopd_core.envs import Task
from lopd_core.envs.base import MAX_TURNS
from lopd_core.rollout.table import TRAJECTORY_SCHEMA, validate_trajectories

# why a trajectory started: a new session, an edited reply, a hot swap, other system/user text or tools, a
# turn after the previous trajectory was labeled (a label judges the turns it was given, no later one), or the
# first turn after a rotation moved the earlier ones into an archive (it carries them whole: store.py)
ORIGINS = ("new", "assistant_differs", "model_changed", "context_differs", "after_label", "rotated")
FINISH_REASONS = ("stop", "tool_calls", "length")
# finish_reason of a trace's last turn -> the rollout table's stop_reason. A conversation whose last turn asked
# for a tool and never came back was cut off by the client, as a turn limit cuts a rollout.
STOP_REASONS = {"stop": "answer", "length": "answer", "tool_calls": "turn_limit"}
SERVE_ENV = "serve"
# An instruction of the built-in worlds opens with its world's name in brackets ("[cobalt] Send 35 to ..."): what
# the client declares, and so what keys retrieval (bank.same_world) without anything privileged.
WORLD_PREFIX = re.compile(r"^\[([A-Za-z0-9_.-]+)\]")


def _lengths_agree(df: pd.DataFrame) -> pd.Series:
    n = df["token_ids"].map(len)
    return (n == df["action_mask"].map(len)) & (n == df["sample_logprobs"].map(len))


TRACE_SCHEMA = pa.DataFrameSchema(
    {
        "trajectory_id": pa.Column(str, unique=True),
        "session": pa.Column(str),
        "parent": pa.Column(str),  # "" unless the trajectory branched off another of its session
        "origin": pa.Column(str, pa.Check.isin(ORIGINS)),
        "model_version": pa.Column(str),
        "tokenizer": pa.Column(str),  # the fingerprint of the tokenizer that made its ids ("" before they were kept)
        "tools": pa.Column(str),  # JSON list of the tool schemas the request declared
        "token_ids": pa.Column(object, pa.Check(lambda s: s.map(len) > 0, element_wise=False)),
        "action_mask": pa.Column(object, pa.Check(lambda m: all(v in (0, 1) for v in m), element_wise=True)),
        "sample_logprobs": pa.Column(object, pa.Check(lambda lp: all(v <= 1e-6 for v in lp), element_wise=True)),
        "prompt_length": pa.Column(int, pa.Check.gt(0)),
        "num_turns": pa.Column(int, pa.Check.ge(1)),
        "finish_reason": pa.Column(str, pa.Check.isin(FINISH_REASONS)),
        "labeled": pa.Column(bool),
        "reward": pa.Column(float, pa.Check.in_range(0.0, 1.0), nullable=True),  # NaN when unlabeled
        "success": pa.Column(bool),
        "checks": pa.Column(str),  # JSON: the check results the feedback carried (null when none)
        "messages": pa.Column(str),  # JSON list of the OpenAI messages, the replies included
        "started": pa.Column(float),
        "ended": pa.Column(float),
    },
    checks=[
        pa.Check(_lengths_agree, error="token_ids, action_mask and sample_logprobs differ in length"),
        pa.Check(lambda df: ~df["success"] | df["labeled"], error="success without feedback"),
        pa.Check(lambda df: ~df["success"] | (df["reward"] == 1.0), error="success with reward < 1"),
        pa.Check(lambda df: df["labeled"] == df["reward"].notna(), error="labeled and reward disagree"),
    ],
    strict=True,
    coerce=False,
)


def validate_traces(frame: pd.DataFrame) -> pd.DataFrame:
    """Validate lazily: a SchemaErrors lists every failure case, not just the first."""
    return TRACE_SCHEMA.validate(frame, lazy=True)


def trace_world(instruction: str, tools_json: str) -> str:
    """The world a trace was played in: the bracketed name its instruction opens with, else its declared tool set
    (`tools:` + a short hash of the tool names), so traces of one tool set share a world in retrieval."""
    named = WORLD_PREFIX.match(instruction)
    if named:
        return named.group(1)
    names = sorted(t.get("function", t).get("name", "") for t in json.loads(tools_json) if isinstance(t, dict))
    return "tools:" + hashlib.sha256("\n".join(names).encode()).hexdigest()[:12]


def episode_records(messages: list[dict]) -> list[dict]:
    """The environment-style episode record of a served conversation, the form experience texts are built from
    (lopd_core/experience.py): per assistant turn its final answer (`action`), or per call it made (several in one
    turn: OpenAI's parallel calls) the call and the observation the client sent back for it, found by its
    `tool_call_id` among the tool messages before the next assistant turn (else by position; none: cut off). A
    call whose arguments are not a JSON object keeps them as the raw string."""
    records: list[dict] = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        calls = m.get("tool_calls") or []
        if not calls:
            records.append({"action": _text(m.get("content"))})
            continue
        answers = []  # the tool messages the client sent back before the next assistant turn
        for later in messages[i + 1 :]:
            if later.get("role") == "assistant":
                break
            if later.get("role") == "tool":
                answers.append(later)
        by_id = {a.get("tool_call_id"): a for a in answers if a.get("tool_call_id")}
        for k, call in enumerate(calls):
            fn = call.get("function", {})
            try:
                arguments = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                arguments = fn.get("arguments")
            reply = by_id.get(call.get("id")) or (answers[k] if k < len(answers) else None)
            records.append(
                {
                    "call": {"name": fn.get("name", ""), "arguments": arguments},
                    "observation": _text((reply or {}).get("content")),
                }
            )
    return records


def _text(content) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts joined."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _task_json(row, world: str) -> str:
    """The Task a trace stands for: its first user message as the instruction, the system text and the tools as
    the spec, the world its instruction (or tool set) declares. A trace has no environment to replay it in; the Task
    keeps the rollout table's `task` column whole and is what retrieval reads."""
    messages = json.loads(row["messages"])
    user = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    system = next((_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")), "")
    task = Task(
        task_id=row["trajectory_id"],
        env=SERVE_ENV,
        split="train",
        template=SERVE_ENV,
        world=world,
        instruction=user,
        spec={
            "system": system,
            "tools": json.loads(row["tools"]),
            "session": row["session"],
            "model_version": row["model_version"],
        },
        max_turns=min(max(int(row["num_turns"]), 1), MAX_TURNS),
    )
    return task.to_json()


def _instruction(messages_json: str) -> str:
    return next((_text(m.get("content")) for m in json.loads(messages_json) if m.get("role") == "user"), "")


def forced_replies(messages_json: str, num_turns: int) -> int:
    """Assistant messages of a trace that the model did not sample in it (written by the client, or replayed)."""
    return sum(m.get("role") == "assistant" for m in json.loads(messages_json)) - num_turns


def traces_as_trajectories(traces: pd.DataFrame, *, labeled_only: bool = True) -> pd.DataFrame:
    """Traces as rows of the rollout table (same columns, same schema): what a reader of rollout trajectories
    (the bank, distillation) loads. `labeled_only` drops conversations no feedback reached; with False they come
    with reward 0.0 and success False. A trace with a reply the model did not sample is no success (module
    docstring), nor one whose first user message is blank (an experience is found by its task's text, and the
    bank refuses a row without one); its label's reward stays."""
    traces = validate_traces(traces)
    if labeled_only:
        traces = traces[traces["labeled"]]
    worlds = [trace_world(_instruction(m), t) for m, t in zip(traces["messages"], traces["tools"])]
    rows = [
        {
            "task_id": r["trajectory_id"],
            "env": SERVE_ENV,
            "split": "train",
            "template": SERVE_ENV,
            "world": world,
            "sample_index": 0,
            "token_ids": list(r["token_ids"]),
            "action_mask": list(r["action_mask"]),
            "sample_logprobs": [float(v) for v in r["sample_logprobs"]],
            "prompt_length": int(r["prompt_length"]),
            "reward": float(r["reward"]) if r["labeled"] else 0.0,
            "success": bool(r["success"])
            and forced_replies(r["messages"], int(r["num_turns"])) <= 0
            and bool(_instruction(r["messages"]).strip()),
            "stop_reason": STOP_REASONS[r["finish_reason"]],
            "num_turns": int(r["num_turns"]),
            "episode": json.dumps(episode_records(json.loads(r["messages"]))),
            "experiences": "[]",
            "task": _task_json(r, world),
        }
        for world, (_, r) in zip(worlds, traces.iterrows())
    ]
    return validate_trajectories(pd.DataFrame(rows, columns=list(TRAJECTORY_SCHEMA.columns)))
