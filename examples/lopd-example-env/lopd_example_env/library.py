"""A lending library as a declarative LOPD environment: books, members, loans.

State: ``{"books": {id: {"title", "author", "copies"}}, "members": {id: {"name"}}, "loans": [{"book",
"member"}]}``. ``copies`` counts the copies on the shelf, so lending takes one and a return puts it back. Tools
are plain functions of the state; ``books_by`` shows the other way to declare one, a JSON-schema spec.
"""

from __future__ import annotations

from pathlib import Path

from lopd_core.envs.declarative import DeclarativeToolEnv, ToolError, ToolSpec


def _book_id(state: dict, book: str) -> dict:
    if book not in state["books"]:
        raise ToolError("no such book")
    return state["books"][book]


def find_book(state: dict, title: str) -> dict:
    """Look a book up by its title.

    Args:
        title: the book's title
    """
    for book_id, book in state["books"].items():
        if book["title"].lower() == title.strip().lower():
            return {"title": book["title"], "author": book["author"], "on_shelf": book["copies"], "id": book_id}
    raise ToolError("not found")


def find_member(state: dict, name: str) -> dict:
    """Look a member up by name.

    Args:
        name: the member's name
    """
    for member_id, member in state["members"].items():
        if member["name"].lower() == name.strip().lower():
            return {"name": member["name"], "id": member_id}
    raise ToolError("not found")


def lend_book(state: dict, book: str, member: str) -> dict:
    """Lend a copy of a book to a member.

    Args:
        book: book id
        member: member id
    """
    record = _book_id(state, book)
    if member not in state["members"]:
        raise ToolError("no such member")
    if record["copies"] < 1:
        raise ToolError("no copy on the shelf")
    record["copies"] -= 1
    state["loans"].append({"book": book, "member": member})
    return {"status": "lent"}


def return_book(state: dict, book: str, member: str) -> dict:
    """Take back a book a member has on loan.

    Args:
        book: book id
        member: member id
    """
    loan = {"book": book, "member": member}
    if loan not in state["loans"]:
        raise ToolError("no such loan")
    state["loans"].remove(loan)
    _book_id(state, book)["copies"] += 1
    return {"status": "returned"}


def list_loans(state: dict, member: str) -> list:
    """Titles a member has on loan.

    Args:
        member: member id
    """
    if member not in state["members"]:
        raise ToolError("no such member")
    return [state["books"][loan["book"]]["title"] for loan in state["loans"] if loan["member"] == member]


def _books_by(state: dict, author: str) -> list:
    return sorted(b["title"] for b in state["books"].values() if b["author"].lower() == author.strip().lower())


BOOKS_BY = ToolSpec(
    schema={
        "name": "books_by",
        "description": "Titles the library holds by an author.",
        "parameters": {
            "type": "object",
            "required": ["author"],
            "properties": {"author": {"type": "string", "description": "the author's name"}},
        },
    },
    fn=_books_by,
)


class LibraryEnv(DeclarativeToolEnv):
    name = "library"
    tools = (find_book, find_member, lend_book, return_book, list_loans, BOOKS_BY)
    task_file = Path(__file__).with_name("tasks.jsonl")
    max_turns = 8
