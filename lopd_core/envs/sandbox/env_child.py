"""The child of an isolated plugin environment: one environment instance behind the sandbox's layers, driven by
JSON lines (lopd_core/envs/isolated.py is the parent's side).

Run as `python -I -u env_child.py WORKDIR` in a fresh session with a scrubbed environment. Unlike child.py it
keeps site-packages (no -S): the plugin and lopd_core must import as they do in the trainer (editable installs
are found through site-packages' hooks). Why this order:

1. import the plugin's module and construct the environment. The trainer has already imported the same module
   (it draws the tasks), so its import-time code gains nothing by running here first; and once privileges are
   dropped, the interpreter's own files may be unreadable (a root-owned home).
2. apply the sandbox's layers (child.py `isolate`: unprivileged uid, new user/network/pid namespaces, Landlock
   to the standard library and the private WORKDIR, rlimits, the audit hook).
3. serve `reset` and `step` — the calls whose arguments the model chose — until the parent closes the pipe.

Only JSON crosses back: the parent never unpickles or evaluates anything from here. The plugin's prints go to
stderr (a file in WORKDIR the parent reads only for a crash), never onto the protocol's descriptor.

Protocol, one JSON object per line:
  parent -> child, first: {"spec": "module:Class", "name", "sys_path": [...], "limits", "uid", "gid", "audit_hook"}
  child -> parent:        {"ready": {"isolation": {...}}} or {"setup_error": "Type: message"}
  parent -> child:        {"op": "reset", "task": TASK_JSON} | {"op": "step", "action": TEXT} | {"op": "episode"}
  child -> parent:        {"value": ..., "internal_errors": [new entries], "episode": [...] (when done)}
                          or {"error": "Type: message", "type": "RuntimeError" | "ValueError" | "TypeError" | "other"
                              | "not_json" (the value returned cannot be sent: not JSON, or too large)}
"""

import importlib
import importlib.util
import json
import os
import sys

MAX_LINE = 64 * 1024 * 1024  # bytes of one request; an action is far smaller
MAX_REPLY = 32 * 1024 * 1024  # bytes of one reply (an observation, an episode record)
KNOWN_TYPES = (RuntimeError, ValueError, TypeError)


def _load_sandbox_child():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")
    spec = importlib.util.spec_from_file_location("_lopd_sandbox_child", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import(spec: str):
    module_name, _, attr = spec.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):  # from the parent's configuration, never from the model
        obj = getattr(obj, part)
    return obj


class Channel:
    """The protocol's two descriptors, taken before any plugin code runs; fds 0 and 1 then point elsewhere."""

    def __init__(self) -> None:
        self._in = os.fdopen(os.dup(0), "rb")
        self._out = os.dup(1)
        os.dup2(2, 1)  # print() of the plugin lands in the stderr file
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)

    def read(self) -> dict | None:
        line = self._in.readline(MAX_LINE)
        if not line:
            return None
        return json.loads(line)

    def send(self, record: dict) -> None:
        self.send_line(json.dumps(record))

    def send_line(self, line: str) -> None:
        data = memoryview((line + "\n").encode())
        while data:
            data = data[os.write(self._out, data) :]


def _reply(value, env, seen: int) -> tuple[dict, int]:
    errors = getattr(env, "internal_errors", None)
    new = [str(e)[:2000] for e in errors[seen:]] if isinstance(errors, list) else []
    return {"value": value, "internal_errors": new}, seen + len(new)


def serve(channel: Channel, env, task_cls, describe) -> None:
    seen = 0
    while True:
        request = channel.read()
        if request is None:
            return
        op = request.get("op")
        try:
            if op == "reset":
                first = env.reset(task_cls.from_json(request["task"]))
                reply, seen = _reply(
                    {"system": first.system, "user": first.user, "tools": list(first.tools)}, env, seen
                )
            elif op == "step":
                r = env.step(request["action"])
                reply, seen = _reply(
                    {"observation": r.observation, "reward": r.reward, "done": r.done, "info": r.info}, env, seen
                )
                if r.done:
                    reply["episode"] = list(env.episode)
            elif op == "episode":
                reply, seen = _reply(list(env.episode), env, seen)
            else:
                raise ValueError(f"unknown request {op!r}")
        except BaseException as exc:  # noqa: BLE001  SystemExit too: reported, and the child serves on
            kind = next((t.__name__ for t in KNOWN_TYPES if isinstance(exc, t)), "other")
            channel.send({"error": describe(exc), "type": kind})
            continue
        try:  # the contract's values are plain data: anything else is the environment's fault, not the caller's
            line = json.dumps(reply, allow_nan=True)
            if len(line) > MAX_REPLY:
                raise ValueError(f"{len(line)} bytes of JSON, more than {MAX_REPLY}")
        except BaseException as exc:  # noqa: BLE001  serializing runs the values' own code (dict subclasses)
            channel.send({"error": describe(exc), "type": "not_json"})
            continue
        channel.send_line(line)


def main() -> None:
    workdir = sys.argv[1]
    os.chdir(workdir)
    channel = Channel()
    job = channel.read()
    sandbox_child = _load_sandbox_child()
    try:
        sys.path[:0] = [p for p in job["sys_path"] if p not in sys.path]
        env = _import(job["spec"])()
        from lopd_core.envs.base import Task

        isolation = sandbox_child.isolate(job, workdir)
    except BaseException as exc:  # noqa: BLE001  fail closed: no reset or step without every layer in place
        channel.send({"setup_error": sandbox_child.describe(exc)})
        os._exit(3)
    channel.send({"ready": {"isolation": isolation}})
    serve(channel, env, Task, sandbox_child.describe)
    os._exit(0)  # at once: no waiting for threads a tool left running


if __name__ == "__main__":
    main()
