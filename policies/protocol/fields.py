"""The vocabulary of the record protocol: value types with their limits, fields, structures.

Plain frozen values, so that each side can read one definition its own way: the ingest API
turns them into strict pydantic models, the store's test compares them with its columns, and
the hook checks what it builds against them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class Integer:
    """A whole number (a bool is not one, nor is a float with no fraction), at least ``ge``
    and at most ``le`` (no bound when None)."""

    ge: int | None = 0
    le: int | None = None


@dataclass(frozen=True)
class Real:
    """A float; nonfinite ones travel by name (``policies.protocol.nonfinite``). An int is taken."""


@dataclass(frozen=True)
class Text:
    """A string of ``min_length`` to ``max_length`` characters (no bound when None), matching
    ``pattern`` (a regular expression, anchored by itself) when given."""

    max_length: int | None = None
    min_length: int = 0
    pattern: str | None = None


@dataclass(frozen=True)
class Flag:
    """True or false; 0 and 1 are not flags."""


@dataclass(frozen=True)
class Choice:
    """One of a few fixed strings."""

    values: tuple[str, ...]


@dataclass(frozen=True)
class Document:
    """A free-form JSON object (string keys), kept as sent: its inner keys are not the
    protocol's (NVML counters, a restored optimizer's state, a canary's stack description)."""


@dataclass(frozen=True)
class ListOf:
    """A JSON array of ``item``, at most ``max_length`` long (no bound when None)."""

    item: ValueType
    max_length: int | None = None


@dataclass(frozen=True)
class MapOf:
    """A JSON object whose keys are ``key`` strings and whose values are ``value``."""

    value: ValueType
    key: Text = field(default_factory=Text)


@dataclass(frozen=True)
class Nested:
    """A value that is itself a structure of named fields (a manifest, a kernel's result)."""

    structure: Structure


@dataclass(frozen=True)
class Either:
    """A value of any one of ``options`` (sample ids: numbers or strings)."""

    options: tuple[ValueType, ...]


ValueType = Integer | Real | Text | Flag | Choice | Document | ListOf | MapOf | Nested | Either

EMPTY_LIST = ()
"""A field ``default``: an absent list is an empty list (a fresh one each time)."""


@dataclass(frozen=True)
class Field:
    """One named field. An optional field (``required`` False) may be absent; it then takes
    ``default`` (None unless given: ``None`` means "not sent", so a reader never guesses)."""

    name: str
    type: ValueType
    required: bool = False
    default: int | float | str | bool | tuple[()] | None = None


@dataclass(frozen=True)
class Structure:
    """Named fields in their one order (the store's content hash follows it). A record kind
    has ``kind`` (its wire name) and ``key``: the fields that identify one record of the
    kind within a run, so a re-sent record is stored once."""

    name: str
    doc: str
    fields: tuple[Field, ...]
    kind: str | None = None
    key: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names) or "kind" in names:
            raise ValueError(f"{self.name}: field names must be unique and not 'kind'")
        if not set(self.key) <= set(names):
            raise ValueError(f"{self.name}: key {self.key} names fields it does not have")

    def __getitem__(self, name: str) -> Field:
        for candidate in self.fields:
            if candidate.name == name:
                return candidate
        raise KeyError(f"{self.name} has no field {name!r}")

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    @cached_property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.fields)

    def max_length(self, name: str) -> int:
        """The bound of a bounded text or list field (what a sender cuts a value to)."""
        bound = getattr(self[name].type, "max_length", None)
        if bound is None:
            raise KeyError(f"{self.name}.{name} has no length bound")
        assert isinstance(bound, int)
        return bound
