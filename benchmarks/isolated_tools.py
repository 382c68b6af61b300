"""The cost of `envs.isolate_tools`: a plugin environment's episodes in the trainer's process against the same
episodes in a sandboxed child (lopd_core/envs/isolated.py), side by side in one run.

Plays the example plugin (`library`, examples/lopd-example-env) on the same tasks and actions three ways, one
after the other: the environment as it is (`bare`, no timeout: what a plugin cost before the guard), in the
trainer's process behind the per-step timeout (`in_process`, the default: each call in a worker thread), and
isolated (`isolated`: a child process per episode, JSON lines over pipes). Prints JSON: per mode the median
milliseconds of one `step` and of one episode's start (construction and `reset`, where the isolated child is
spawned), the whole episode, and the ratios against `in_process`; and whether the three played the same
observations and rewards.

    .venv/bin/python benchmarks/isolated_tools.py [--episodes 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopd_core  # noqa: F401
from lopd_core.envs import format_call, make_tasks, registry
from lopd_core.envs.registry import env_class


def actions_for(task) -> list[str]:
    """Tool calls that read the task's own state (lookups that succeed), then an answer, within its turns."""
    state = task.spec["state"]
    book = next(iter(state["books"].values()))
    member_id, member = next(iter(state["members"].items()))
    calls = [
        format_call("find_book", {"title": book["title"]}),
        format_call("find_member", {"name": member["name"]}),
        format_call("list_loans", {"member": member_id}),
        format_call("books_by", {"author": book["author"]}),
    ]
    return calls[: task.max_turns - 1] + ["done"]


def play(make, tasks) -> tuple[list[float], list[float], list[float], list]:
    starts, steps, episodes, seen = [], [], [], []
    for task in tasks:
        began = time.perf_counter()
        env = make()
        env.reset(task)
        starts.append(time.perf_counter() - began)
        for action in actions_for(task):
            t = time.perf_counter()
            r = env.step(action)
            steps.append(time.perf_counter() - t)
            seen.append((r.observation, r.reward, r.done))
            if r.done:
                break
        episodes.append(time.perf_counter() - began)
    return starts, steps, episodes, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three modes, interleaved")
    args = parser.parse_args()
    tasks = make_tasks("library", "train", args.episodes, seed=0)
    cls = env_class("library")

    def guarded(isolate: bool):
        registry.use_config(SimpleNamespace(plugins={}, task_files={}, isolate_tools=isolate, step_timeout_s=30.0))
        return lambda: registry.new_env("library")

    makers = {"bare": lambda: cls(), "in_process": guarded(False), "isolated": guarded(True)}
    samples = {mode: ([], [], []) for mode in makers}
    plays = {}
    for _ in range(args.repeats):  # interleaved, so a busy moment of the machine hits every mode alike
        for mode, make in makers.items():
            if mode != "bare":
                guarded(mode == "isolated")
            starts, steps, episodes, seen = play(make, tasks)
            for into, values in zip(samples[mode], (starts, steps, episodes)):
                into.extend(values)
            plays[mode] = seen
    out = {
        "episodes": args.episodes,
        "repeats": args.repeats,
        "steps_per_episode": round(len(plays["bare"]) / args.episodes, 2),
        "python": sys.version.split()[0],
    }
    for mode, (starts, steps, episodes) in samples.items():
        out[mode] = {
            "step_ms": 1e3 * statistics.median(steps),
            "start_ms": 1e3 * statistics.median(starts),
            "episode_ms": 1e3 * statistics.median(episodes),
        }
    base = dict(out["in_process"])
    for mode in makers:
        out[mode].update({f"{k}_vs_in_process": round(out[mode][k] / base[k], 2) for k in base})
        out[mode] = {k: (round(v, 4) if k in base else v) for k, v in out[mode].items()}
    out["same_results"] = plays["bare"] == plays["in_process"] == plays["isolated"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
