"""Out-of-distribution templates: new compositions of skills the train templates teach
(paying several payees, paying a message sender, bulk moves/removals, a whole trip, ...).
"""

from __future__ import annotations

from . import Draft, template
from .common import call, people, rand_date, say_date, shift_date
from .expect import (
    bank_payments,
    cal_count,
    cal_event,
    count,
    eq,
    file_removed,
    files_count,
    flight_booked,
    hotel_booked,
    msg_sent,
)
from .fixtures import (
    CATALOG,
    FOLDERS,
    bank_state,
    calendar_state,
    files_state,
    msg_state,
    shop_state,
    travel_state,
)
from .recipes import (
    bank_pay,
    bank_payee,
    cal_create,
    cal_list,
    cal_move,
    files_list,
    files_remove,
    files_write,
    msg_inbox,
    msg_send_to,
    shop_search,
    travel_book,
    travel_flights,
    travel_hotels,
)
from .t_travel import _city, _route, _route_flights


def _o_split(p, conv):
    for name in p["names"]:
        dst = yield from bank_payee(name)
        yield from bank_pay(conv, p["src"], dst, p["amount"])


@template("ood_bank_pay_two", ("bank",), _o_split, split_group="ood")
def _split(rng, conv):
    names = people(rng, 3)
    state, h = bank_state(rng, names, labels=("checking",), lo=400)
    src, amount = h["mine"]["checking"], rng.randrange(10, 150, 5)
    instr = f"Pay {names[0]} and {names[1]} {amount} each from my account {src}."
    pays = [(src, h["theirs"][n], amount) for n in names[:2]]
    return Draft(
        instr,
        {"bank": state},
        bank_payments(conv, state, pays),
        {"names": names[:2], "src": src, "amount": amount},
    )


def _o_pay_sender(p, conv):
    who = (yield from msg_inbox())[0]["from"]
    dst = yield from bank_payee(who)
    yield from bank_pay(conv, p["src"], dst, p["amount"])


@template("ood_pay_last_sender", ("msg", "bank"), _o_pay_sender, split_group="ood")
def _pay_sender(rng, conv):
    names = people(rng, 3)
    msg, _ = msg_state(rng, names, inbox_from=[rng.choice(names) for _ in range(2)])
    bank, h = bank_state(rng, names, labels=("checking",), lo=300)
    src, amount = h["mine"]["checking"], rng.randrange(10, 200, 5)
    who = msg["inbox"][-1]["from"]
    instr = f"Send {amount} from my account {src} to whoever messaged me last."
    checks = bank_payments(conv, bank, [(src, h["theirs"][who], amount)]) + [count(["msg", "sent"], 0)]
    return Draft(instr, {"msg": msg, "bank": bank}, checks, {"src": src, "amount": amount})


def _o_move_all(p, conv):
    for row in (yield from cal_list(conv, p["date"])):
        yield from cal_move(conv, row["id"], p["to"], row["start"])


@template("ood_calendar_move_day", ("calendar",), _o_move_all, split_group="ood")
def _move_all(rng, conv):
    iso = rand_date(rng)
    to = shift_date(iso, rng.randint(1, 6))
    state, h = calendar_state(rng, [iso], per_day=(2, 3))
    instr = f"Move all my events on {say_date(iso)} to {say_date(to)}, keeping their times."
    checks = [eq(["calendar", "events", e, "date"], to) for e in sorted(h.values())] + [cal_count(state, 0)]
    return Draft(instr, {"calendar": state}, checks, {"date": iso, "to": to})


def _o_clean(p, conv):
    for row in (yield from files_list(conv, p["folder"])):
        yield from files_remove(conv, row["id"])


@template("ood_files_empty_folder", ("files",), _o_clean, split_group="ood")
def _clean(rng, conv):
    folders = rng.sample(FOLDERS, 2)
    state, h = files_state(rng, folders, per_folder=(2, 3))
    gone = sorted(f for f in h.values() if state["files"][f]["folder"] == folders[0])
    keep = len(state["files"]) - len(gone)
    instr = f"Remove every file in my {folders[0]} folder."
    checks = [file_removed(conv, f) for f in gone]
    checks.append(count(["files", "files"], keep) if conv["files"]["remove_tool"] == "delete" else files_count(state))
    return Draft(instr, {"files": state}, checks, {"folder": folders[0]})


def _o_trip(p, conv):
    rows = yield from travel_flights(conv, p["origin"], p["dest"], p["date"])
    yield from travel_book(conv, min(rows, key=lambda r: r["price"])["id"])
    hotels = yield from travel_hotels(conv, p["dest"])
    yield call("travel_book_hotel", hotel=min(hotels, key=lambda r: r["price"])["id"], nights=p["nights"])


@template("ood_travel_trip", ("travel",), _o_trip, split_group="ood")
def _trip(rng, conv):
    origin, dest, iso = _route(rng)
    state = travel_state(rng, origin, dest, iso, hotel_city=dest)
    route = _route_flights(state, origin, dest, iso)
    flight = min(route, key=lambda k: route[k]["price"])
    hotel = min(state["hotels"], key=lambda k: state["hotels"][k]["price"])
    nights = rng.randint(2, 5)
    instr = (
        f"Book the cheapest flight from {_city(origin)} to {_city(dest)} on {say_date(iso)} "
        f"and the cheapest hotel there for {nights} nights."
    )
    checks = flight_booked(flight, total=2) + [hotel_booked(hotel, nights)]
    return Draft(instr, {"travel": state}, checks, {"origin": origin, "dest": dest, "date": iso, "nights": nights})


def _o_tell_price(p, conv):
    rows = yield from shop_search(p["category"])
    best = min(rows, key=lambda r: r["price"])
    yield from msg_send_to(conv, p["name"], f"the cheapest {p['category']} costs {best['price']}")


@template("ood_tell_cheapest_price", ("shop", "msg"), _o_tell_price, split_group="ood")
def _tell_price(rng, conv):
    cat = rng.choice(sorted(CATALOG))
    shop, sh = shop_state(rng, [cat])
    prices = rng.sample(range(3, 80), len(sh))
    for pid, price in zip(sorted(sh.values()), prices):
        shop["products"][pid]["price"] = price
    names = people(rng, 3)
    msg, m = msg_state(rng, names)
    instr = f"Tell {names[0]} the price of the cheapest {cat}."
    checks = msg_sent(conv, m[names[0]], like=str(min(prices))) + [count(["shop", "orders"], 0)]
    return Draft(instr, {"shop": shop, "msg": msg}, checks, {"category": cat, "name": names[0]})


def _o_agenda(p, conv):
    titles = [r["title"] for r in (yield from cal_list(conv, p["date"]))]
    rows = yield from files_list(conv, p["folder"])
    yield from files_write(conv, next(r["id"] for r in rows if r["name"] == p["file"]), ", ".join(titles))


@template("ood_agenda_to_file", ("calendar", "files"), _o_agenda, split_group="ood")
def _agenda(rng, conv):
    iso = rand_date(rng)
    cal, ch = calendar_state(rng, [iso], per_day=(2, 3))
    folder = rng.choice(FOLDERS)
    files, fh = files_state(rng, [folder], per_folder=(1, 2))
    file = rng.choice(sorted(fh))
    instr = f"Write the titles of my events on {say_date(iso)} into {file} in my {folder} folder."
    checks = [{"op": "contains", "path": ["files", "files", fh[file], "content"], "value": t} for t in sorted(ch)]
    checks.append(eq(["files", "files", fh[file], "locked"], False))
    return Draft(instr, {"calendar": cal, "files": files}, checks, {"date": iso, "folder": folder, "file": file})


def _o_pay_and_note(p, conv):
    dst = yield from bank_payee(p["name"])
    yield from bank_pay(conv, p["src"], dst, p["amount"])
    yield from cal_create(conv, p["title"], p["date"], p["start"])


@template("ood_pay_and_schedule", ("bank", "calendar"), _o_pay_and_note, split_group="ood")
def _pay_and_note(rng, conv):
    names = people(rng, 2)
    bank, h = bank_state(rng, names, labels=("checking",), lo=300)
    iso = rand_date(rng)
    cal, _ = calendar_state(rng, [iso], per_day=(1, 2))
    busy = {e["start"] for e in cal["events"].values()}
    start = rng.choice([x for x in range(9, 17) if x not in busy])
    src, amount, title = h["mine"]["checking"], rng.randrange(10, 200, 5), f"paid {names[0].lower()}"
    instr = (
        f"Pay {names[0]} {amount} from my account {src}, then add '{title}' to my calendar "
        f"on {say_date(iso)} at {start}:00."
    )
    checks = bank_payments(conv, bank, [(src, h["theirs"][names[0]], amount)]) + [
        cal_event(title, iso, start),
        cal_count(cal, +1),
    ]
    params = {"name": names[0], "src": src, "amount": amount, "title": title, "date": iso, "start": start}
    return Draft(instr, {"bank": bank, "calendar": cal}, checks, params)
