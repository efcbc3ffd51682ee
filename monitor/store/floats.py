"""NaN and infinities on the wire and in JSON columns.

A NaN loss is the very signal this tool exists to catch, so nonfinite floats are data.
Standard JSON has no token for them; runhealth writes them as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"`` wherever a number is expected, and reads those strings
(and the bare ``NaN`` / ``Infinity`` tokens that Python's ``json`` module writes) back as
floats. Every JSON document the service prints or stores follows this rule.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

NONFINITE_BY_NAME: dict[str, float] = {
    "NaN": math.nan,
    "Infinity": math.inf,
    "-Infinity": -math.inf,
}


def float_to_wire(value: float) -> float | str:
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def float_from_wire(value: Any) -> Any:
    """Map the three nonfinite names to floats; leave anything else for validation."""
    if isinstance(value, str):
        return NONFINITE_BY_NAME.get(value, value)
    return value


def to_wire(obj: Any) -> Any:
    """A copy of ``obj`` with every nonfinite float replaced by its name."""
    if isinstance(obj, float):
        return float_to_wire(obj)
    if isinstance(obj, dict):
        return {key: to_wire(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        if all(type(value) is int or type(value) is str for value in obj):
            return obj  # the common case (sample ids): nothing to replace
        return [to_wire(value) for value in obj]
    return obj


def dumps(obj: Any, *, indent: bool = False) -> bytes:
    option = orjson.OPT_INDENT_2 if indent else 0
    return orjson.dumps(to_wire(obj), option=option | orjson.OPT_NON_STR_KEYS)


def dumps_str(obj: Any) -> str:
    return dumps(obj).decode()
