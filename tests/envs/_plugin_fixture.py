"""Plugin environments for the registry tests, registered through `envs.plugins` ("_plugin_fixture:Class")."""

import os
import time

from lopd_core.envs import Task, format_call
from lopd_core.envs.declarative import DeclarativeToolEnv, ToolError, ToolSpec


def add_note(state: dict, title: str, text: str, tags: list[str] | None = None) -> dict:
    """Add a note.

    Args:
        title: the note's title
        text: what it says
    """
    if title in state["notes"]:
        raise ToolError("exists")
    state["notes"][title] = {"text": text, "tags": tags or []}
    return {"status": "added"}


def crash(state: dict) -> dict:
    """A tool with a bug."""
    return {}["missing"]


def _count(state: dict, prefix: str = "") -> int:
    return sum(1 for t in state["notes"] if t.startswith(prefix))


COUNT = ToolSpec(
    {
        "name": "count_notes",
        "description": "How many notes there are.",
        "parameters": {"type": "object", "properties": {"prefix": {"type": "string"}}},
    },
    _count,
)


class NotesEnv(DeclarativeToolEnv):
    """No task file of its own: its tasks come from envs.task_files."""

    name = "notes"
    tools = (add_note, COUNT, crash)


class CounterEnv(DeclarativeToolEnv):
    """Tasks from its own make_tasks (seeded), no task file."""

    name = "counter"
    tools = (add_note, COUNT)
    splits = ("train", "test_id")

    @classmethod
    def make_tasks(cls, split, n, seed):
        return [
            Task(
                task_id=f"{cls.name}/{split}/{seed}/{i}",
                env=cls.name,
                split=split,
                template="add",
                world=cls.name,
                instruction=f"Add a note called n{i}.",
                spec={"state": {"notes": {}}, "checks": [{"op": "present", "path": ["notes", f"n{i}"]}]},
                max_turns=3,
            )
            for i in range(n)
        ]


class EchoEnv(CounterEnv):
    """Breaks the contract: its first user turn is not the task's instruction."""

    name = "echo"

    def reset(self, task):
        first = super().reset(task)
        return type(first)(system=first.system, user=first.user.upper())


class Misnamed(CounterEnv):
    name = "something_else"


def solve_library(task: Task) -> list[str]:
    """A scripted player for the example library's templates (reads the ids from the task's state)."""
    state = task.spec["state"]
    title = {b["title"]: i for i, b in state["books"].items()}
    member = {m["name"]: i for i, m in state["members"].items()}
    words = task.instruction.replace("'", "|").split("|")
    if task.template == "lend":
        name = task.instruction.rsplit(" to ", 1)[1].rstrip(".")
        return [format_call("lend_book", {"book": title[words[1]], "member": member[name]}), "Lent."]
    if task.template == "return":
        name = task.instruction.split(" ", 1)[0]
        return [format_call("return_book", {"book": title[words[1]], "member": member[name]}), "Returned."]
    if task.template == "hand_over":
        first, rest = task.instruction.split(" returns ", 1)
        second = rest.split(" and ", 1)[1].split(" borrows")[0]
        book = title[words[1]]
        return [
            format_call("return_book", {"book": book, "member": member[first]}),
            format_call("lend_book", {"book": book, "member": member[second]}),
            "Done.",
        ]
    if task.template == "by_author":
        author = task.instruction.removeprefix("Which of our books are by ").rstrip("?")
        return [
            format_call("books_by", {"author": author}),
            ", ".join(sorted(b["title"] for b in state["books"].values() if b["author"] == author)),
        ]
    if task.template == "loans_of":
        titles = [state["books"][loan["book"]]["title"] for loan in state["loans"]]
        return [format_call("find_member", {"name": task.instruction.split(" ")[2]}), ", ".join(titles)]
    raise AssertionError(task.template)


# ---- the trust boundary (issue #30 item 3): tools that reach past the episode's state --------------------------
def read_file(state: dict, path: str) -> str:
    """Read a file.

    Args:
        path: which file
    """
    with open(path) as f:
        return f.read(200)


def read_env(state: dict, name: str) -> str:
    """Read an environment variable.

    Args:
        name: the variable
    """
    return os.environ.get(name, "")


def connect(state: dict, port: int) -> str:
    """Open a TCP connection to 127.0.0.1 and say hello.

    Args:
        port: the port
    """
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        conn.sendall(b"hello from a tool")
    return "connected"


class SnoopEnv(CounterEnv):
    """Tools that read a file, an environment variable, a local port: what a model could ask of a careless tool."""

    name = "snoop"
    tools = (read_file, read_env, connect)


class SleepyEnv(CounterEnv):
    """A step that blocks for an hour."""

    name = "sleepy"

    def step(self, action):
        time.sleep(3600)
        return super().step(action)


# ---- tools the contract checker must call (issue #30 item 10) --------------------------------------------------
def broken_add(state: dict, title: str) -> dict:
    """Add a note (with a bug).

    Args:
        title: the note's title
    """
    return state["no such key"][title]


def broken_count(state: dict) -> int:
    """Count the notes (with a bug)."""
    return len(state) / 0


class BrokenToolsEnv(CounterEnv):
    """Every tool raises inside."""

    name = "broken_tools"
    tools = (broken_add, broken_count)


_CALLS = {"n": 0}


def ticket(state: dict) -> int:
    """Draw the next ticket number."""
    _CALLS["n"] += 1  # state outside the episode: the second episode sees the first one's calls
    return _CALLS["n"]


class GlobalStateEnv(CounterEnv):
    name = "global_state"
    tools = (add_note, ticket)
