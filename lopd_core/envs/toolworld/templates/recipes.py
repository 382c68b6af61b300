"""Oracle building blocks: how to do one thing in a domain under given conventions.

Each recipe is a generator used with ``yield from``: it yields ``(tool, arguments)`` calls,
receives the parsed observation for each, and returns what it learned (an id, a balance...).
Recipes read hidden values only from observations, never from the task state.
"""

from __future__ import annotations

from ..formats import fmt_date, place_arg
from .common import Stuck, call, res

# ----------------------------------------------------------------------------- bank


def bank_my_account(label: str):
    for row in res((yield call("bank_list_accounts"))):
        if row["label"] == label:
            return row["id"]
    raise Stuck(label)


def bank_accounts():
    """label -> id of your own accounts."""
    return {row["label"]: row["id"] for row in res((yield call("bank_list_accounts")))}


def bank_payee(name: str):
    return res((yield call("bank_find_account", owner=name)))["id"]


def bank_balance(account: str):
    return res((yield call("bank_get_balance", account=account)))["balance"]


def bank_pay(conv: dict, src: str, dst: str, amount, own_dst: bool = False):
    c = conv["bank"]
    if c["verify_payee"] and not own_dst:
        yield call("bank_verify_payee", account=dst)
    value = round(amount * 100) if c["amount_unit"] == "cents" else amount
    name = "bank_transfer" if c["pay_tool"] == "transfer" else "bank_wire"
    return (yield call(name, src=src, dst=dst, amount=value))


# ----------------------------------------------------------------------------- calendar


def cal_list(conv: dict, iso: str):
    return res((yield call("calendar_list_events", date=fmt_date(iso, conv["calendar"]["date_format"]))))


def cal_find(conv: dict, iso: str, title: str):
    """(id, start) of the event with this title on the date."""
    for row in (yield from cal_list(conv, iso)):
        if row["title"] == title:
            return row["id"], row["start"]
    raise Stuck(title)


def cal_free(conv: dict, iso: str):
    return res((yield call("calendar_free_slots", date=fmt_date(iso, conv["calendar"]["date_format"]))))


def cal_create(conv: dict, title: str, iso: str, start: int):
    c = conv["calendar"]
    event = res((yield call("calendar_create_event", title=title, date=fmt_date(iso, c["date_format"]), start=start)))[
        "id"
    ]
    if c["confirm_events"]:
        yield call("calendar_confirm_event", event=event)
    return event


def cal_move(conv: dict, event: str, iso: str, start: int):
    fmt = fmt_date(iso, conv["calendar"]["date_format"])
    return (yield call("calendar_move_event", event=event, date=fmt, start=start))


# ----------------------------------------------------------------------------- shop


def shop_search(query: str):
    return res((yield call("shop_search", query=query)))


def shop_product(name: str):
    """Row (id, name, price) of the product with exactly this name."""
    for row in (yield from shop_search(name)):
        if row["name"] == name:
            return row
    raise Stuck(name)


def shop_order(conv: dict, product: str, qty: int):
    c = conv["shop"]
    if c["order_flow"] == "direct":
        order = res((yield call("shop_place_order", product=product, qty=qty)))["order"]
    else:
        yield call("shop_add_to_cart", product=product, qty=qty)
        order = res((yield call("shop_checkout")))["order"]
    if c["confirm_orders"]:
        yield call("shop_confirm_order", order=order)
    return order


# ----------------------------------------------------------------------------- files


def folder_arg(conv: dict, folder: str) -> str:
    return folder if conv["files"]["folder_style"] == "plain" else "/" + folder


def files_list(conv: dict, folder: str):
    return res((yield call("files_list", folder=folder_arg(conv, folder))))


def files_find(conv: dict, folder: str, name: str):
    for row in (yield from files_list(conv, folder)):
        if row["name"] == name:
            return row["id"]
    raise Stuck(name)


def files_read(file: str):
    return res((yield call("files_read", file=file)))["content"]


def files_write(conv: dict, file: str, content: str):
    lock = conv["files"]["lock_writes"]
    if lock:
        yield call("files_lock", file=file)
    out = yield call("files_write", file=file, content=content)
    if lock:
        yield call("files_unlock", file=file)
    return out


def files_remove(conv: dict, file: str):
    name = "files_delete" if conv["files"]["remove_tool"] == "delete" else "files_trash"
    return (yield call(name, file=file))


# ----------------------------------------------------------------------------- msg


def msg_contact(name: str):
    return res((yield call("msg_find_contact", name=name)))["id"]


def msg_inbox():
    return res((yield call("msg_inbox")))


def msg_send(conv: dict, contact: str, text: str, address: dict | None = None):
    """Send ``text`` to a contact id; looks the address up when the world needs one."""
    c = conv["msg"]
    field = "phone" if c["channel"] == "sms" else "email"
    if c["recipient"] == "id":
        to = contact
    elif address is not None:
        to = address[field]
    else:
        to = res((yield call("msg_get_contact", contact=contact)))[field]
    return (yield call("msg_send_" + c["channel"], to=to, text=text))


def msg_send_to(conv: dict, name: str, text: str):
    contact = yield from msg_contact(name)
    return (yield from msg_send(conv, contact, text))


# ----------------------------------------------------------------------------- travel


def place(conv: dict, code: str) -> str:
    return place_arg(code, conv["travel"]["place_style"])


def travel_flights(conv: dict, origin: str, dest: str, iso: str):
    return res((yield call("travel_search_flights", origin=place(conv, origin), dest=place(conv, dest), date=iso)))


def travel_book(conv: dict, flight: str):
    if conv["travel"]["booking_flow"] == "book":
        return res((yield call("travel_book_flight", flight=flight)))["booking"]
    booking = res((yield call("travel_hold_flight", flight=flight)))["booking"]
    yield call("travel_pay_booking", booking=booking)
    return booking


def travel_hotels(conv: dict, city: str):
    return res((yield call("travel_search_hotels", city=place(conv, city))))
