"""Two-domain train templates: a value read in one domain is used in another."""

from __future__ import annotations

from . import Draft, template
from .common import people, rand_date, say_date, shift_date
from .expect import bank_payments, cal_count, cal_event, file_content, flight_booked, msg_sent
from .fixtures import FOLDERS, bank_state, calendar_state, files_state, msg_state, travel_state
from .recipes import (
    bank_accounts,
    bank_balance,
    bank_pay,
    bank_payee,
    cal_create,
    cal_find,
    files_find,
    files_list,
    files_read,
    files_write,
    msg_send_to,
    travel_book,
    travel_flights,
)
from .t_travel import _city, _route, _route_flights


def _o_bank_msg(p, conv):
    dst = yield from bank_payee(p["name"])
    yield from bank_pay(conv, p["src"], dst, p["amount"])
    yield from msg_send_to(conv, p["name"], p["text"])


@template("cross_pay_and_tell", ("bank", "msg"), _o_bank_msg)
def _bank_msg(rng, conv):
    names = people(rng, 3)
    bank, h = bank_state(rng, names, labels=("checking",), lo=300)
    msg, m = msg_state(rng, names, inbox_from=names[1:2])
    src = h["mine"]["checking"]
    amount = rng.randrange(10, 200, 5)
    text = f"sent you {amount}"
    instr = f"Pay {names[0]} {amount} from my account {src} and message them '{text}'."
    checks = bank_payments(conv, bank, [(src, h["theirs"][names[0]], amount)]) + msg_sent(conv, m[names[0]], text)
    return Draft(
        instr,
        {"bank": bank, "msg": msg},
        checks,
        {"name": names[0], "src": src, "amount": amount, "text": text},
    )


def _o_files_msg(p, conv):
    file = yield from files_find(conv, p["folder"], p["file"])
    body = yield from files_read(file)
    yield from msg_send_to(conv, p["name"], body)


@template("cross_send_file_text", ("files", "msg"), _o_files_msg)
def _files_msg(rng, conv):
    folder = rng.choice(FOLDERS)
    files, fh = files_state(rng, [folder], per_folder=(2, 3))
    names = people(rng, 3)
    msg, m = msg_state(rng, names)
    file = rng.choice(sorted(fh))
    body = files["files"][fh[file]]["content"]
    instr = f"Send {names[0]} the text of {file} in my {folder} folder."
    return Draft(
        instr,
        {"files": files, "msg": msg},
        msg_sent(conv, m[names[0]], body),
        {"folder": folder, "file": file, "name": names[0]},
    )


def _o_cal_msg(p, conv):
    _, start = yield from cal_find(conv, p["date"], p["title"])
    yield from msg_send_to(conv, p["name"], f"{p['title']} starts at {start}:00")


@template("cross_tell_event_time", ("calendar", "msg"), _o_cal_msg)
def _cal_msg(rng, conv):
    iso = rand_date(rng)
    cal, ch = calendar_state(rng, [iso], per_day=(2, 4))
    title = rng.choice(sorted(ch))
    start = cal["events"][ch[title]]["start"]
    names = people(rng, 3)
    msg, m = msg_state(rng, names)
    instr = f"Tell {names[0]} what time '{title}' starts on {say_date(iso)}."
    checks = msg_sent(conv, m[names[0]], like=f"{start}")
    return Draft(instr, {"calendar": cal, "msg": msg}, checks, {"date": iso, "title": title, "name": names[0]})


def _o_trip_cal(p, conv):
    rows = yield from travel_flights(conv, p["origin"], p["dest"], p["date"])
    first = min(rows, key=lambda r: r["dep"])
    yield from travel_book(conv, first["id"])
    yield from cal_create(conv, p["title"], p["date"], first["dep"])


@template("cross_flight_to_calendar", ("travel", "calendar"), _o_trip_cal)
def _trip_cal(rng, conv):

    origin, dest, iso = _route(rng)
    travel = travel_state(rng, origin, dest, iso)
    route = _route_flights(travel, origin, dest, iso)
    for k, dep in zip(sorted(route), sorted(rng.sample(range(9, 17), len(route)))):
        route[k]["dep"] = dep  # departures inside calendar hours
    first = min(route, key=lambda k: route[k]["dep"])
    cal, _ = calendar_state(rng, [shift_date(iso, rng.randint(1, 5))], per_day=(1, 2))
    title = "flight"
    instr = (
        f"Book the earliest flight from {_city(origin)} to {_city(dest)} on {say_date(iso)} "
        f"and add '{title}' to my calendar at its departure hour."
    )
    checks = flight_booked(first) + [cal_event(title, iso, route[first]["dep"]), cal_count(cal, +1)]
    return Draft(
        instr,
        {"travel": travel, "calendar": cal},
        checks,
        {"origin": origin, "dest": dest, "date": iso, "title": title},
    )


def _o_bank_files(p, conv):
    acct = (yield from bank_accounts())[p["label"]]
    bal = yield from bank_balance(acct)
    rows = yield from files_list(conv, p["folder"])
    yield from files_write(conv, next(r["id"] for r in rows if r["name"] == p["file"]), str(bal))


@template("cross_balance_to_file", ("bank", "files"), _o_bank_files)
def _bank_files(rng, conv):
    bank, h = bank_state(rng, people(rng, 1))
    label = rng.choice(["checking", "savings"])
    folder = rng.choice(FOLDERS)
    files, fh = files_state(rng, [folder], per_folder=(1, 3))
    file = rng.choice(sorted(fh))
    bal = bank["accounts"][h["mine"][label]]["balance"]
    instr = f"Write just the balance of my {label} account into {file} in my {folder} folder."
    return Draft(
        instr,
        {"bank": bank, "files": files},
        file_content(fh[file], str(bal)),
        {"label": label, "folder": folder, "file": file},
    )
