"""The numbers in NETWORKS_FILE, API_KEYS_FILE and CREDITS_FILE: finite, within their ranges, and where
they are placed (a dotted path, never showing an API_KEYS_FILE part that may be a key)."""

from __future__ import annotations

import math
from typing import Any

from proxy.options import ConfigError

Place = tuple[str | int, ...]  # keys and list indexes from the document's top to one value


def non_finite(value: Any, where: Place = ()) -> Place | None:
    """The path of the first float in a TOML document that is inf or nan, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = non_finite(item, (*where, key))
        if found is not None:
            return found
    return None


def dotted(where: Place) -> str:
    """`networks.main.upstreams[0].max_rps`"""
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in where).lstrip(".")


# Each number's range in the files (low, high, whole), by field name: wide enough for any real node or
# provider, narrow enough that nothing worked out from it (1/max_rps, a sum of weights, ms / 1000, a
# window's places, a float made of an integer) overflows. docs/networks.md lists them.
RANGES: dict[str, tuple[float, int, bool]] = {
    "weight": (0.001, 1_000_000, False),
    "max_rps": (0.001, 1_000_000_000, False),
    "max_units_per_second": (0.001, 1_000_000_000, False),
    "max_concurrency": (1, 1_000_000, True),
    "method_costs": (1, 1_000_000_000, True),
    "default_cost": (1, 1_000_000_000, True),
    "recent_blocks": (1, 1_000_000_000, True),
    "confirm_immutable": (1, 1_000, True),
    "checkpoint_quorum": (1, 1_000, True),
    "hedge_after_ms": (0.1, 3_600_000, False),
    "finality_depth": (1, 1_000_000_000, True),
    "chain_id": (1, 2**64 - 1, True),
}


def in_range(where: str, name: str, value: Any) -> Any:
    """`value` checked against its field's range (RANGES; `method_costs.X` as method_costs); None stays
    None. A huge TOML integer is compared exactly, never made a float."""
    if value is None:
        return None
    low, high, whole = RANGES[name.partition(".")[0]]
    kinds = (int,) if whole else (int, float)
    if not isinstance(value, kinds) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{where}: {name} must be a positive {'whole ' if whole else ''}number from {low} to {high}")
    return value
