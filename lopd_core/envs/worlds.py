"""Worlds: per-domain conventions that differ between otherwise identical tool sets.

The convention a world uses is the latent the agent must infer: instructions name the world
("[aurora] ...") but never state its rules, and breaking a rule either leaves the state wrong
(silent failure) or yields an uninformative ``{"error": "rejected"}``. Only a successful
action chain reveals the conventions. Each domain has at least two knobs, and the four
worlds use four different value combinations, so every pair of worlds disagrees somewhere
in every domain.
"""

from __future__ import annotations

# domain -> knob -> allowed values (first listed is only the first world's choice, not a default)
KNOBS: dict[str, dict[str, tuple]] = {
    "bank": {
        "pay_tool": ("transfer", "wire"),  # which of two similar payment tools is booked correctly
        "amount_unit": ("units", "cents"),  # argument format of amounts
        "verify_payee": (False, True),  # ordering rule: bank_verify_payee(dst) before paying
    },
    "calendar": {
        "date_format": ("iso", "dmy", "mdy"),  # 2026-03-05 / 05/03/2026 / 03/05/2026
        "confirm_events": (False, True),  # extra step: calendar_confirm_event after creating
    },
    "shop": {
        "order_flow": ("direct", "cart"),  # shop_place_order vs shop_add_to_cart + shop_checkout
        "confirm_orders": (True, False),  # extra step: shop_confirm_order after ordering
    },
    "files": {
        "lock_writes": (True, False),  # ordering rule: files_lock before files_write (and unlock after)
        "remove_tool": ("delete", "trash"),  # files_delete vs files_trash
        "folder_style": ("plain", "slash"),  # folder argument "notes" vs "/notes"
    },
    "msg": {
        "channel": ("sms", "email"),  # msg_send_sms vs msg_send_email
        "recipient": ("id", "address"),  # `to` is the contact id, or the phone/email address
    },
    "travel": {
        "booking_flow": ("book", "hold_pay"),  # travel_book_flight vs travel_hold_flight + travel_pay_booking
        "place_style": ("iata", "city"),  # place arguments "OSL" vs "oslo"
    },
}

WORLDS: dict[str, dict[str, dict]] = {
    "aurora": {
        "bank": {"pay_tool": "transfer", "amount_unit": "units", "verify_payee": False},
        "calendar": {"date_format": "iso", "confirm_events": False},
        "shop": {"order_flow": "direct", "confirm_orders": True},
        "files": {"lock_writes": True, "remove_tool": "delete", "folder_style": "plain"},
        "msg": {"channel": "sms", "recipient": "id"},
        "travel": {"booking_flow": "book", "place_style": "iata"},
    },
    "borealis": {
        "bank": {"pay_tool": "wire", "amount_unit": "cents", "verify_payee": False},
        "calendar": {"date_format": "dmy", "confirm_events": True},
        "shop": {"order_flow": "cart", "confirm_orders": False},
        "files": {"lock_writes": False, "remove_tool": "trash", "folder_style": "slash"},
        "msg": {"channel": "email", "recipient": "address"},
        "travel": {"booking_flow": "hold_pay", "place_style": "city"},
    },
    "cobalt": {
        "bank": {"pay_tool": "transfer", "amount_unit": "cents", "verify_payee": True},
        "calendar": {"date_format": "mdy", "confirm_events": False},
        "shop": {"order_flow": "cart", "confirm_orders": True},
        "files": {"lock_writes": True, "remove_tool": "trash", "folder_style": "slash"},
        "msg": {"channel": "email", "recipient": "id"},
        "travel": {"booking_flow": "book", "place_style": "city"},
    },
    "dune": {
        "bank": {"pay_tool": "wire", "amount_unit": "units", "verify_payee": True},
        "calendar": {"date_format": "iso", "confirm_events": True},
        "shop": {"order_flow": "direct", "confirm_orders": False},
        "files": {"lock_writes": False, "remove_tool": "delete", "folder_style": "plain"},
        "msg": {"channel": "sms", "recipient": "address"},
        "travel": {"booking_flow": "hold_pay", "place_style": "iata"},
    },
}


def conventions_for(world_or_conventions: str | dict, domains=None) -> dict[str, dict]:
    """Conventions of a world (by name) or a given mapping, restricted to ``domains``."""
    if isinstance(world_or_conventions, str):
        if world_or_conventions not in WORLDS:
            raise KeyError(f"unknown world: {world_or_conventions}")
        conv = WORLDS[world_or_conventions]
    else:
        conv = world_or_conventions
    keep = conv if domains is None else {d: conv[d] for d in domains}
    return {d: dict(c) for d, c in keep.items()}


def _validate() -> None:
    for world, doms in WORLDS.items():
        assert set(doms) == set(KNOBS), world
        for dom, conv in doms.items():
            assert set(conv) == set(KNOBS[dom]), (world, dom)
            for knob, value in conv.items():
                assert value in KNOBS[dom][knob], (world, dom, knob, value)


_validate()
