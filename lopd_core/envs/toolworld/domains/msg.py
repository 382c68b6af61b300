"""Messages domain: contacts, an inbox, and sending by SMS or e-mail.

Conventions: ``channel`` (a message sent on the other channel is recorded as such: silent
failure), ``recipient`` (``to`` is the contact id, or the contact's phone/e-mail address for
sms/email; the wrong kind of recipient is "rejected").
"""

from __future__ import annotations

from ..tools import ToolError, tool
from . import Domain


class Msg(Domain):
    name = "msg"

    def _send(self, channel: str, to: str, text: str) -> dict:
        contacts = self.state["contacts"]
        if self.conv["recipient"] == "id":
            cid = to if to in contacts else None
        else:
            field = "phone" if channel == "sms" else "email"
            cid = next((k for k, c in contacts.items() if c[field] == to), None)
        if cid is None or not text.strip():
            raise ToolError("rejected")
        self.state["sent"].append({"channel": channel, "to": cid, "text": text})
        return {"status": "sent"}

    @tool
    def msg_find_contact(self, name: str) -> dict:
        """Find a contact by name.

        Args:
            name: contact name
        """
        for k, c in self.state["contacts"].items():
            if c["name"].lower() == name.strip().lower():
                return {"id": k, "name": c["name"]}
        raise ToolError("not found")

    @tool
    def msg_get_contact(self, contact: str) -> dict:
        """Phone and e-mail of a contact.

        Args:
            contact: contact id
        """
        c = self.lookup(self.state["contacts"], contact)
        return {"id": contact, "name": c["name"], "phone": c["phone"], "email": c["email"]}

    @tool
    def msg_add_contact(self, name: str, phone: str, email: str) -> dict:
        """Save a new contact.

        Args:
            name: contact name
            phone: phone number
            email: e-mail address
        """
        if not name.strip() or any(c["name"].lower() == name.strip().lower() for c in self.state["contacts"].values()):
            raise ToolError("rejected")
        cid = self.new_id("c", self.state["contacts"])
        self.state["contacts"][cid] = {"name": name.strip(), "phone": phone, "email": email}
        return {"id": cid}

    @tool
    def msg_send_sms(self, to: str, text: str) -> dict:
        """Send a text message.

        Args:
            to: recipient
            text: message text
        """
        return self._send("sms", to, text)

    @tool
    def msg_send_email(self, to: str, text: str) -> dict:
        """Send an e-mail.

        Args:
            to: recipient
            text: message text
        """
        return self._send("email", to, text)

    @tool
    def msg_inbox(self) -> list:
        """Your latest received messages, newest first."""
        return [{"from": m["from"], "text": m["text"]} for m in reversed(self.state["inbox"])][:3]
