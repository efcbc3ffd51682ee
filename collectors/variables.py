"""The trainer side's one reader of ``RUNHEALTH_*`` variables (standard library only).

Every field of the hook's component configs is a variable named as the service's settings are:
``RUNHEALTH_<COMPONENT>__<FIELD>`` (``RUNHEALTH_HOOK__SHIFT_LABELS=0``,
``RUNHEALTH_SENDER__FLUSH_INTERVAL_S=1``); the flat names the README documents stay
(``FLAT_NAMES``). A yes/no is spelled as everywhere (``policies.flags``); an empty value is
unset. A name in one of the hook's components that is no field is an error, so a typo is not
silent; names in other sections are the service's (the embedded service inherits this
environment) and left to it.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from policies.flags import parse_flag

PREFIX = "RUNHEALTH_"
DELIMITER = "__"
# The name this rank's records give its node (else the host name).
NODE = "RUNHEALTH_NODE"

FLAT_NAMES: Mapping[str, tuple[str, str]] = {
    "RUNHEALTH_URL": ("transport", "url"),
    "RUNHEALTH_TOKEN": ("transport", "token"),
    "RUNHEALTH_RUN": ("transport", "run"),
    "RUNHEALTH_HEARTBEAT_S": ("sender", "heartbeat_interval_s"),
    "RUNHEALTH_SPOOL_DIR": ("spool", "directory"),
    "RUNHEALTH_DB": ("embedded", "db"),
}

Config = TypeVar("Config")


def text(environ: Mapping[str, str], name: str) -> str | None:
    """A variable's value, stripped; ``None`` when unset or empty."""
    return environ.get(name, "").strip() or None


def read_components(defaults: Config, environ: Mapping[str, str]) -> Config:
    """``defaults`` (a dataclass of component configs) with every variable that is set applied;
    each component's ``__post_init__`` judges its new values. A bad value is a ``ValueError``
    naming the variable."""
    root: Any = defaults
    chosen = _chosen(environ, {item.name for item in dataclasses.fields(root)})
    changes = {component: _replace(getattr(root, component), values) for component, values in chosen.items()}
    merged: Config = dataclasses.replace(root, **changes)
    return merged


def _chosen(environ: Mapping[str, str], components: set[str]) -> dict[str, dict[str, tuple[str, str]]]:
    """component -> field -> (variable, value), for the variables set."""
    chosen: dict[str, dict[str, tuple[str, str]]] = {}
    for variable, component, name in _named(environ, components):
        value = text(environ, variable)
        if value is None:
            continue
        fields = chosen.setdefault(component, {})
        if name in fields:
            raise ValueError(f"{fields[name][0]} and {variable} set the same setting: set one")
        fields[name] = (variable, value)
    return chosen


def _named(environ: Mapping[str, str], components: set[str]) -> Iterator[tuple[str, str, str]]:
    for variable in environ:
        upper = variable.upper()
        if upper in FLAT_NAMES:
            yield (variable, *FLAT_NAMES[upper])
        elif upper.startswith(PREFIX) and DELIMITER in upper:
            component, _, name = upper[len(PREFIX) :].lower().partition(DELIMITER)
            if component in components:
                yield variable, component, name


def _replace(current: Any, values: Mapping[str, tuple[str, str]]) -> Any:
    hints = typing.get_type_hints(type(current))
    fields = {item.name for item in dataclasses.fields(current) if item.init}
    parsed: dict[str, Any] = {}
    for name, (variable, raw) in values.items():
        parse = PARSERS.get(hints.get(name)) if name in fields else None
        if parse is None:
            raise ValueError(f"{variable} is not a setting of the hook")
        parsed[name] = parse(raw, variable)
    try:
        return dataclasses.replace(current, **parsed)
    except ValueError as exc:
        named = ", ".join(f"{variable}={raw!r}" for variable, raw in values.values())
        raise ValueError(f"{named}: {exc}") from None


def _integer(raw: str, variable: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{variable} must be an integer, got {raw!r}") from None


def _number(raw: str, variable: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{variable} must be a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{variable} must be a finite number, got {raw!r}")
    return value


def _word(raw: str, variable: str) -> str:
    return raw


PARSERS: Mapping[Any, Callable[[str, str], Any]] = {
    bool: parse_flag,
    int: _integer,
    float: _number,
    str: _word,
    str | None: _word,
}
