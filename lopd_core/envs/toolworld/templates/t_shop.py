"""Shop templates. Product ids, prices and stock are only visible through the shop tools."""

from __future__ import annotations

from . import Draft, template
from .common import call, res
from .expect import answer, count, eq, shop_orders
from .fixtures import CATALOG, shop_state
from .recipes import shop_order, shop_product, shop_search


def _cats(rng, k=2):
    return rng.sample(sorted(CATALOG), k)


def _o_buy(p, conv):
    row = yield from shop_product(p["name"])
    yield from shop_order(conv, row["id"], p["qty"])


@template("shop_buy", ("shop",), _o_buy)
def _buy(rng, conv):
    state, h = shop_state(rng, _cats(rng), stock=(3, 9))
    name = rng.choice(sorted(h))
    qty = rng.randint(1, 3)
    text = f"Order {qty} of the {name}." if qty > 1 else f"Buy one {name}."
    return Draft(text, {"shop": state}, shop_orders(conv, state, [[(h[name], qty)]]), {"name": name, "qty": qty})


def _o_cheapest(p, conv):
    rows = yield from shop_search(p["category"])
    best = min(rows, key=lambda r: r["price"])
    yield from shop_order(conv, best["id"], 1)


@template("shop_buy_cheapest", ("shop",), _o_cheapest)
def _cheapest(rng, conv):
    cats = _cats(rng)
    state, h = shop_state(rng, cats, price=(3, 80))
    cat = cats[0]
    rows = [(state["products"][h[n]]["price"], h[n]) for n in CATALOG[cat]]
    if len({p for p, _ in rows}) != len(rows):  # make the cheapest unique
        for i, (_, pid) in enumerate(sorted(rows)):
            state["products"][pid]["price"] = 5 + 7 * i + rng.randint(0, 5)
        rows = [(state["products"][pid]["price"], pid) for _, pid in rows]
    best = min(rows)[1]
    text = f"Buy the cheapest {cat}."
    return Draft(text, {"shop": state}, shop_orders(conv, state, [[(best, 1)]]), {"category": cat})


def _o_swap(p, conv):
    rows = res((yield call("shop_list_orders")))
    old = next(r for r in rows if r["product"] == p["old"] and r["status"] != "cancelled")
    yield call("shop_cancel_order", order=old["id"])
    row = yield from shop_product(p["new"])
    yield from shop_order(conv, row["id"], 1)


@template("shop_swap", ("shop",), _o_swap)
def _swap(rng, conv):
    cat = _cats(rng, 1)[0]
    state, h = shop_state(rng, [cat], stock=(2, 6))
    old, new = rng.sample(CATALOG[cat], 2)
    state["orders"] = {
        "o1": {
            "items": [{"product": h[old], "qty": 1}],
            "status": "confirmed",
            "channel": conv["shop"]["order_flow"],
        }
    }
    text = f"Cancel my order of the {old} and buy one {new} instead."
    checks = [
        eq(["shop", "orders", "o1", "status"], "cancelled"),
        eq(["shop", "products", h[old], "stock"], state["products"][h[old]]["stock"] + 1),
    ]
    checks += shop_orders(conv, state, [[(h[new], 1)]])
    return Draft(text, {"shop": state}, checks, {"old": old, "new": new})


def _o_total(p, conv):
    row = yield from shop_product(p["name"])
    return str(row["price"] * p["qty"])


@template("shop_total_answer", ("shop",), _o_total)
def _total(rng, conv):
    state, h = shop_state(rng, _cats(rng))
    name = rng.choice(sorted(h))
    qty = rng.randint(2, 5)
    total = state["products"][h[name]]["price"] * qty
    text = f"How much would {qty} of the {name} cost in total?"
    return Draft(
        text,
        {"shop": state},
        [answer(total), count(["shop", "orders"], 0)],
        {"name": name, "qty": qty},
        answer=str(total),
    )


def _o_all_stock(p, conv):
    row = yield from shop_product(p["name"])
    stock = res((yield call("shop_get_product", product=row["id"])))["stock"]
    yield from shop_order(conv, row["id"], stock)


@template("shop_buy_all_stock", ("shop",), _o_all_stock)
def _all_stock(rng, conv):
    state, h = shop_state(rng, _cats(rng), stock=(2, 8))
    name = rng.choice(sorted(h))
    stock = state["products"][h[name]]["stock"]
    text = f"Buy every {name} you have left in stock."
    return Draft(text, {"shop": state}, shop_orders(conv, state, [[(h[name], stock)]]), {"name": name})


def _o_budget(p, conv):
    row = yield from shop_product(p["name"])
    yield from shop_order(conv, row["id"], p["budget"] // row["price"])


@template("shop_budget", ("shop",), _o_budget)
def _budget(rng, conv):
    state, h = shop_state(rng, _cats(rng), stock=(9, 12), price=(4, 25))
    name = rng.choice(sorted(h))
    price = state["products"][h[name]]["price"]
    qty = rng.randint(2, 4)
    budget = price * qty + rng.randint(0, price - 1)
    text = f"Buy as many of the {name} as {budget} can pay for."
    return Draft(text, {"shop": state}, shop_orders(conv, state, [[(h[name], qty)]]), {"name": name, "budget": budget})
