"""A trace store written with lopd_core.traces' writer from real tiny-model rollouts of toolworld tasks: the ids
the model saw and sampled, as `lopd serve` would record them, with feedback on some of them."""

from __future__ import annotations

from lopd_core.envs import make_tasks
from lopd_core.model.chat import make_chat
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout
from lopd_core.traces import TraceStore
from lopd_core.traces.fingerprint import tokenizer_fingerprint

TOOLS = [{"type": "function", "function": {"name": "bank_pay", "parameters": {"type": "object"}}}]


def turn_record(tid: str, traj, *, session: str, messages: list[dict]) -> dict:
    """One served turn holding the whole trajectory (a one-turn conversation: what the reader assembles)."""
    return {
        "kind": "turn",
        "trajectory_id": tid,
        "turn": 0,
        "session": session,
        "origin": "new",
        "parent": "",
        "model_version": "champion-v1",
        "tools": TOOLS,
        "prompt_length": int(traj.prompt_length),
        "token_ids": list(traj.token_ids),
        "action_mask": list(traj.action_mask),
        "sample_logprobs": [float(v) for v in traj.sample_logprobs],
        "finish_reason": "stop",
        "messages": messages,
        "time": 1.0,
    }


def served_turns(tid: str, traj, *, session: str, messages: list[dict]) -> list[dict]:
    """The trajectory as the server records a two-turn conversation: turn 0 up to the model's tool call, turn 1
    from the tool's message on (one sampled reply each; the ids split anywhere, the reader joins them)."""
    whole = turn_record(tid, traj, session=session, messages=messages)
    cut_ids = int(traj.prompt_length) + (len(traj.token_ids) - int(traj.prompt_length)) // 2
    cut_messages = next(i for i, m in enumerate(messages) if m["role"] == "tool")
    first, second = dict(whole), {k: v for k, v in whole.items() if k not in ("tools", "origin", "parent")}
    for name in ("token_ids", "action_mask", "sample_logprobs"):
        first[name], second[name] = whole[name][:cut_ids], whole[name][cut_ids:]
    first.update(messages=messages[:cut_messages], finish_reason="tool_calls")
    second.update(turn=1, origin="extends", messages=messages[cut_messages:], prompt_length=0)
    return [first, second]


def conversation(task, answer: str) -> list[dict]:
    """A served conversation of `task`: one tool call, its observation, then the answer."""
    return [
        {"role": "system", "content": "tools"},
        {"role": "user", "content": task.instruction},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bank_pay", "arguments": '{"to": "Noah"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "paid"},
        {"role": "assistant", "content": answer},
    ]


def write_store(folder, model, tokenizer, *, n: int, labels: dict[int, tuple[float, bool]], seed: int = 0):
    """`n` traces of tiny-model rollouts on toolworld train tasks in a store at `folder`; `labels` maps a trace's
    number to the (reward, success) its feedback posts (the others stay unlabeled). Returns the trajectory ids."""
    tasks = make_tasks("toolworld", "train", n, seed=seed)
    trajs = rollout(
        model,
        make_chat(tokenizer),
        [RolloutRequest(t, sample_index=0) for t in tasks],
        sampling=Sampling(temperature=1.0, top_p=1.0, max_new_tokens=16, max_context=400, max_observation_tokens=64),
        batch_size=n,
        seed=seed,
    )
    store = TraceStore(folder, segment_bytes=10**7, max_bytes=10**8)
    ids = []
    for i, (task, traj) in enumerate(zip(tasks, trajs)):
        tid = f"t{seed}-{i:03d}"
        ids.append(tid)
        for record in served_turns(tid, traj, session=f"s{i}", messages=conversation(task, f"done {i}")):
            store.append({**record, "tokenizer": tokenizer_fingerprint(tokenizer)})
        if i in labels:
            reward, success = labels[i]
            store.append(
                {
                    "kind": "feedback",
                    "session": f"s{i}",
                    "trajectory_id": tid,
                    "reward": reward,
                    "success": success,
                    "checks": None,
                }
            )
    store.close()
    return ids
