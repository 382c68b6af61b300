"""Random initial states per domain, with handles (ids by name) for the template to use.

Each builder returns ``(state, handles)``: ``state`` is the JSON domain state, ``handles``
maps the human-facing names a template talks about to the ids hidden in the state.
"""

from __future__ import annotations

import random

from .common import ids


def bank_state(rng: random.Random, payees: list[str], labels=("checking", "savings"), lo=100, hi=900):
    acct_ids = ids(rng, "a", len(labels) + len(payees))
    accounts, mine, theirs = {}, {}, {}
    order = list(range(len(acct_ids)))
    rng.shuffle(order)  # ids do not reveal which account is whose
    for slot, i in enumerate(order):
        acct = acct_ids[i]
        if slot < len(labels):
            accounts[acct] = {"owner": "me", "label": labels[slot], "balance": rng.randrange(lo, hi, 5)}
            mine[labels[slot]] = acct
        else:
            name = payees[slot - len(labels)]
            accounts[acct] = {"owner": name, "label": "main", "balance": rng.randrange(lo, hi, 5)}
            theirs[name] = acct
    accounts = dict(sorted(accounts.items(), key=lambda kv: int(kv[0][1:])))
    return {"accounts": accounts, "ledger": [], "verified": []}, {"mine": mine, "theirs": theirs}


# ----------------------------------------------------------------------------- calendar
EVENT_TITLES = (
    "standup",
    "dentist",
    "lunch",
    "review",
    "gym",
    "dinner",
    "call",
    "yoga",
    "demo",
    "haircut",
    "meeting",
    "coffee",
    "class",
    "interview",
)


def calendar_state(rng: random.Random, dates: list[str], per_day=(1, 3), titles=None):
    """Events on the given ISO dates (unique titles across the state, distinct hours per day)."""
    n = sum(per_day[1] for _ in dates)
    pool = list(titles) if titles is not None else rng.sample(EVENT_TITLES, min(n, len(EVENT_TITLES)))
    events, handles = {}, {}
    ev_ids = ids(rng, "e", len(pool))
    k = 0
    for iso in dates:
        count = rng.randint(*per_day)
        for start in sorted(rng.sample(range(9, 17), count)):
            if k >= len(pool):
                break
            events[ev_ids[k]] = {
                "title": pool[k],
                "date": iso,
                "start": start,
                "status": "confirmed",
                "attendees": [],
            }
            handles[pool[k]] = ev_ids[k]
            k += 1
    events = dict(sorted(events.items(), key=lambda kv: int(kv[0][1:])))
    return {"events": events}, handles


# ----------------------------------------------------------------------------- shop
CATALOG = {
    "mug": ("red mug", "blue mug", "tall mug", "glass mug"),
    "lamp": ("desk lamp", "floor lamp", "night lamp", "clip lamp"),
    "kettle": ("steel kettle", "glass kettle", "mini kettle"),
    "chair": ("desk chair", "bar chair", "camp chair"),
    "pen": ("gel pen", "ink pen", "brush pen"),
    "towel": ("bath towel", "hand towel", "beach towel"),
}


def shop_state(rng: random.Random, categories: list[str], stock=(1, 9), price=(3, 60)):
    names = [n for c in categories for n in CATALOG[c]]
    rng.shuffle(names)
    products, handles = {}, {}
    for pid, name in zip(ids(rng, "p", len(names)), names):
        products[pid] = {"name": name, "price": rng.randint(*price), "stock": rng.randint(*stock)}
        handles[name] = pid
    products = dict(sorted(products.items(), key=lambda kv: int(kv[0][1:])))
    return {"products": products, "orders": {}, "cart": []}, handles


# ----------------------------------------------------------------------------- files
FOLDERS = ("notes", "work", "docs", "inbox", "archive", "tmp", "logs", "music")
FILE_NAMES = (
    "todo.txt",
    "plan.txt",
    "pin.txt",
    "ideas.txt",
    "report.txt",
    "old.log",
    "list.txt",
    "draft.txt",
    "memo.txt",
    "budget.txt",
    "recipe.txt",
    "notes.txt",
)
WORDS = (
    "buy milk",
    "call mom",
    "fix bike",
    "pay rent",
    "book gym",
    "send cv",
    "water plants",
    "feed cat",
    "code 4821",
    "meet at 5",
    "bring cake",
    "read book",
)


def files_state(rng: random.Random, folders: list[str], per_folder=(1, 3), locked=False):
    """Files spread over folders; file names unique within the state."""
    names = rng.sample(FILE_NAMES, len(folders) * per_folder[1])
    files, handles = {}, {}
    file_ids = ids(rng, "f", len(names))
    k = 0
    for folder in folders:
        for _ in range(rng.randint(*per_folder)):
            files[file_ids[k]] = {
                "name": names[k],
                "folder": folder,
                "content": rng.choice(WORDS),
                "locked": locked,
            }
            handles[names[k]] = file_ids[k]
            k += 1
    files = dict(sorted(files.items(), key=lambda kv: int(kv[0][1:])))
    return {"files": files}, handles


# ----------------------------------------------------------------------------- msg
MESSAGES = (
    "see you soon",
    "on my way",
    "call me",
    "thanks a lot",
    "running late",
    "all good",
    "lunch at 1",
    "happy birthday",
    "meeting moved",
    "got it",
)


def phone(rng: random.Random) -> str:
    return f"555-{rng.randint(100, 9999):04d}"


def msg_state(rng: random.Random, names: list[str], inbox_from=()):
    contacts, handles = {}, {}
    for cid, name in zip(ids(rng, "c", len(names)), names):
        contacts[cid] = {"name": name, "phone": phone(rng), "email": f"{name.lower()}@mail.com"}
        handles[name] = cid
    contacts = dict(sorted(contacts.items(), key=lambda kv: int(kv[0][1:])))
    inbox = [{"from": who, "text": rng.choice(MESSAGES)} for who in inbox_from]
    return {"contacts": contacts, "inbox": inbox, "sent": []}, handles


# ----------------------------------------------------------------------------- travel
HOTEL_NAMES = ("Sole", "Astra", "Nord", "Vista", "Luna", "Park", "Plaza", "Harbor")


def travel_state(rng: random.Random, origin: str, dest: str, iso: str, n_flights=(2, 4), hotel_city=None):
    """Flights origin->dest on a date (distinct hours and prices) plus decoys on other routes/dates."""
    flights = {}
    fids = ids(rng, "fl", 8)
    n = rng.randint(*n_flights)
    deps = sorted(rng.sample(range(6, 22), n))
    prices = rng.sample(range(60, 400, 5), n)
    for i in range(n):
        flights[fids[i]] = {
            "origin": origin,
            "dest": dest,
            "date": iso,
            "dep": deps[i],
            "price": prices[i],
            "seats": rng.randint(1, 5),
        }
    flights[fids[n]] = {
        "origin": dest,
        "dest": origin,
        "date": iso,
        "dep": rng.randint(6, 21),
        "price": rng.randrange(60, 400, 5),
        "seats": 3,
    }
    flights = dict(sorted(flights.items(), key=lambda kv: int(kv[0][2:])))
    hotels = {}
    if hotel_city:
        names = rng.sample(HOTEL_NAMES, 3)
        hprices = rng.sample(range(40, 200, 5), 3)
        for hid, name, price in zip(ids(rng, "h", 3), names, hprices):
            hotels[hid] = {"city": hotel_city, "name": name, "price": price}
        hotels = dict(sorted(hotels.items(), key=lambda kv: int(kv[0][1:])))
    return {"flights": flights, "hotels": hotels, "bookings": {}}
