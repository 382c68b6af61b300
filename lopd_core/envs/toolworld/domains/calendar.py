"""Calendar domain: one-hour events on dates, free slots, invitations.

Conventions: ``date_format`` (date arguments in the wrong format are "rejected", or — for
dmy vs mdy with a day <= 12 — silently address another date), ``confirm_events`` (events
created without calendar_confirm_event stay tentative: silent failure; confirming in a world
that does not use confirmation is "rejected").
"""

from __future__ import annotations

from ..formats import parse_date
from ..tools import ToolError, tool
from . import Domain

DAY_START, DAY_END = 9, 17  # bookable hours: 9..16


class Calendar(Domain):
    name = "calendar"

    def _date(self, text: str) -> str:
        iso = parse_date(text, self.conv["date_format"])
        if iso is None:
            raise ToolError("rejected")
        return iso

    def _busy(self, iso: str, start: int, skip: str = "") -> bool:
        return any(e["date"] == iso and e["start"] == start for k, e in self.state["events"].items() if k != skip)

    @tool
    def calendar_list_events(self, date: str) -> list:
        """List the events on a date.

        Args:
            date: the date
        """
        iso = self._date(date)
        rows = [(e["start"], k, e["title"]) for k, e in self.state["events"].items() if e["date"] == iso]
        return [{"id": k, "title": t, "start": s} for s, k, t in sorted(rows)][:4]

    @tool
    def calendar_free_slots(self, date: str) -> list:
        """First free start hours on a date.

        Args:
            date: the date
        """
        iso = self._date(date)
        return [h for h in range(DAY_START, DAY_END) if not self._busy(iso, h)][:4]

    @tool
    def calendar_create_event(self, title: str, date: str, start: int) -> dict:
        """Create a one-hour event.

        Args:
            title: event title
            date: the date
            start: start hour (9-16)
        """
        iso = self._date(date)
        if not DAY_START <= start < DAY_END or not title.strip() or self._busy(iso, start):
            raise ToolError("rejected")
        event = self.new_id("e", self.state["events"])
        status = "tentative" if self.conv["confirm_events"] else "confirmed"
        self.state["events"][event] = {
            "title": title,
            "date": iso,
            "start": start,
            "status": status,
            "attendees": [],
        }
        return {"id": event}

    @tool
    def calendar_confirm_event(self, event: str) -> dict:
        """Confirm a new event.

        Args:
            event: event id
        """
        e = self.lookup(self.state["events"], event)
        if not self.conv["confirm_events"] or e["status"] != "tentative":
            raise ToolError("rejected")
        e["status"] = "confirmed"
        return {"id": event, "status": "confirmed"}

    @tool
    def calendar_move_event(self, event: str, date: str, start: int) -> dict:
        """Move an event to another date and hour.

        Args:
            event: event id
            date: new date
            start: new start hour (9-16)
        """
        e = self.lookup(self.state["events"], event)
        iso = self._date(date)
        if not DAY_START <= start < DAY_END or self._busy(iso, start, skip=event):
            raise ToolError("rejected")
        e["date"], e["start"] = iso, start
        return {"id": event, "status": "moved"}

    @tool
    def calendar_cancel_event(self, event: str) -> dict:
        """Cancel (delete) an event.

        Args:
            event: event id
        """
        self.lookup(self.state["events"], event)
        del self.state["events"][event]
        return {"id": event, "status": "cancelled"}

    @tool
    def calendar_invite(self, event: str, name: str) -> dict:
        """Invite a person to an event.

        Args:
            event: event id
            name: the person's name
        """
        e = self.lookup(self.state["events"], event)
        if not name.strip():
            raise ToolError("rejected")
        if name not in e["attendees"]:
            e["attendees"].append(name)
        return {"id": event, "attendees": len(e["attendees"])}
