"""`lopd serve client`: the deployment world played through the endpoint with the official `openai` package.

The demo and the end-to-end test of `lopd serve`: each session plays one toolworld task as the rollout engine
would (reset, then one chat completion per turn, the tool calls executed here, client-side, by the environment's
`step`; every observation sent back as a `tool` message), and posts the episode's reward as feedback. N sessions
run at a chosen concurrency, so the server batches them. The server never executes anything.
"""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from lopd_core.envs import Task, make_env
from lopd_core.envs.base import checked_result
from lopd_serve.conversation import call_text


@dataclass(frozen=True)
class Episode:
    session: str
    task_id: str
    reward: float
    success: bool
    turns: int
    error: str = ""


def _action(message) -> tuple[object | None, str, dict]:
    """The reply as the environment's action, its tool call (if any) and the assistant message the history
    keeps (a call as OpenAI's `tool_calls`)."""
    if not message.tool_calls:
        return None, message.content or "", {"role": "assistant", "content": message.content or ""}
    call = message.tool_calls[0]
    said = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
        ],
    }
    return call, call_text(call.function.name, json.loads(call.function.arguments)), said


def play(
    client,
    base_url: str,
    api_key: str,
    task: Task,
    *,
    model: str,
    temperature: float,
    max_tokens: int,
    seed: int,
    session: str | None = None,
) -> Episode:
    import openai

    session = session or f"client-{uuid.uuid4().hex[:12]}"
    env = make_env(task)
    first = env.reset(task)
    messages: list[dict] = [{"role": "system", "content": first.system}, {"role": "user", "content": first.user}]
    tools = [{"type": "function", "function": dict(t)} for t in first.tools]
    turns = 0
    while True:
        try:
            response = client.chat.completions.create(
                model=model,
                messages=messages,
                tools=tools or openai.omit,
                # an environment takes one call per turn: a turn with several calls comes back with its first
                parallel_tool_calls=False if tools else openai.omit,
                temperature=temperature,
                max_tokens=max_tokens,
                seed=seed + turns,
                extra_headers={"X-Session-Id": session},
            )
        except openai.BadRequestError as exc:
            if getattr(exc, "code", None) != "context_length_exceeded":
                raise
            result = checked_result(task, env.step(""))  # the empty answer closes it, as the engine does
            break
        turns += 1
        call, action, said = _action(response.choices[0].message)
        messages.append(said)
        result = checked_result(task, env.step(action))
        if result.done:
            break
        messages.append({"role": "tool", "tool_call_id": call.id if call else "none", "content": result.observation})
    success = bool(result.info.get("success", False))
    reward = float(result.reward)
    success = success and reward == 1.0  # the trace table's rule: a success passed every check
    posted = httpx.post(
        f"{base_url}/feedback",
        json={"session": session, "reward": reward, "success": success, "checks": result.info.get("checks")},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=30,
    )
    posted.raise_for_status()
    return Episode(session, task.task_id, reward, success, turns)


def run_client(
    base_url: str,
    tasks: list[Task],
    *,
    concurrency: int,
    api_key: str = "none",
    model: str = "",
    temperature: float = 1.0,
    max_tokens: int = 64,
    seed: int = 0,
) -> dict:
    """Play every task as its own session, `concurrency` at a time; return a summary with every episode."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    model = model or client.models.list().data[0].id
    started = time.perf_counter()

    def one(i: int) -> Episode:
        try:
            return play(
                client,
                base_url,
                api_key,
                tasks[i],
                model=model,
                temperature=temperature,
                max_tokens=max_tokens,
                seed=seed + 1000 * i,
            )
        except Exception as exc:  # noqa: BLE001  counted and reported: the summary says how many failed
            return Episode("", tasks[i].task_id, 0.0, False, 0, f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        episodes = list(pool.map(one, range(len(tasks))))
    done = [e for e in episodes if not e.error]
    return {
        "sessions": len(episodes),
        "failed": len(episodes) - len(done),
        "success_rate": sum(e.success for e in done) / max(len(done), 1),
        "reward_mean": sum(e.reward for e in done) / max(len(done), 1),
        "seconds": round(time.perf_counter() - started, 2),
        "model": model,
        "errors": sorted({e.error for e in episodes if e.error})[:5],
        "episodes": [e.__dict__ for e in episodes],
    }
