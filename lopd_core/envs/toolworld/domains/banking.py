"""Bank domain: own accounts, payees, payments and a ledger.

Conventions: ``pay_tool`` (a payment booked with the other tool is recorded with the wrong
kind: silent failure), ``amount_unit`` (amounts passed in units where cents are expected move
a hundredth of the money: silent), ``verify_payee`` (paying an unverified payee is
"rejected").
"""

from __future__ import annotations

from ..tools import ToolError, tool
from . import Domain


def _num(x: float):
    return int(x) if float(x).is_integer() else round(x, 2)


class Bank(Domain):
    name = "bank"

    @tool
    def bank_list_accounts(self) -> list:
        """List your own accounts."""
        accts = self.state["accounts"]
        return [{"id": a, "label": v["label"]} for a, v in accts.items() if v["owner"] == "me"][:4]

    @tool
    def bank_find_account(self, owner: str) -> dict:
        """Find a payee's account by owner name.

        Args:
            owner: the payee's name
        """
        for acct, v in self.state["accounts"].items():
            if v["owner"] != "me" and v["owner"].lower() == owner.strip().lower():
                return {"id": acct, "owner": v["owner"]}
        raise ToolError("not found")

    @tool
    def bank_get_balance(self, account: str) -> dict:
        """Get the balance of one of your accounts.

        Args:
            account: account id
        """
        v = self.lookup(self.state["accounts"], account)
        if v["owner"] != "me":
            raise ToolError("rejected")
        return {"id": account, "balance": v["balance"]}

    @tool
    def bank_verify_payee(self, account: str) -> dict:
        """Verify a payee account before paying it.

        Args:
            account: payee account id
        """
        self.lookup(self.state["accounts"], account)
        if account not in self.state["verified"]:
            self.state["verified"].append(account)
        return {"id": account, "verified": True}

    def _pay(self, kind: str, src: str, dst: str, amount: int) -> dict:
        accts = self.state["accounts"]
        s, d = self.lookup(accts, src), self.lookup(accts, dst)
        value = _num(amount / 100) if self.conv["amount_unit"] == "cents" else amount
        if s["owner"] != "me" or src == dst or amount <= 0 or value > s["balance"]:
            raise ToolError("rejected")
        if self.conv["verify_payee"] and d["owner"] != "me" and dst not in self.state["verified"]:
            raise ToolError("rejected")
        s["balance"] = _num(s["balance"] - value)
        d["balance"] = _num(d["balance"] + value)
        self.state["ledger"].append({"kind": kind, "src": src, "dst": dst, "amount": value})
        return {"status": "sent"}

    @tool
    def bank_transfer(self, src: str, dst: str, amount: int) -> dict:
        """Transfer money from your account to another account.

        Args:
            src: your account id
            dst: destination account id
            amount: amount to send
        """
        return self._pay("transfer", src, dst, amount)

    @tool
    def bank_wire(self, src: str, dst: str, amount: int) -> dict:
        """Wire money from your account to another account.

        Args:
            src: your account id
            dst: destination account id
            amount: amount to send
        """
        return self._pay("wire", src, dst, amount)

    @tool
    def bank_history(self, account: str) -> list:
        """Last three payments into or out of an account, newest first.

        Args:
            account: account id
        """
        self.lookup(self.state["accounts"], account)
        rows = [e for e in self.state["ledger"] if account in (e["src"], e["dst"])]
        return [{"from": e["src"], "to": e["dst"], "amount": e["amount"]} for e in reversed(rows)][:3]
