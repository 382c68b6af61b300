"""Check builders: what the final state must look like, given the initial state.

Templates compose these; conventions enter here (e.g. the ledger entry kind a world books),
so a convention broken silently shows up as a failed check.
"""

from __future__ import annotations


def eq(path: list, value) -> dict:
    return {"op": "eq", "path": list(path), "value": value}


def answer(value) -> dict:
    return {"op": "answer_contains", "value": str(value)}


# ----------------------------------------------------------------------------- bank


def bank_payments(conv: dict, state: dict, payments: list[tuple[str, str, int]]) -> list[dict]:
    """Checks for exactly these payments (src, dst, amount) and nothing else."""
    kind = conv["bank"]["pay_tool"]
    balances = {a: v["balance"] for a, v in state["accounts"].items()}
    checks = []
    for src, dst, amount in payments:
        balances[src] -= amount
        balances[dst] += amount
        entry = {"kind": kind, "src": src, "dst": dst, "amount": amount}
        checks.append(
            {"op": "has", "path": ["bank", "ledger"], "value": entry, "n": payments.count((src, dst, amount))}
        )
    touched = sorted({a for p in payments for a in p[:2]})
    checks += [eq(["bank", "accounts", a, "balance"], balances[a]) for a in touched]
    checks.append({"op": "count", "path": ["bank", "ledger"], "value": len(state["ledger"]) + len(payments)})
    return checks


def bank_untouched(state: dict) -> list[dict]:
    return [{"op": "count", "path": ["bank", "ledger"], "value": len(state["ledger"])}]


def count(path: list, n: int) -> dict:
    return {"op": "count", "path": list(path), "value": n}


def has(path: list, value: dict, n: int | None = 1, like: dict | None = None) -> dict:
    check = {"op": "has", "path": list(path), "value": value}
    if n is not None:
        check["n"] = n
    if like:
        check["like"] = like
    return check


# ----------------------------------------------------------------------------- calendar


def cal_event(title: str, iso: str, start: int) -> dict:
    return has(["calendar", "events"], {"title": title, "date": iso, "start": start, "status": "confirmed"})


def cal_count(state: dict, delta: int) -> dict:
    return count(["calendar", "events"], len(state["events"]) + delta)


# ----------------------------------------------------------------------------- shop


def shop_orders(conv: dict, state: dict, orders: list[list[tuple[str, int]]]) -> list[dict]:
    """Exactly these new orders (each a list of (product, qty)), confirmed, via the world's flow."""
    c = conv["shop"]
    stock = {p: v["stock"] for p, v in state["products"].items()}
    checks = []
    for items in orders:
        rows = [{"product": p, "qty": q} for p, q in items]
        checks.append(has(["shop", "orders"], {"items": rows, "status": "confirmed", "channel": c["order_flow"]}))
        for p, q in items:
            stock[p] -= q
    touched = sorted({p for items in orders for p, _ in items})
    checks += [eq(["shop", "products", p, "stock"], stock[p]) for p in touched]
    checks.append(count(["shop", "orders"], len(state["orders"]) + len(orders)))
    return checks


# ----------------------------------------------------------------------------- files


def file_content(file: str, content: str) -> list[dict]:
    return [eq(["files", "files", file, "content"], content), eq(["files", "files", file, "locked"], False)]


def file_removed(conv: dict, file: str) -> dict:
    if conv["files"]["remove_tool"] == "delete":
        return {"op": "absent", "path": ["files", "files", file]}
    return eq(["files", "files", file, "folder"], "trash")


def files_count(state: dict, delta: int = 0) -> dict:
    return count(["files", "files"], len(state["files"]) + delta)


# ----------------------------------------------------------------------------- msg


def msg_sent(conv: dict, contact: str, text: str | None = None, like: str | None = None, total: int = 1) -> list[dict]:
    value = {"channel": conv["msg"]["channel"], "to": contact}
    if text is not None:
        value["text"] = text
    return [has(["msg", "sent"], value, like={"text": like} if like else None), count(["msg", "sent"], total)]


# ----------------------------------------------------------------------------- travel


def flight_booked(flight: str, total: int = 1) -> list[dict]:
    return [
        has(["travel", "bookings"], {"kind": "flight", "item": flight, "status": "ticketed"}),
        count(["travel", "bookings"], total),
    ]


def hotel_booked(hotel: str, nights: int) -> dict:
    return has(["travel", "bookings"], {"kind": "hotel", "item": hotel, "nights": nights, "status": "booked"})
