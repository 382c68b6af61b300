"""Messages templates. Contact ids and addresses are only visible through the msg tools."""

from __future__ import annotations

from . import Draft, template
from .common import call, people, res
from .expect import answer, count, msg_sent
from .fixtures import MESSAGES, msg_state, phone
from .recipes import msg_contact, msg_inbox, msg_send, msg_send_to


def _o_send(p, conv):
    yield from msg_send_to(conv, p["name"], p["text"])


@template("msg_send", ("msg",), _o_send)
def _send(rng, conv):
    names = people(rng, 4)
    state, h = msg_state(rng, names, inbox_from=names[1:3])
    text = rng.choice(MESSAGES)
    instr = rng.choice(["Send {} the message '{}'.", "Tell {} '{}'."]).format(names[0], text)
    return Draft(instr, {"msg": state}, msg_sent(conv, h[names[0]], text), {"name": names[0], "text": text})


def _o_reply(p, conv):
    last = (yield from msg_inbox())[0]
    yield from msg_send_to(conv, last["from"], p["text"])


@template("msg_reply_last", ("msg",), _o_reply)
def _reply(rng, conv):
    names = people(rng, 4)
    senders = [rng.choice(names) for _ in range(rng.randint(2, 4))]
    state, h = msg_state(rng, names, inbox_from=senders)
    text = rng.choice(MESSAGES)
    instr = f"Reply '{text}' to whoever messaged me last."
    return Draft(instr, {"msg": state}, msg_sent(conv, h[senders[-1]], text), {"text": text})


def _o_phone(p, conv):
    contact = yield from msg_contact(p["name"])
    return res((yield call("msg_get_contact", contact=contact)))["phone"]


@template("msg_phone_answer", ("msg",), _o_phone)
def _phone(rng, conv):
    names = people(rng, 4)
    state, h = msg_state(rng, names, inbox_from=names[:1])
    number = state["contacts"][h[names[0]]]["phone"]
    instr = f"What is {names[0]}'s phone number?"
    return Draft(instr, {"msg": state}, [answer(number), count(["msg", "sent"], 0)], {"name": names[0]}, answer=number)


def _o_add_send(p, conv):
    contact = res((yield call("msg_add_contact", name=p["name"], phone=p["phone"], email=p["email"])))["id"]
    yield from msg_send(conv, contact, p["text"], address={"phone": p["phone"], "email": p["email"]})


@template("msg_add_and_send", ("msg",), _o_add_send)
def _add_send(rng, conv):
    names = people(rng, 4)
    state, _ = msg_state(rng, names[:3], inbox_from=names[:1])
    new, number, text = names[3], phone(rng), rng.choice(MESSAGES)
    email = f"{new.lower()}@mail.com"
    instr = f"Save {new} ({number}, {email}) as a contact and send them '{text}'."
    cid = next(f"c{n}" for n in range(1, 200) if f"c{n}" not in state["contacts"])  # the id msg_add_contact assigns
    checks = msg_sent(conv, cid, text) + [count(["msg", "contacts"], 4)]
    return Draft(instr, {"msg": state}, checks, {"name": new, "phone": number, "email": email, "text": text})


def _o_forward(p, conv):
    rows = yield from msg_inbox()
    text = next(r["text"] for r in rows if r["from"] == p["src"])
    yield from msg_send_to(conv, p["dst"], text)


@template("msg_forward", ("msg",), _o_forward)
def _forward(rng, conv):
    names = people(rng, 4)
    src, dst = names[0], names[1]
    senders = [src] + [rng.choice([src] + names[2:]) for _ in range(rng.randint(0, 2))]
    state, h = msg_state(rng, names, inbox_from=senders)
    text = next(m["text"] for m in reversed(state["inbox"]) if m["from"] == src)
    instr = f"Forward {src}'s latest message to {dst}."
    return Draft(instr, {"msg": state}, msg_sent(conv, h[dst], text), {"src": src, "dst": dst})
