"""Worlds: per-domain conventions that differ between otherwise identical tool sets.

The convention a world uses is the latent the agent must infer: instructions name the world
("[aurora] ...") but never state its rules, and breaking a rule either leaves the state wrong
(silent failure) or yields an uninformative ``{"error": "rejected"}``. Only a successful
action chain reveals the conventions.

Two groups of worlds, as a pretrained model meets a deployment:

* **Named worlds** (``WORLDS``: aurora, borealis, cobalt, dune) are the deployment candidates. Each pair of
  them disagrees somewhere in every domain. ``envs.deploy_worlds`` picks which ones a run deploys into.
* **Pretraining worlds** are generated from the knob space (``pretrain_worlds(n, seed)``): world ``i`` depends
  only on (seed, i), so a larger ``n`` extends a smaller one, and no generated world's full combination equals
  any named world's, so a deployment world is new as a whole even where single domains repeat. The warm start
  and the composer's cold start see only these.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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


_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_MAX_DRAWS = 10_000


def _combination(conventions: Mapping[str, Mapping]) -> tuple:
    return tuple((d, tuple(sorted(conventions[d].items()))) for d in sorted(conventions))


def _world_name(rng: random.Random) -> str:
    # Two consonant-vowel syllables and a consonant ("kamir"): pronounceable, unlike any named world or the
    # warm start's "wNN" aliases, so a name never hints at another world.
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(2)) + rng.choice(_CONSONANTS)


def _draw_world(rng: random.Random) -> dict[str, dict]:
    return {dom: {knob: rng.choice(values) for knob, values in knobs.items()} for dom, knobs in KNOBS.items()}


def pretrain_worlds(n: int, seed: int = 0) -> dict[str, dict[str, dict]]:
    """``n`` generated worlds, name -> conventions, in a fixed order. World ``i`` depends only on (seed, i)
    and on the worlds before it (names and combinations are unique), so a larger ``n`` extends a smaller one."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    taken_names = set(WORLDS)
    taken = {_combination(c) for c in WORLDS.values()}
    out: dict[str, dict[str, dict]] = {}
    for i in range(n):
        for attempt in range(_MAX_DRAWS):
            rng = random.Random(f"pretrain-world|{seed}|{i}|{attempt}")
            name, conv = _world_name(rng), _draw_world(rng)
            if name not in taken_names and _combination(conv) not in taken:
                break
        else:  # the knob space has tens of thousands of combinations: only an absurd n gets here
            raise ValueError(f"cannot draw {n} distinct pretraining worlds from the knob space")
        taken_names.add(name)
        taken.add(_combination(conv))
        out[name] = conv
    return out


def deploy_worlds(names: Sequence[str]) -> dict[str, dict[str, dict]]:
    """The named worlds a run deploys into, name -> conventions."""
    unknown = [w for w in names if w not in WORLDS]
    if unknown or not names:
        raise KeyError(f"unknown deployment world(s) {unknown or list(names)}; known: {sorted(WORLDS)}")
    return {w: WORLDS[w] for w in names}


def conventions_for(
    world_or_conventions: str | dict, domains=None, worlds: Mapping[str, dict] | None = None
) -> dict[str, dict]:
    """Conventions of a world (by name, looked up in ``worlds`` or else the named worlds) or a given mapping,
    restricted to ``domains``."""
    if isinstance(world_or_conventions, str):
        table = WORLDS if worlds is None else worlds
        if world_or_conventions not in table:
            raise KeyError(f"unknown world: {world_or_conventions}")
        conv = table[world_or_conventions]
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
# every pair of named worlds disagrees in every domain (the deployment candidates are mutually new)
assert all(WORLDS[a][d] != WORLDS[b][d] for a, b in itertools.combinations(WORLDS, 2) for d in KNOBS)


@dataclass(frozen=True)
class WorldSplit:
    """The worlds of a run: the pretraining worlds (warm start, cold start, ``pretrain_test``) and the
    deployment worlds (bank, distillation, train / test_id / test_ood)."""

    pretrain: dict[str, dict[str, dict]]
    deploy: dict[str, dict[str, dict]]

    def for_split(self, split: str) -> dict[str, dict[str, dict]]:
        """The worlds a split of the *deployment* task stream draws from (``pretrain_test``: pretraining)."""
        return self.pretrain if split == "pretrain_test" else self.deploy

    @classmethod
    def from_config(cls, envs) -> WorldSplit:
        """From an ``envs:`` config section (pretrain_worlds, deploy_worlds, world_seed)."""
        return cls(pretrain_worlds(envs.pretrain_worlds, envs.world_seed), deploy_worlds(envs.deploy_worlds))
