"""Building records the way the service will read them, for the trainer side.

``build(HEARTBEAT, incarnation=..., rank=..., ...)`` gives the wire dict of one record: the
``kind`` first, fields in protocol order, absent (None) fields left out, nonfinite floats by
name. A value the service would refuse (an unknown or missing field, a string over its bound, a
float where a count goes) raises ``ProtocolError`` naming the field, so a hook bug shows where
the record is made instead of as a dead-lettered batch.

The checks are plain type and length tests, microseconds a record: fine for the records a run
sends now and then (heartbeats, checkpoints, samples, acks). Step records, one per rank and
window, are not built here: ``collectors.window`` writes them directly and names its fields
through ``require``, checked once, at import; their identity is checked once, at attach.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from policies.protocol.fields import (
    Choice,
    Document,
    Either,
    Flag,
    Integer,
    ListOf,
    MapOf,
    Nested,
    Real,
    Structure,
    Text,
    ValueType,
)
from policies.protocol.nonfinite import NONFINITE_BY_NAME, to_wire


class ProtocolError(ValueError):
    """A record the service would refuse; the message names the kind and the field."""


def build(kind: Structure, /, **values: Any) -> dict[str, Any]:
    """The wire dict of one record of ``kind`` (see the module docstring)."""
    check_fields(kind, values)
    record: dict[str, Any] = {"kind": kind.kind}
    for field in kind.fields:
        value = values.get(field.name)
        if value is not None:
            record[field.name] = to_wire(value)
        elif field.required:
            raise ProtocolError(f"{kind.kind or kind.name}.{field.name}: required")
    return record


def check_fields(kind: Structure, values: Mapping[str, Any]) -> None:
    """Each given field is one of ``kind``'s and within its type and limits (None: absent)."""
    unknown = values.keys() - kind.names - {"kind"}
    if unknown:
        raise ProtocolError(f"{kind.kind or kind.name}: unknown fields {sorted(unknown)}")
    for name, value in values.items():
        if value is None or name == "kind":
            continue
        problem = value_problem(kind[name].type, value)
        if problem is not None:
            raise ProtocolError(f"{kind.kind or kind.name}.{name}: {problem}")


def require(kind: Structure, *names: str) -> tuple[str, ...]:
    """``names``, once each is known to be a field of ``kind`` (a writer that spells its field
    names itself calls this once, at import, so a misspelt or removed field fails there)."""
    unknown = set(names) - kind.names
    if unknown:
        raise ProtocolError(f"{kind.kind or kind.name}: unknown fields {sorted(unknown)}")
    return names


def value_problem(expected: ValueType, value: Any) -> str | None:
    """Why ``value`` is not a valid ``expected`` (None when it is)."""
    match expected:
        case Integer(ge=ge, le=le):
            if not isinstance(value, int) or isinstance(value, bool):
                return f"expected an integer, got {type(value).__name__}"
            if ge is not None and value < ge:
                return f"must be >= {ge}, got {value}"
            return None if le is None or value <= le else f"must be <= {le}, got {value}"
        case Real():
            number = isinstance(value, float | int) and not isinstance(value, bool)
            ok = number or (isinstance(value, str) and value in NONFINITE_BY_NAME)
            return None if ok else f"expected a number, got {type(value).__name__}"
        case Flag():
            return None if isinstance(value, bool) else f"expected true or false, got {type(value).__name__}"
        case Choice(values=choices):
            return None if value in choices else f"expected one of {list(choices)}, got {value!r}"
        case Text():
            return _text_problem(expected, value)
        case Document():
            return None if isinstance(value, Mapping) else f"expected an object, got {type(value).__name__}"
        case ListOf() | MapOf():
            return _container_problem(expected, value)
        case Nested(structure=structure):
            return _nested_problem(structure, value)
        case Either(options=options):
            if any(value_problem(option, value) is None for option in options):
                return None
            return f"not any of the accepted types ({type(value).__name__})"
    raise TypeError(f"unknown protocol type {expected!r}")


def _text_problem(expected: Text, value: Any) -> str | None:
    if type(value) is not str:
        return f"expected a string, got {type(value).__name__}"
    if len(value) < expected.min_length:
        return f"at least {expected.min_length} characters"
    if expected.max_length is not None and len(value) > expected.max_length:
        return f"at most {expected.max_length} characters, got {len(value)}"
    if expected.pattern is not None and re.match(expected.pattern, value) is None:
        return f"does not match {expected.pattern}"
    return None


def _container_problem(expected: ListOf | MapOf, value: Any) -> str | None:
    if isinstance(expected, ListOf):
        if not isinstance(value, list | tuple):
            return f"expected a list, got {type(value).__name__}"
        if expected.max_length is not None and len(value) > expected.max_length:
            return f"at most {expected.max_length} items, got {len(value)}"
        items = enumerate(value)
        problems = ((f"[{i}]", value_problem(expected.item, item)) for i, item in items)
    else:
        if not isinstance(value, Mapping):
            return f"expected an object, got {type(value).__name__}"
        problems = (
            (f"[{key!r}]", value_problem(expected.key, key) or value_problem(expected.value, item))
            for key, item in value.items()
        )
    return next((f"{where}: {problem}" for where, problem in problems if problem is not None), None)


def _nested_problem(structure: Structure, value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return f"expected an object, got {type(value).__name__}"
    try:
        check_fields(structure, value)
    except ProtocolError as exc:
        return str(exc)
    missing = [f.name for f in structure.fields if f.required and value.get(f.name) is None]
    return f"{structure.name}: missing {missing}" if missing else None
