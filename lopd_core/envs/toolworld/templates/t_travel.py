"""Travel templates. Flight/hotel ids, prices and times are only visible through search."""

from __future__ import annotations

import random

from ..formats import CITIES
from . import Draft, template
from .common import call, rand_date, say_date
from .expect import answer, count, flight_booked, hotel_booked
from .fixtures import travel_state
from .recipes import travel_book, travel_flights, travel_hotels


def _route(rng: random.Random):
    origin, dest = rng.sample(sorted(CITIES), 2)
    return origin, dest, rand_date(rng)


def _city(code: str) -> str:
    return CITIES[code].capitalize()


def _route_flights(state, origin, dest, iso):
    return {k: f for k, f in state["flights"].items() if (f["origin"], f["dest"], f["date"]) == (origin, dest, iso)}


def _o_book(p, conv):
    rows = yield from travel_flights(conv, p["origin"], p["dest"], p["date"])
    best = min(rows, key=lambda r: r[p["by"]])
    yield from travel_book(conv, best["id"])


def _book_draw(by: str):
    def draw(rng, conv):
        origin, dest, iso = _route(rng)
        state = travel_state(rng, origin, dest, iso)
        route = _route_flights(state, origin, dest, iso)
        best = min(route, key=lambda k: route[k][by])
        word = "cheapest" if by == "price" else "earliest"
        text = f"Book the {word} flight from {_city(origin)} to {_city(dest)} on {say_date(iso)}."
        params = {"origin": origin, "dest": dest, "date": iso, "by": by}
        return Draft(text, {"travel": state}, flight_booked(best), params)

    return draw


template("travel_book_cheapest", ("travel",), _o_book)(_book_draw("price"))
template("travel_book_earliest", ("travel",), _o_book)(_book_draw("dep"))


def _o_hotel(p, conv):
    rows = yield from travel_hotels(conv, p["city"])
    best = min(rows, key=lambda r: r["price"])
    yield call("travel_book_hotel", hotel=best["id"], nights=p["nights"])


@template("travel_hotel", ("travel",), _o_hotel)
def _hotel(rng, conv):
    origin, dest, iso = _route(rng)
    state = travel_state(rng, origin, dest, iso, hotel_city=dest)
    best = min(state["hotels"], key=lambda k: state["hotels"][k]["price"])
    nights = rng.randint(1, 6)
    text = f"Book the cheapest hotel in {_city(dest)} for {nights} nights."
    checks = [hotel_booked(best, nights), count(["travel", "bookings"], 1)]
    return Draft(text, {"travel": state}, checks, {"city": dest, "nights": nights})


def _o_price(p, conv):
    rows = yield from travel_flights(conv, p["origin"], p["dest"], p["date"])
    return str(min(r["price"] for r in rows))


@template("travel_price_answer", ("travel",), _o_price)
def _price(rng, conv):
    origin, dest, iso = _route(rng)
    state = travel_state(rng, origin, dest, iso)
    price = min(f["price"] for f in _route_flights(state, origin, dest, iso).values())
    text = f"How much is the cheapest flight from {_city(origin)} to {_city(dest)} on {say_date(iso)}?"
    checks = [answer(price), count(["travel", "bookings"], 0)]
    return Draft(text, {"travel": state}, checks, {"origin": origin, "dest": dest, "date": iso}, answer=str(price))
