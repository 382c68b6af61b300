"""Bank templates."""

from __future__ import annotations

from . import Draft, template
from .common import call, people, res
from .expect import answer, bank_payments, bank_untouched
from .fixtures import bank_state
from .recipes import bank_accounts, bank_balance, bank_my_account, bank_pay, bank_payee


def _o_pay_payee(p, conv):
    src = yield from bank_my_account(p["label"])
    dst = yield from bank_payee(p["payee"])
    yield from bank_pay(conv, src, dst, p["amount"])


@template("bank_pay_payee", ("bank",), _o_pay_payee)
def _pay_payee(rng, conv):
    names = people(rng, 3)
    state, h = bank_state(rng, names)
    label = rng.choice(["checking", "savings"])
    src, dst = h["mine"][label], h["theirs"][names[0]]
    amount = rng.randrange(5, min(state["accounts"][src]["balance"], 300), 5)
    text = f"Send {amount} to {names[0]} from my {label} account."
    checks = bank_payments(conv, state, [(src, dst, amount)])
    return Draft(text, {"bank": state}, checks, {"label": label, "payee": names[0], "amount": amount})


def _o_balance(p, conv):
    acct = yield from bank_my_account(p["label"])
    return str((yield from bank_balance(acct)))


@template("bank_balance_answer", ("bank",), _o_balance)
def _balance(rng, conv):
    state, h = bank_state(rng, people(rng, 2))
    label = rng.choice(["checking", "savings"])
    bal = state["accounts"][h["mine"][label]]["balance"]
    text = rng.choice(["How much money is in my {} account?", "What is the balance of my {} account?"])
    checks = [answer(bal)] + bank_untouched(state)
    return Draft(text.format(label), {"bank": state}, checks, {"label": label}, answer=str(bal))


def _o_sweep(p, conv):
    rows = yield from bank_accounts()
    src, dst = rows[p["src"]], rows[p["dst"]]
    bal = yield from bank_balance(src)
    yield from bank_pay(conv, src, dst, bal, own_dst=True)


@template("bank_sweep", ("bank",), _o_sweep)
def _sweep(rng, conv):
    state, h = bank_state(rng, people(rng, 2))
    src_l, dst_l = rng.sample(["checking", "savings"], 2)
    src, dst = h["mine"][src_l], h["mine"][dst_l]
    bal = state["accounts"][src]["balance"]
    text = f"Move everything from my {src_l} account into my {dst_l} account."
    checks = bank_payments(conv, state, [(src, dst, bal)])
    return Draft(text, {"bank": state}, checks, {"src": src_l, "dst": dst_l})


def _o_pay_then_balance(p, conv):
    src = yield from bank_my_account(p["label"])
    dst = yield from bank_payee(p["payee"])
    yield from bank_pay(conv, src, dst, p["amount"])
    return f"Your {p['label']} balance is now {(yield from bank_balance(src))}."


@template("bank_pay_then_balance", ("bank",), _o_pay_then_balance)
def _pay_then_balance(rng, conv):
    names = people(rng, 2)
    state, h = bank_state(rng, names)
    label = rng.choice(["checking", "savings"])
    src, dst = h["mine"][label], h["theirs"][names[0]]
    amount = rng.randrange(5, min(state["accounts"][src]["balance"], 200), 5)
    left = state["accounts"][src]["balance"] - amount
    text = f"Pay {names[0]} {amount} from my {label} account, then tell me its new balance."
    checks = bank_payments(conv, state, [(src, dst, amount)]) + [answer(left)]
    return Draft(text, {"bank": state}, checks, {"label": label, "payee": names[0], "amount": amount}, answer=str(left))


def _o_refund(p, conv):
    theirs = yield from bank_payee(p["payee"])
    rows = res((yield call("bank_history", account=theirs)))
    last = next(r for r in rows if r["from"] == theirs)
    yield from bank_pay(conv, last["to"], theirs, last["amount"])


@template("bank_refund_last", ("bank",), _o_refund)
def _refund(rng, conv):
    names = people(rng, 3)
    state, h = bank_state(rng, names, lo=300)
    who, other = names[0], names[1]
    kind = conv["bank"]["pay_tool"]
    mine = list(h["mine"].values())
    old, last = rng.randrange(10, 150, 5), rng.randrange(10, 150, 5)
    state["ledger"] = [
        {"kind": kind, "src": h["theirs"][who], "dst": rng.choice(mine), "amount": old},
        {
            "kind": kind,
            "src": h["theirs"][other],
            "dst": rng.choice(mine),
            "amount": rng.randrange(10, 150, 5),
        },
        {"kind": kind, "src": h["theirs"][who], "dst": rng.choice(mine), "amount": last},
    ]
    refund = state["ledger"][-1]
    text = rng.choice(["Refund the last payment {} sent me.", "Send {} back the last amount they paid me."]).format(who)
    checks = bank_payments(conv, state, [(refund["dst"], refund["src"], last)])
    return Draft(text, {"bank": state}, checks, {"payee": who})


def _o_top_up(p, conv):
    rows = yield from bank_accounts()
    bal = yield from bank_balance(rows[p["dst"]])
    yield from bank_pay(conv, rows[p["src"]], rows[p["dst"]], p["target"] - bal, own_dst=True)


@template("bank_top_up", ("bank",), _o_top_up)
def _top_up(rng, conv):
    state, h = bank_state(rng, people(rng, 2), lo=100, hi=500)
    src_l, dst_l = rng.sample(["checking", "savings"], 2)
    src, dst = h["mine"][src_l], h["mine"][dst_l]
    bal = state["accounts"][dst]["balance"]
    target = bal + rng.randrange(5, state["accounts"][src]["balance"], 5)
    target = (target // 10) * 10 if (target // 10) * 10 > bal else target
    text = f"Top up my {dst_l} account to {target} using my {src_l} account."
    checks = bank_payments(conv, state, [(src, dst, target - bal)])
    return Draft(text, {"bank": state}, checks, {"src": src_l, "dst": dst_l, "target": target})
