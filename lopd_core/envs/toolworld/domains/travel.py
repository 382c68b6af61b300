"""Travel domain: flight and hotel search and bookings.

Conventions: ``booking_flow`` (flights are booked directly with travel_book_flight, or held
with travel_hold_flight then paid with travel_pay_booking; the other path is "rejected" or
leaves the booking held: silent failure), ``place_style`` (place arguments are IATA codes
"OSL" or lowercase city names "oslo"; the wrong style silently finds nothing). Travel dates
are always ISO (2026-03-05), whatever the calendar of the same world uses.
"""

from __future__ import annotations

from ..formats import parse_date, parse_place
from ..tools import ToolError, tool
from . import Domain


class Travel(Domain):
    name = "travel"

    def _place(self, text: str) -> str | None:
        return parse_place(text, self.conv["place_style"])

    def _flight(self, flight: str) -> dict:
        f = self.lookup(self.state["flights"], flight)
        if f["seats"] < 1:
            raise ToolError("rejected")
        return f

    def _book(self, kind: str, item: str, status: str, **extra) -> dict:
        booking = self.new_id("b", self.state["bookings"])
        self.state["bookings"][booking] = {"kind": kind, "item": item, "status": status, **extra}
        return {"booking": booking, "status": status}

    @tool
    def travel_search_flights(self, origin: str, dest: str, date: str) -> list:
        """Search flights on a date.

        Args:
            origin: departure place
            dest: arrival place
            date: date (YYYY-MM-DD)
        """
        iso = parse_date(date, "iso")
        if iso is None:
            raise ToolError("rejected")
        o, d = self._place(origin), self._place(dest)
        rows = [
            (f["dep"], k, f["price"])
            for k, f in self.state["flights"].items()
            if f["origin"] == o and f["dest"] == d and f["date"] == iso and f["seats"] > 0
        ]
        return [{"id": k, "dep": dep, "price": price} for dep, k, price in sorted(rows)][:4]

    @tool
    def travel_book_flight(self, flight: str) -> dict:
        """Book a seat on a flight.

        Args:
            flight: flight id
        """
        f = self._flight(flight)
        if self.conv["booking_flow"] != "book":
            raise ToolError("rejected")
        f["seats"] -= 1
        return self._book("flight", flight, "ticketed")

    @tool
    def travel_hold_flight(self, flight: str) -> dict:
        """Hold a seat on a flight.

        Args:
            flight: flight id
        """
        f = self._flight(flight)
        f["seats"] -= 1
        return self._book("flight", flight, "held")

    @tool
    def travel_pay_booking(self, booking: str) -> dict:
        """Pay a held booking.

        Args:
            booking: booking id
        """
        b = self.lookup(self.state["bookings"], booking)
        if self.conv["booking_flow"] != "hold_pay" or b["status"] != "held":
            raise ToolError("rejected")
        b["status"] = "ticketed"
        return {"booking": booking, "status": "ticketed"}

    @tool
    def travel_cancel_booking(self, booking: str) -> dict:
        """Cancel a booking.

        Args:
            booking: booking id
        """
        b = self.lookup(self.state["bookings"], booking)
        if b["status"] == "cancelled":
            raise ToolError("rejected")
        b["status"] = "cancelled"
        if b["kind"] == "flight":
            self.state["flights"][b["item"]]["seats"] += 1
        return {"booking": booking, "status": "cancelled"}

    @tool
    def travel_search_hotels(self, city: str) -> list:
        """Search hotels in a city.

        Args:
            city: the place
        """
        code = self._place(city)
        rows = [
            {"id": k, "name": h["name"], "price": h["price"]}
            for k, h in self.state["hotels"].items()
            if h["city"] == code
        ]
        return rows[:4]

    @tool
    def travel_book_hotel(self, hotel: str, nights: int) -> dict:
        """Book a hotel room.

        Args:
            hotel: hotel id
            nights: number of nights
        """
        self.lookup(self.state["hotels"], hotel)
        if not 1 <= nights <= 30:
            raise ToolError("rejected")
        return self._book("hotel", hotel, "booked", nights=nights)

    @tool
    def travel_list_bookings(self) -> list:
        """Your latest bookings, newest first."""
        rows = [
            {"id": k, "kind": b["kind"], "item": b["item"], "status": b["status"]}
            for k, b in reversed(list(self.state["bookings"].items()))
        ]
        return rows[:4]
