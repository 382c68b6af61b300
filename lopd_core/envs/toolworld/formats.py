"""Argument formats shared by domains (which parse them) and templates (which produce them).

Dates are stored as ISO strings in every state; a world's ``date_format`` only changes how
the date *argument* must be written. Places are stored as IATA codes; a world's
``place_style`` decides whether arguments are codes ("OSL") or lowercase city names.
"""

from __future__ import annotations

import datetime as _dt
import re

CITIES = {
    "OSL": "oslo",
    "ROM": "rome",
    "PAR": "paris",
    "BER": "berlin",
    "MAD": "madrid",
    "LIS": "lisbon",
    "VIE": "vienna",
    "PRG": "prague",
}


def place_arg(code: str, style: str) -> str:
    return code if style == "iata" else CITIES[code]


def parse_place(text: str, style: str) -> str | None:
    """IATA code from a world-formatted place argument, or None."""
    if style == "iata":
        return text if text in CITIES else None
    for code, city in CITIES.items():
        if text == city:
            return code
    return None


def fmt_date(iso: str, style: str) -> str:
    """Date argument in a world's format."""
    y, m, d = iso.split("-")
    if style == "iso":
        return iso
    if style == "dmy":
        return f"{d}/{m}/{y}"
    if style == "mdy":
        return f"{m}/{d}/{y}"
    raise ValueError(style)


def parse_date(text: str, style: str) -> str | None:
    """ISO date from a world-formatted argument, or None if it does not parse."""
    try:
        if style == "iso":
            if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
                return None
            return _dt.date.fromisoformat(text).isoformat()
        parts = text.split("/")
        if len(parts) != 3 or len(parts[2]) != 4 or not all(p.isdigit() for p in parts):
            return None
        a, b, y = (int(p) for p in parts)
        day, month = (a, b) if style == "dmy" else (b, a)
        return _dt.date(y, month, day).isoformat()
    except ValueError:
        return None
