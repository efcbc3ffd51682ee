"""The store's columns (``monitor.store.models``) against the record protocol, for every kind:
each protocol field is stored, under its own name (or a name listed here), in a column of a
fitting type, nullable when the field is optional, and the kind's key is a unique constraint
with the run. Each record column is a protocol field or listed as the service's own."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import sqlalchemy as sa

from monitor.store import models
from policies import protocol
from policies.protocol import Field, Structure


@dataclass(frozen=True)
class Storage:
    """Where one record kind is kept."""

    table: sa.Table
    renamed: dict[str, str] = field(default_factory=dict)
    """Field -> column, where the column says more than the field would."""
    nullable: frozenset[str] = frozenset()
    """Required fields whose column is nullable anyway, with the reason in ``STORAGE``."""


# The service's own columns: ids, the run, when a record arrived, its content hash.
BOOKKEEPING = {"id", "run_id", "received_at", "content_hash"}

STORAGE: dict[str, Storage] = {
    "step": Storage(models.table_of(models.StepRecord)),
    "heartbeat": Storage(models.table_of(models.Heartbeat)),
    # A run's start and finish share its incarnation's row; a finish that arrives first makes
    # the row, so the start's required fields are nullable there.
    "run_start": Storage(
        models.table_of(models.Incarnation),
        {"time": "started_at"},
        frozenset({"time", "world_size"}),
    ),
    "run_finish": Storage(
        models.table_of(models.Incarnation),
        {"time": "finished_at", "status": "finish_status"},
        frozenset({"time"}),
    ),
    "device_sample": Storage(models.table_of(models.DeviceSample)),
    "link_sample": Storage(models.table_of(models.LinkSample)),
    "checkpoint": Storage(models.table_of(models.CheckpointEvent)),
    "resume": Storage(models.table_of(models.ResumeEvent)),
    "stack_dump": Storage(models.table_of(models.StackDump)),
    "directive_ack": Storage(models.table_of(models.DirectiveAck)),
    "canary_result": Storage(models.table_of(models.CanaryResult)),
}

# Columns of record tables that are the service's, not the record's.
SERVICE_COLUMNS = {
    "incarnations": {"finish_hash"},  # the run_finish record's content hash
    "canary_results": {"judged", "verdict"},  # the engine's progress and its verdict
}

# Fields that are received but not stored, and why. None today: every field is kept.
UNSTORED: dict[str, set[str]] = {}

# Text columns narrower than the protocol's bound. None: a device id is bounded at 100 by the
# protocol, as the columns are.
NARROWER: dict[tuple[str, str], int] = {}

KINDS = [kind.kind or "" for kind in protocol.RECORD_KINDS]


def column_for(kind: str, spec: Field) -> sa.Column[object]:
    storage = STORAGE[kind]
    name = storage.renamed.get(spec.name, spec.name)
    assert name in storage.table.c, f"{kind}.{spec.name}: no column {name!r} in {storage.table.name}"
    column: sa.Column[object] = storage.table.c[name]
    return column


def fits(value_type: protocol.ValueType, column: sa.Column[object]) -> bool:
    """Whether the column's type holds every value of the protocol type."""
    kind = column.type
    match value_type:
        case protocol.Integer():
            return isinstance(kind, sa.Integer)
        case protocol.Real():
            return isinstance(kind, models.Float64)
        case protocol.Flag():
            return isinstance(kind, sa.Boolean)
        case protocol.Text() | protocol.Choice():
            return isinstance(kind, sa.String)
        case protocol.Document() | protocol.ListOf() | protocol.MapOf() | protocol.Nested():
            return isinstance(kind, sa.JSON)
    return False


def text_bound(value_type: protocol.ValueType) -> int | None:
    match value_type:
        case protocol.Text(max_length=longest):
            return longest
        case protocol.Choice(values=values):
            return max(len(value) for value in values)
    return None


@pytest.mark.parametrize("kind", KINDS)
def test_every_field_is_stored_in_a_fitting_column(kind: str) -> None:
    structure: Structure = protocol.BY_KIND[kind]
    storage = STORAGE[kind]
    for spec in structure.fields:
        if spec.name in UNSTORED.get(kind, set()):
            continue
        column = column_for(kind, spec)
        where = f"{kind}.{spec.name} -> {storage.table.name}.{column.name}"
        assert fits(spec.type, column), f"{where}: {column.type!r} for {spec.type!r}"
        if not spec.required or spec.name in storage.nullable:
            assert column.nullable or spec.default is not None, f"{where}: optional but NOT NULL"
        else:
            assert not column.nullable, f"{where}: required but nullable"
        bound, length = text_bound(spec.type), getattr(column.type, "length", None)
        if bound is not None and length is not None:
            assert length >= bound or NARROWER.get((kind, spec.name)) == length, (
                f"{where}: {length} < {bound}"
            )


@pytest.mark.parametrize("kind", KINDS)
def test_the_kinds_key_is_unique_with_its_run(kind: str) -> None:
    table = STORAGE[kind].table
    key = {"run_id", *protocol.BY_KIND[kind].key}
    uniques = [
        {c.name for c in constraint.columns}
        for constraint in table.constraints
        if isinstance(constraint, sa.UniqueConstraint)
    ]
    assert key in uniques, f"{table.name}: no unique constraint on {sorted(key)}"


def test_every_record_column_is_a_field_or_the_services_own() -> None:
    fields_by_table: dict[str, set[str]] = {}
    for kind, storage in STORAGE.items():
        names = {storage.renamed.get(f.name, f.name) for f in protocol.BY_KIND[kind].fields}
        fields_by_table.setdefault(storage.table.name, set()).update(names)
    for kind, storage in STORAGE.items():
        table = storage.table
        extra = (
            set(table.c.keys())
            - fields_by_table[table.name]
            - BOOKKEEPING
            - SERVICE_COLUMNS.get(table.name, set())
        )
        assert not extra, f"{table.name}: columns {sorted(extra)} are in no protocol field ({kind})"


def test_the_listed_exceptions_are_still_needed() -> None:
    for (kind, name), length in NARROWER.items():
        bound = protocol.BY_KIND[kind][name].type
        assert getattr(column_for(kind, protocol.BY_KIND[kind][name]).type, "length", None) == length
        assert text_bound(bound) is not None and text_bound(bound) != length  # else drop the entry
    for kind, storage in STORAGE.items():
        for name in storage.nullable:
            assert protocol.BY_KIND[kind][name].required, f"{kind}.{name} is optional: drop it from nullable"
