"""The numbers in NETWORKS_FILE, API_KEYS_FILE and CREDITS_FILE: finite, positive, and where they are
placed (a dotted path, never showing an API_KEYS_FILE part that may be a key)."""

from __future__ import annotations

import math
from typing import Any

from proxy.options import ConfigError

Place = tuple[str | int, ...]  # keys and list indexes from the document's top to one value


def positive_number(where: str, name: str, value: Any, *, whole: bool = False) -> Any:
    kinds = (int,) if whole else (int, float)
    if value is None:
        return None
    if not isinstance(value, kinds) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{where}: {name} must be a positive {'whole ' if whole else ''}number")
    return value


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
