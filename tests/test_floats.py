"""NaN and infinities on the wire: written as names, read back as floats, never bare."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monitor.store.floats import dumps, dumps_str
from policies.protocol import float_from_wire, float_to_wire, to_wire

NONFINITE = [(math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity")]

# What a JSON document can hold: 64-bit integers, text without lone surrogates.
text = st.text(st.characters(exclude_categories=["Cs"]), max_size=5)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=20,
)


def strict_loads(raw: bytes) -> Any:
    """Standard JSON only: a bare NaN or Infinity token is an error."""

    def refuse(token: str) -> Any:
        raise ValueError(f"bare {token} in JSON output")

    return json.loads(raw, parse_constant=refuse)


def same_float(a: Any, b: Any) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize(("value", "name"), NONFINITE)
def test_nonfinite_floats_have_names(value: float, name: str) -> None:
    assert float_to_wire(value) == name
    assert same_float(float_from_wire(name), value)


@settings(database=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_every_float_round_trips(value: float) -> None:
    assert same_float(float_from_wire(float_to_wire(value)), value)


def test_finite_floats_stay_numbers() -> None:
    assert float_to_wire(0.1) == 0.1
    assert float_to_wire(-0.0) == 0.0


@pytest.mark.parametrize("other", ["nan", "inf", "NAN", "", "1.5", 3, None, [1.0]])
def test_other_values_are_left_for_validation(other: Any) -> None:
    assert float_from_wire(other) == other


def test_to_wire_replaces_nested_nonfinite_floats() -> None:
    value = {"a": [1.0, math.nan, (math.inf, {"b": -math.inf})], "c": "NaN", "d": None}
    assert to_wire(value) == {
        "a": [1.0, "NaN", ["Infinity", {"b": "-Infinity"}]],
        "c": "NaN",
        "d": None,
    }


def test_dumps_writes_names_not_null() -> None:
    # orjson alone writes NaN as null, which would erase the signal.
    assert strict_loads(dumps({"loss": math.nan, "grad_norm": math.inf})) == {
        "loss": "NaN",
        "grad_norm": "Infinity",
    }


def test_dumps_keeps_non_string_keys_and_indents() -> None:
    assert dumps({1: -math.inf}) == b'{"1":"-Infinity"}'
    assert dumps(["x"], indent=True) == b'[\n  "x"\n]'
    assert dumps_str([math.nan]) == '["NaN"]'


@settings(database=None)
@given(json_values)
def test_dumps_never_emits_a_bare_nonfinite_token(value: Any) -> None:
    assert strict_loads(dumps(value)) == strict_loads(json.dumps(to_wire(value)).encode())
