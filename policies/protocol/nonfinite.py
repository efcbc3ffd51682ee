"""NaN and infinities by name: the one codec both sides use.

A NaN loss is the very signal runhealth exists to catch, so nonfinite floats are data. Standard
JSON has no token for them; runhealth writes them as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` wherever a number is expected, and reads those strings back as floats. (The bare
``NaN`` / ``Infinity`` tokens that Python's ``json`` module writes are read as floats by any
reader that accepts them; the names are what every writer here emits.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

NONFINITE_BY_NAME: Mapping[str, float] = MappingProxyType(
    {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
)


def float_to_wire(value: float) -> float | str:
    """A float as it travels: finite as is, nonfinite by name."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def float_from_wire(value: Any) -> Any:
    """The three names as floats; anything else is left as it is, for validation to judge."""
    if isinstance(value, str):
        return NONFINITE_BY_NAME.get(value, value)
    return value


def to_wire(obj: Any) -> Any:
    """A copy of ``obj`` with every nonfinite float, however nested, replaced by its name.
    Mappings become dicts and tuples lists (what JSON holds)."""
    kind = type(obj)
    if kind in _LEAVES:  # exact types first: the ingest path runs this on every JSON value
        return float_to_wire(obj) if kind is float else obj
    if kind is dict or (kind not in _CONTAINERS and isinstance(obj, Mapping)):
        return {key: to_wire(value) for key, value in obj.items()}
    if kind in _CONTAINERS or isinstance(obj, list | tuple):
        if all(type(value) is int or type(value) is str for value in obj):
            return list(obj)  # the common case (sample ids): nothing to replace
        return [to_wire(value) for value in obj]
    return float_to_wire(obj) if isinstance(obj, float) else obj


_LEAVES = frozenset({float, int, str, bool, type(None)})
_CONTAINERS = frozenset({list, tuple})
