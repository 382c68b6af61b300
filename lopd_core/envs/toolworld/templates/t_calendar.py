"""Calendar templates. Dates are said naturally ("March 5"); the world decides the argument format."""

from __future__ import annotations

from . import Draft, template
from .common import call, people, rand_date, say_date, shift_date
from .expect import answer, cal_count, cal_event, eq
from .fixtures import EVENT_TITLES, calendar_state
from .recipes import cal_create, cal_find, cal_free, cal_list, cal_move


def _o_add(p, conv):
    yield from cal_create(conv, p["title"], p["date"], p["start"])


@template("calendar_add_event", ("calendar",), _o_add)
def _add(rng, conv):
    iso = rand_date(rng)
    state, h = calendar_state(rng, [iso])
    busy = {e["start"] for e in state["events"].values()}
    start = rng.choice([x for x in range(9, 17) if x not in busy])
    title = rng.choice([t for t in EVENT_TITLES if t not in h])
    text = f"Add '{title}' to my calendar on {say_date(iso)} at {start}:00."
    checks = [cal_event(title, iso, start), cal_count(state, +1)]
    return Draft(text, {"calendar": state}, checks, {"title": title, "date": iso, "start": start})


def _o_first_free(p, conv):
    slots = yield from cal_free(conv, p["date"])
    yield from cal_create(conv, p["title"], p["date"], slots[0])


@template("calendar_first_free", ("calendar",), _o_first_free)
def _first_free(rng, conv):
    iso = rand_date(rng)
    state, h = calendar_state(rng, [iso], per_day=(1, 3))
    for k, e in enumerate(sorted(state["events"].values(), key=lambda e: e["start"])):
        e["start"] = 9 + k  # mornings are full from 9, so the first free hour is only seen via slots
    if rng.random() < 0.5:
        e["start"] += 1
    busy = {e["start"] for e in state["events"].values()}
    start = min(x for x in range(9, 17) if x not in busy)
    title = rng.choice([t for t in EVENT_TITLES if t not in h])
    text = f"Put '{title}' in my first free hour on {say_date(iso)}."
    checks = [cal_event(title, iso, start), cal_count(state, +1)]
    return Draft(text, {"calendar": state}, checks, {"title": title, "date": iso})


def _o_cancel(p, conv):
    event, _ = yield from cal_find(conv, p["date"], p["title"])
    yield call("calendar_cancel_event", event=event)


@template("calendar_cancel", ("calendar",), _o_cancel)
def _cancel(rng, conv):
    iso = rand_date(rng)
    state, h = calendar_state(rng, [iso, shift_date(iso, 1)], per_day=(2, 3))
    title = next(t for t, e in h.items() if state["events"][e]["date"] == iso)
    text = f"Cancel '{title}' on {say_date(iso)}."
    checks = [{"op": "absent", "path": ["calendar", "events", h[title]]}, cal_count(state, -1)]
    return Draft(text, {"calendar": state}, checks, {"title": title, "date": iso})


def _o_move(p, conv):
    event, start = yield from cal_find(conv, p["date"], p["title"])
    yield from cal_move(conv, event, p["to"], start)


@template("calendar_move", ("calendar",), _o_move)
def _move(rng, conv):
    iso = rand_date(rng)
    to = shift_date(iso, rng.randint(1, 5))
    state, h = calendar_state(rng, [iso], per_day=(1, 3))
    title = rng.choice(sorted(h))
    ev = state["events"][h[title]]
    text = f"Move '{title}' from {say_date(iso)} to {say_date(to)}, same time."
    checks = [
        eq(["calendar", "events", h[title], "date"], to),
        eq(["calendar", "events", h[title], "start"], ev["start"]),
        cal_count(state, 0),
    ]
    return Draft(text, {"calendar": state}, checks, {"title": title, "date": iso, "to": to})


def _o_count(p, conv):
    return str(len((yield from cal_list(conv, p["date"]))))


@template("calendar_count_answer", ("calendar",), _o_count)
def _count(rng, conv):
    iso = rand_date(rng)
    state, _ = calendar_state(rng, [iso, shift_date(iso, -1)], per_day=(1, 4))
    n = sum(1 for e in state["events"].values() if e["date"] == iso)
    text = f"How many events do I have on {say_date(iso)}?"
    return Draft(text, {"calendar": state}, [answer(n), cal_count(state, 0)], {"date": iso}, answer=str(n))


def _o_when(p, conv):
    _, start = yield from cal_find(conv, p["date"], p["title"])
    return f"{start}:00"


@template("calendar_when_answer", ("calendar",), _o_when)
def _when(rng, conv):
    iso = rand_date(rng)
    state, h = calendar_state(rng, [iso], per_day=(2, 4))
    title = rng.choice(sorted(h))
    start = state["events"][h[title]]["start"]
    text = f"What time does '{title}' start on {say_date(iso)}?"
    return Draft(
        text,
        {"calendar": state},
        [answer(start), cal_count(state, 0)],
        {"title": title, "date": iso},
        answer=f"{start}:00",
    )


def _o_invite(p, conv):
    event, _ = yield from cal_find(conv, p["date"], p["title"])
    yield call("calendar_invite", event=event, name=p["name"])


@template("calendar_invite", ("calendar",), _o_invite)
def _invite(rng, conv):
    iso = rand_date(rng)
    state, h = calendar_state(rng, [iso], per_day=(1, 3))
    title = rng.choice(sorted(h))
    name = people(rng, 1)[0]
    text = f"Invite {name} to '{title}' on {say_date(iso)}."
    checks = [
        {"op": "contains", "path": ["calendar", "events", h[title], "attendees"], "value": name},
        eq(["calendar", "events", h[title], "date"], iso),
    ]
    return Draft(text, {"calendar": state}, checks, {"title": title, "date": iso, "name": name})
