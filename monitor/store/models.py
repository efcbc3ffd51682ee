"""The store's schema: SQLAlchemy 2 typed models.

Times are UTC epoch seconds (float) throughout: trainers send them that way and every
comparison the engine makes is arithmetic on them. Nonfinite floats are data; see
``Float64`` for how SQLite keeps a NaN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from enum import StrEnum
from types import MappingProxyType
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from policies import protocol
from policies.directive_lifecycle import AckStatus, DirectiveStatus
from policies.proposal_lifecycle import ProposalStatus

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Float64(TypeDecorator[float]):
    """A double that keeps NaN on SQLite.

    SQLite turns a bound NaN into NULL, which would erase the signal; a REAL column can hold
    the text ``'NaN'`` instead, and it is read back as a float. PostgreSQL's double precision
    stores NaN natively. Infinities are REAL values on both.
    """

    impl = sa.Double
    cache_ok = True

    # Processors are built per dialect so PostgreSQL pays nothing, and SQLite pays one
    # comparison per value: this type is on the ingest hot path.
    def bind_processor(self, dialect: Dialect) -> Any:
        if dialect.name != "sqlite":
            return None
        return _nan_to_text

    def result_processor(self, dialect: Dialect, coltype: Any) -> Any:
        if dialect.name != "sqlite":
            return None
        return _text_to_nan

    def process_bind_param(self, value: float | None, dialect: Dialect) -> Any:
        return _nan_to_text(value) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> float | None:
        result: float | None = _text_to_nan(value)
        return result


def _nan_to_text(value: Any) -> Any:
    return "NaN" if value != value else value  # only NaN is unequal to itself


def _text_to_nan(value: Any) -> Any:
    return math.nan if value == "NaN" else value


def status_check(statuses: type[StrEnum]) -> sa.CheckConstraint:
    """The ``status`` column holds one of the lifecycle's statuses and nothing else (the moves
    between them are decided in ``policies``; this keeps a stray write out of the store)."""
    allowed = ", ".join(f"'{status.value}'" for status in statuses)
    return sa.CheckConstraint(f"status IN ({allowed})", name="status")


def record_columns(
    kind: protocol.Structure,
    *,
    wide: Set[str] = frozenset(),
    lengths: Mapping[str, int] = MappingProxyType({}),
) -> list[sa.Column[Any]]:
    """A column per field of a record kind, named as the field, nullable where the field is
    optional. ``wide``: counts that outgrow 32 bits (tokens, examples consumed). ``lengths``:
    text columns narrower than the protocol's bound (kept as the first migration made them)."""
    return [
        sa.Column(
            field.name,
            _column_type(field, field.name in wide, lengths.get(field.name)),
            nullable=not field.required,
        )
        for field in kind.fields
    ]


def _column_type(field: protocol.Field, wide: bool, length: int | None) -> Any:
    match field.type:
        case protocol.Integer():
            return sa.BigInteger() if wide else sa.Integer()
        case protocol.Real():
            return Float64()
        case protocol.Flag():
            return sa.Boolean()
        case protocol.Text(max_length=longest):
            return sa.String(length or longest)
        case protocol.Choice(values=values):
            return sa.String(length or max(len(value) for value in values))
    return sa.JSON()  # documents, lists, maps and nested structures


PARTITION_COLUMN = "time"
"""On PostgreSQL the raw per-rank tables (``PARTITIONED_TABLES``) are partitioned by range on
the record's own time (migration 0011, ``monitor.store.partitions``)."""

PARTITIONED_TABLES = ("step_records", "device_samples", "link_samples")


def raw_record_keys(*key: str) -> tuple[sa.UniqueConstraint, sa.UniqueConstraint]:
    """The unique key of a raw per-rank table, per backend. A unique key of a partitioned
    PostgreSQL table must hold its partition column, so there it is the key plus the record's
    time; on SQLite it is the key itself. ``unique_key`` says which one a dialect has."""
    return (
        sa.UniqueConstraint(*key).ddl_if(dialect="sqlite"),
        sa.UniqueConstraint(*key, PARTITION_COLUMN).ddl_if(dialect="postgresql"),
    )


def constraint_dialect(constraint: sa.Constraint) -> str | None:
    """The one dialect a constraint is made on (``raw_record_keys``), or ``None`` for all."""
    condition = getattr(constraint, "_ddl_if", None)
    dialect = getattr(condition, "dialect", None)
    return dialect if isinstance(dialect, str) else None


def unique_key(table: sa.Table, dialect: str) -> tuple[str, ...]:
    """The columns of ``table``'s unique key on ``dialect``: the ``ON CONFLICT`` target of an
    idempotent insert (a table has one unique key per dialect)."""
    [constraint] = [
        c
        for c in table.constraints
        if isinstance(c, sa.UniqueConstraint) and constraint_dialect(c) in (None, dialect)
    ]
    return tuple(column.name for column in constraint.columns)


def partition_free_key(table: sa.Table, dialect: str) -> tuple[str, ...] | None:
    """The record's own key where ``dialect``'s unique key also holds the partition column
    (``raw_record_keys``): the unique index does not stop that key being stored again at
    another time, so ingest looks for one itself. ``None`` where the unique key is the record's."""
    key = unique_key(table, dialect)
    if PARTITION_COLUMN not in key or table.name not in PARTITIONED_TABLES:
        return None
    return tuple(name for name in key if name != PARTITION_COLUMN)


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {float: Float64(), dict[str, Any]: sa.JSON(), list[Any]: sa.JSON()}


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(200), unique=True)
    # sha256 of the run's bearer token; the token itself is shown once, at creation.
    token_hash: Mapped[str] = mapped_column(sa.String(64))
    created_at: Mapped[float]


class Incarnation(Base):
    """One start of the job: a UUID shared by all its ranks, new after every restart."""

    __tablename__ = "incarnations"
    __table_args__ = (sa.UniqueConstraint("run_id", "incarnation"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    incarnation: Mapped[str] = mapped_column(sa.String(64))
    world_size: Mapped[int | None]
    started_at: Mapped[float | None]
    layout: Mapped[dict[str, Any] | None]
    config: Mapped[dict[str, Any] | None]
    content_hash: Mapped[str] = mapped_column(sa.String(32))
    finished_at: Mapped[float | None]
    finish_status: Mapped[str | None] = mapped_column(sa.String(32))
    finish_hash: Mapped[str | None] = mapped_column(sa.String(32))


class StepRecord(Base):
    """One rank's accumulation window. Key: (run, incarnation, rank, attempt).

    A column per field of ``policies.protocol.STEP``, made from the protocol (``record_columns``):
    a new step field is its protocol field plus the migration that adds its column
    (``tests/test_migrations.py`` fails until the two agree)."""

    __table__ = sa.Table(
        "step_records",
        Base.metadata,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        *record_columns(protocol.STEP, wide={"consumed", "tokens"}, lengths={"device_uuid": 100}),
        sa.Column("received_at", Float64(), nullable=False),
        sa.Column("content_hash", sa.String(32), nullable=False),
        *raw_record_keys("run_id", *protocol.STEP.key),
        # A window's records, as the engine reads them (migration 0010).
        sa.Index("ix_step_records_window", "run_id", "incarnation", "attempt"),
    )


class StepSummary(Base):
    """The whole run at one accumulation window, aggregated over its ranks."""

    __tablename__ = "step_summaries"
    __table_args__ = (
        sa.UniqueConstraint("run_id", "incarnation", "attempt"),
        sa.Index("ix_step_summaries_run_judged", "run_id", "judged"),
    )

    id: Mapped[int] = mapped_column(sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    incarnation: Mapped[str] = mapped_column(sa.String(64))
    attempt: Mapped[int]
    step: Mapped[int]
    ranks_reported: Mapped[int]
    tokens: Mapped[int | None] = mapped_column(sa.BigInteger)
    loss_sum: Mapped[float | None]
    reported_loss_sum: Mapped[float | None]
    reported_loss_count: Mapped[int] = mapped_column(default=0)
    grad_norm: Mapped[float | None]
    lr: Mapped[float | None]
    loss_scale: Mapped[float | None]
    skipped_ranks: Mapped[int] = mapped_column(default=0)
    consumed: Mapped[int | None] = mapped_column(sa.BigInteger)
    # For the loss-normalization audit: the sum of per-rank token means and the token spread.
    rank_mean_sum: Mapped[float | None]
    rank_mean_count: Mapped[int] = mapped_column(default=0, server_default="0")
    min_rank_tokens: Mapped[int | None] = mapped_column(sa.BigInteger)
    max_rank_tokens: Mapped[int | None] = mapped_column(sa.BigInteger)
    first_time: Mapped[float]
    last_time: Mapped[float]
    judged: Mapped[bool] = mapped_column(default=False)
    late_records: Mapped[int] = mapped_column(default=0)


class Heartbeat(Base):
    """Each rank's latest heartbeat: sent by the hook's own thread, on its own clock."""

    __tablename__ = "heartbeats"
    __table_args__ = (sa.UniqueConstraint("run_id", "incarnation", "rank"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    incarnation: Mapped[str] = mapped_column(sa.String(64))
    rank: Mapped[int]
    node: Mapped[str | None] = mapped_column(sa.String(200))
    step: Mapped[int | None]
    attempt: Mapped[int | None]
    phase: Mapped[str] = mapped_column(sa.String(32))
    phase_since: Mapped[float]
    time: Mapped[float]
    received_at: Mapped[float]
    # While compiling: when the rank's processes last used CPU at a compiler's rate (its clock).
    cpu_busy_at: Mapped[float | None]


class DeviceSample(Base):
    """One NVML reading of one device. Key: (run, node, device UUID, sequence)."""

    __tablename__ = "device_samples"
    __table_args__ = raw_record_keys("run_id", "node", "device_uuid", "seq")

    id: Mapped[int] = mapped_column(sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(sa.String(200))
    device_uuid: Mapped[str] = mapped_column(sa.String(100))
    seq: Mapped[int] = mapped_column(sa.BigInteger)
    time: Mapped[float]
    rank: Mapped[int | None]
    clock_event_reasons: Mapped[int | None] = mapped_column(sa.BigInteger)
    sm_clock_mhz: Mapped[float | None]
    mem_clock_mhz: Mapped[float | None]
    power_w: Mapped[float | None]
    power_limit_w: Mapped[float | None]
    temperature_c: Mapped[float | None]
    counters: Mapped[dict[str, Any] | None]
    xids: Mapped[list[Any] | None]
    received_at: Mapped[float]
    content_hash: Mapped[str] = mapped_column(sa.String(32))


class LinkSample(Base):
    """One reading of one InfiniBand/RoCE port. Key: (run, node, device, port, sequence)."""

    __tablename__ = "link_samples"
    __table_args__ = raw_record_keys("run_id", "node", "device", "port", "seq")

    id: Mapped[int] = mapped_column(sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(sa.String(200))
    device: Mapped[str] = mapped_column(sa.String(100))
    port: Mapped[int]
    seq: Mapped[int] = mapped_column(sa.BigInteger)
    time: Mapped[float]
    state: Mapped[str | None] = mapped_column(sa.String(32))
    counters: Mapped[dict[str, Any] | None]
    saturated: Mapped[list[Any] | None]
    received_at: Mapped[float]
    content_hash: Mapped[str] = mapped_column(sa.String(32))


class CheckpointEvent(Base):
    """A committed checkpoint, as the trainer reported it. Key: (run, path, step, manifest
    digest): a path saved again with other content is another row, its newer version."""

    __tablename__ = "checkpoint_events"
    __table_args__ = (sa.UniqueConstraint("run_id", "path", "step", "manifest_digest"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    incarnation: Mapped[str] = mapped_column(sa.String(64))
    rank: Mapped[int]
    step: Mapped[int]
    consumed: Mapped[int | None] = mapped_column(sa.BigInteger)
    path: Mapped[str] = mapped_column(sa.String(1000))
    manifest: Mapped[dict[str, Any] | None]
    tags: Mapped[list[Any] | None]
    metrics: Mapped[dict[str, Any] | None]
    node: Mapped[str | None] = mapped_column(sa.String(200))
    manifest_digest: Mapped[str] = mapped_column(sa.String(64))
    time: Mapped[float]
    received_at: Mapped[float]
    content_hash: Mapped[str] = mapped_column(sa.String(32))


class ResumeEvent(Base):
    """What a restart restored, per rank. Key: (run, incarnation, rank)."""

    __tablename__ = "resume_events"
    __table_args__ = (sa.UniqueConstraint("run_id", "incarnation", "rank"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    incarnation: Mapped[str] = mapped_column(sa.String(64))
    rank: Mapped[int]
    checkpoint_path: Mapped[str | None] = mapped_column(sa.String(1000))
    checkpoint_step: Mapped[int | None]
    restored: Mapped[dict[str, Any]]
    time: Mapped[float]
    received_at: Mapped[float]
    content_hash: Mapped[str] = mapped_column(sa.String(32))


class Incident(Base):
    __tablename__ = "incidents"
    __table_args__ = (sa.Index("ix_incidents_run_status", "run_id", "status"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(sa.String(64))
    severity: Mapped[str] = mapped_column(sa.String(16))
    status: Mapped[str] = mapped_column(sa.String(16))
    first_step: Mapped[int]
    last_step: Mapped[int]
    incarnation: Mapped[str] = mapped_column(sa.String(64))
    summary: Mapped[str] = mapped_column(sa.Text)
    ranks: Mapped[list[Any]]
    nodes: Mapped[list[Any]]
    devices: Mapped[list[Any]]
    finding_count: Mapped[int]
    # The newest step the engine had judged when it opened this incident (detection delay).
    detected_step: Mapped[int | None]
    # The device, port or rank of a per-thing incident (see policies.incidents.SCOPED_KINDS).
    scope: Mapped[str | None] = mapped_column(sa.String(200))
    opened_at: Mapped[float]
    updated_at: Mapped[float]
    closed_at: Mapped[float | None]


class FindingRow(Base):
    __tablename__ = "findings"
    __table_args__ = (sa.Index("ix_findings_run_step", "run_id", "step"),)

    id: Mapped[int] = mapped_column(sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    incident_id: Mapped[int | None] = mapped_column(
        sa.ForeignKey("incidents.id", ondelete="SET NULL"), index=True
    )
    incarnation: Mapped[str] = mapped_column(sa.String(64))
    attempt: Mapped[int | None]
    step: Mapped[int]
    rank: Mapped[int | None]
    kind: Mapped[str] = mapped_column(sa.String(64))
    severity: Mapped[str] = mapped_column(sa.String(16))
    signal: Mapped[str] = mapped_column(sa.String(64))
    value: Mapped[float | None]
    threshold: Mapped[float | None]
    message: Mapped[str] = mapped_column(sa.Text)
    evidence: Mapped[dict[str, Any] | None]
    created_at: Mapped[float]
    node: Mapped[str | None] = mapped_column(sa.String(200))
    device: Mapped[str | None] = mapped_column(sa.String(100))


class Directive(Base):
    """An instruction to a run's hooks: dump stacks now, or (later) act at a named step."""

    __tablename__ = "directives"
    __table_args__ = (
        sa.Index("ix_directives_run_status", "run_id", "status"),
        status_check(DirectiveStatus),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(sa.String(32))
    incarnation: Mapped[str | None] = mapped_column(sa.String(64))
    ranks: Mapped[list[Any] | None]
    act_at_step: Mapped[int | None]
    payload: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(sa.String(16))
    incident_id: Mapped[int | None] = mapped_column(sa.ForeignKey("incidents.id", ondelete="SET NULL"))
    created_by: Mapped[str] = mapped_column(sa.String(200))
    created_at: Mapped[float]


class DirectiveAck(Base):
    """A rank's acknowledgement of a directive. Key: (directive, incarnation, rank)."""

    __tablename__ = "directive_acks"
    __table_args__ = (
        sa.UniqueConstraint("run_id", "directive_id", "incarnation", "rank"),
        status_check(AckStatus),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    directive_id: Mapped[int] = mapped_column(sa.ForeignKey("directives.id", ondelete="CASCADE"))
    incarnation: Mapped[str] = mapped_column(sa.String(64))
    rank: Mapped[int]
    status: Mapped[str] = mapped_column(sa.String(16))
    step: Mapped[int | None]
    detail: Mapped[dict[str, Any] | None]
    time: Mapped[float]
    received_at: Mapped[float]
    content_hash: Mapped[str] = mapped_column(sa.String(32))


class StackDump(Base):
    """All Python thread stacks of one rank (and the NCCL flight recorder when enabled).

    Key: (run, incarnation, rank, time).
    """

    __tablename__ = "stack_dumps"
    __table_args__ = (sa.UniqueConstraint("run_id", "incarnation", "rank", "time"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    incarnation: Mapped[str] = mapped_column(sa.String(64))
    rank: Mapped[int]
    directive_id: Mapped[int | None]
    time: Mapped[float]
    stacks: Mapped[str] = mapped_column(sa.Text)
    flight_recorder: Mapped[str | None] = mapped_column(sa.Text)
    received_at: Mapped[float]
    content_hash: Mapped[str] = mapped_column(sa.String(32))


class Operator(Base):
    """A person who may approve or reject proposals; the audit log records this identity."""

    __tablename__ = "operators"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(200), unique=True)
    token_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    created_at: Mapped[float]
    revoked_at: Mapped[float | None]


class CheckpointValidation(Base):
    """The registry's latest re-check of a checkpoint's manifest against its files, with the
    files' sizes and modification times as it found them (``files_seen``: a change to either
    makes the result stale)."""

    __tablename__ = "checkpoint_validations"

    checkpoint_id: Mapped[int] = mapped_column(
        sa.ForeignKey("checkpoint_events.id", ondelete="CASCADE"), primary_key=True
    )
    valid: Mapped[bool]
    problems: Mapped[list[Any]]
    checked_at: Mapped[float]
    files_seen: Mapped[dict[str, Any] | None]


class Proposal(Base):
    """A proposed recovery for an incident, and what became of it."""

    __tablename__ = "proposals"
    __table_args__ = (
        sa.Index("ix_proposals_run_status", "run_id", "status"),
        status_check(ProposalStatus),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    incident_id: Mapped[int] = mapped_column(sa.ForeignKey("incidents.id", ondelete="CASCADE"), index=True)
    action: Mapped[str] = mapped_column(sa.String(16))
    status: Mapped[str] = mapped_column(sa.String(16))
    checkpoint_id: Mapped[int | None] = mapped_column(
        sa.ForeignKey("checkpoint_events.id", ondelete="SET NULL")
    )
    target_step: Mapped[int | None]
    target_path: Mapped[str | None] = mapped_column(sa.String(1000))
    data_action: Mapped[str] = mapped_column(sa.String(16))
    skip_batches: Mapped[list[Any]]
    quarantine_node: Mapped[str | None] = mapped_column(sa.String(200))
    quarantine_device: Mapped[str | None] = mapped_column(sa.String(100))
    verdict: Mapped[str] = mapped_column(sa.String(16))
    cost_steps: Mapped[int | None]
    evidence: Mapped[dict[str, Any]]
    created_at: Mapped[float]
    decided_by: Mapped[str | None] = mapped_column(sa.String(200))
    decided_at: Mapped[float | None]
    decision_reason: Mapped[str | None] = mapped_column(sa.Text)
    directive_id: Mapped[int | None] = mapped_column(sa.ForeignKey("directives.id", ondelete="SET NULL"))


class Replay(Base):
    """A replay job for an incident and the evidence it produced."""

    __tablename__ = "replays"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    incident_id: Mapped[int] = mapped_column(sa.ForeignKey("incidents.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(sa.String(16))
    command: Mapped[str] = mapped_column(sa.Text)
    spec: Mapped[dict[str, Any]]
    evidence: Mapped[dict[str, Any] | None]
    verdict: Mapped[str | None] = mapped_column(sa.String(16))
    started_at: Mapped[float]
    finished_at: Mapped[float | None]
    output: Mapped[str | None] = mapped_column(sa.Text)


class Action(Base):
    """A quarantine carried out (or dry-run) through a configured webhook or command."""

    __tablename__ = "actions"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    proposal_id: Mapped[int | None] = mapped_column(sa.ForeignKey("proposals.id", ondelete="SET NULL"))
    kind: Mapped[str] = mapped_column(sa.String(32))
    target: Mapped[str] = mapped_column(sa.String(300))
    mode: Mapped[str] = mapped_column(sa.String(16))
    request: Mapped[str] = mapped_column(sa.Text)
    status: Mapped[str] = mapped_column(sa.String(16))
    result: Mapped[dict[str, Any]]
    time: Mapped[float]


class AuditEntry(Base):
    """Append-only, hash-chained: each entry holds the hash of the previous one, and is keyed.

    ``prev_hash`` is unique, so two writers that read the same tail cannot both append to
    it: one insert fails and retries on the new tail, and the chain never forks.
    """

    __tablename__ = "audit_log"

    seq: Mapped[int] = mapped_column(primary_key=True)
    time: Mapped[float]
    actor: Mapped[str] = mapped_column(sa.String(200))
    action: Mapped[str] = mapped_column(sa.String(64))
    subject: Mapped[str] = mapped_column(sa.String(200))
    run_id: Mapped[int | None]
    incident_id: Mapped[int | None] = mapped_column(index=True)
    reason: Mapped[str | None] = mapped_column(sa.Text)
    details: Mapped[dict[str, Any]]
    prev_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    hash: Mapped[str] = mapped_column(sa.String(64))
    # HMAC-SHA-256 of ``hash`` under the audit key named by ``key_id`` (``monitor.store.audit_keys``);
    # null for an entry written without a key (before revision 0009, or by a bare engine).
    key_id: Mapped[str | None] = mapped_column(sa.String(16))
    mac: Mapped[str | None] = mapped_column(sa.String(64))


class CanaryResult(Base):
    """One device's canary run at one step. Key: (run, incarnation, rank, step)."""

    __tablename__ = "canary_results"
    __table_args__ = (
        sa.UniqueConstraint("run_id", "incarnation", "rank", "step"),
        sa.Index("ix_canary_results_run_judged", "run_id", "judged"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    incarnation: Mapped[str] = mapped_column(sa.String(64))
    rank: Mapped[int]
    step: Mapped[int]
    directive_id: Mapped[int | None]
    node: Mapped[str | None] = mapped_column(sa.String(200))
    device_uuid: Mapped[str | None] = mapped_column(sa.String(100))
    stack_key: Mapped[str] = mapped_column(sa.String(64))
    stack: Mapped[dict[str, Any]]
    kernels: Mapped[dict[str, Any]]
    rerun: Mapped[dict[str, Any] | None]
    seconds: Mapped[float]
    over_budget: Mapped[bool]
    time: Mapped[float]
    received_at: Mapped[float]
    content_hash: Mapped[str] = mapped_column(sa.String(32))
    judged: Mapped[bool] = mapped_column(default=False)
    verdict: Mapped[str | None] = mapped_column(sa.String(16))


class CanaryGolden(Base):
    """A stack's agreed fingerprint of one kernel, once a quorum of devices matched it."""

    __tablename__ = "canary_golden"

    stack_key: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    kernel: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(sa.String(64))
    summary: Mapped[list[Any]]
    deterministic: Mapped[bool]
    established_at: Mapped[float]
    established_step: Mapped[int]
    run_id: Mapped[int | None]


class CanarySchedule(Base):
    """A run's canary schedule: kept here, so it survives a service restart."""

    __tablename__ = "canary_schedules"

    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    enabled: Mapped[bool]
    interval_s: Mapped[float | None]
    """Fixed interval; ``None``: as often as the budget allows (policies.canary)."""
    budget_fraction: Mapped[float]
    last_issued_at: Mapped[float | None]
    created_at: Mapped[float]


class DrillReport(Base):
    """One restart drill of a trainer (``runhealth drill``): its checks and verdict.

    ``run`` is a run's name, not a key: a drill rehearses the restart before the long run,
    usually before that run exists in the store."""

    __tablename__ = "drill_reports"

    id: Mapped[int] = mapped_column(primary_key=True)
    run: Mapped[str] = mapped_column(sa.String(200), index=True)
    drill: Mapped[str] = mapped_column(sa.String(32))
    verdict: Mapped[str] = mapped_column(sa.String(16))
    checks: Mapped[list[Any]]
    command: Mapped[str] = mapped_column(sa.Text)
    settings: Mapped[dict[str, Any]]
    workdir: Mapped[str] = mapped_column(sa.Text)
    started_at: Mapped[float]
    finished_at: Mapped[float]
    created_by: Mapped[str] = mapped_column(sa.String(200))


def table_of(model: type[Base]) -> sa.Table:
    """A model's Core table, typed as one (``__table__`` is typed as a generic FromClause)."""
    table = model.__table__
    assert isinstance(table, sa.Table)
    return table
