"""Files templates. File ids are only visible through files_list; contents through files_read."""

from __future__ import annotations

from . import Draft, template
from .common import call
from .expect import answer, eq, file_content, file_removed, files_count
from .fixtures import FOLDERS, WORDS, files_state
from .recipes import files_find, files_list, files_read, files_remove, files_write, folder_arg


def _setup(rng, k=2, per_folder=(1, 3)):
    folders = rng.sample(FOLDERS, k)
    state, h = files_state(rng, folders, per_folder)
    return state, h, folders


def _pick(rng, state, h, folder):
    return rng.choice(sorted(n for n, f in h.items() if state["files"][f]["folder"] == folder))


def _o_overwrite(p, conv):
    file = yield from files_find(conv, p["folder"], p["name"])
    yield from files_write(conv, file, p["text"])


@template("files_overwrite", ("files",), _o_overwrite)
def _overwrite(rng, conv):
    state, h, folders = _setup(rng)
    name = _pick(rng, state, h, folders[0])
    new = rng.choice([w for w in WORDS if w != state["files"][h[name]]["content"]])
    text = f"Replace the text of {name} in {folders[0]} with '{new}'."
    checks = file_content(h[name], new) + [files_count(state)]
    return Draft(text, {"files": state}, checks, {"folder": folders[0], "name": name, "text": new})


def _o_append(p, conv):
    file = yield from files_find(conv, p["folder"], p["name"])
    old = yield from files_read(file)
    yield from files_write(conv, file, f"{old}, {p['text']}")


@template("files_append", ("files",), _o_append)
def _append(rng, conv):
    state, h, folders = _setup(rng)
    name = _pick(rng, state, h, folders[0])
    old = state["files"][h[name]]["content"]
    add = rng.choice([w for w in WORDS if w != old])
    text = f"Add '{add}' to the end of {name} in {folders[0]}, after a comma."
    checks = file_content(h[name], f"{old}, {add}") + [files_count(state)]
    return Draft(text, {"files": state}, checks, {"folder": folders[0], "name": name, "text": add})


def _o_remove(p, conv):
    file = yield from files_find(conv, p["folder"], p["name"])
    yield from files_remove(conv, file)


@template("files_remove", ("files",), _o_remove)
def _remove(rng, conv):
    state, h, folders = _setup(rng)
    name = _pick(rng, state, h, folders[0])
    text = f"Remove {name} from the {folders[0]} folder."
    return Draft(text, {"files": state}, [file_removed(conv, h[name])], {"folder": folders[0], "name": name})


def _o_read(p, conv):
    file = yield from files_find(conv, p["folder"], p["name"])
    return (yield from files_read(file))


@template("files_read_answer", ("files",), _o_read)
def _read(rng, conv):
    state, h, folders = _setup(rng)
    name = _pick(rng, state, h, folders[0])
    content = state["files"][h[name]]["content"]
    text = f"What does {name} in my {folders[0]} folder say?"
    return Draft(
        text,
        {"files": state},
        [answer(content), files_count(state)],
        {"folder": folders[0], "name": name},
        answer=content,
    )


def _o_create(p, conv):
    yield call("files_create", folder=folder_arg(conv, p["folder"]), name=p["name"], content=p["text"])


@template("files_create", ("files",), _o_create)
def _create(rng, conv):
    state, h, folders = _setup(rng)
    name = rng.choice([n for n in ("new.txt", "shop.txt", "trip.txt", "gift.txt") if n not in h])
    body = rng.choice(WORDS)
    text = f"Create {name} in {folders[1]} containing '{body}'."
    checks = [
        {
            "op": "has",
            "path": ["files", "files"],
            "value": {"name": name, "folder": folders[1], "content": body},
            "n": 1,
        },
        files_count(state, +1),
    ]
    return Draft(text, {"files": state}, checks, {"folder": folders[1], "name": name, "text": body})


def _o_move(p, conv):
    file = yield from files_find(conv, p["src"], p["name"])
    yield call("files_move", file=file, folder=folder_arg(conv, p["dst"]))


@template("files_move", ("files",), _o_move)
def _move(rng, conv):
    state, h, folders = _setup(rng)
    name = _pick(rng, state, h, folders[0])
    text = f"Move {name} from {folders[0]} to {folders[1]}."
    checks = [eq(["files", "files", h[name], "folder"], folders[1]), files_count(state)]
    return Draft(text, {"files": state}, checks, {"src": folders[0], "dst": folders[1], "name": name})


def _o_copy(p, conv):
    rows = {r["name"]: r["id"] for r in (yield from files_list(conv, p["folder"]))}
    body = yield from files_read(rows[p["a"]])
    yield from files_write(conv, rows[p["b"]], body)


@template("files_copy_text", ("files",), _o_copy)
def _copy(rng, conv):
    state, h, folders = _setup(rng, per_folder=(2, 3))
    a, b = rng.sample(sorted(n for n, f in h.items() if state["files"][f]["folder"] == folders[0]), 2)
    body = state["files"][h[a]]["content"]
    state["files"][h[b]]["content"] = rng.choice([w for w in WORDS if w != body])
    text = f"In my {folders[0]} folder, copy the text of {a} into {b}."
    checks = file_content(h[b], body) + [eq(["files", "files", h[a], "content"], body)]
    return Draft(text, {"files": state}, checks, {"folder": folders[0], "a": a, "b": b})
