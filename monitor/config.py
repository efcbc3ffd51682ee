"""The service's configuration: one frozen dataclass per component, composed here.

Read once, from an injected environment mapping and an optional TOML file, by
``monitor.settings.service_config``; every field of every nested config is a setting."""

from __future__ import annotations

from dataclasses import dataclass, field

from monitor.errors import ConfigError as ConfigError  # where callers have always found it
from monitor.garbage import GarbageConfig
from monitor.ingest.admission import SheddingConfig
from monitor.ingest.postgres_copy import INLINE_ROWS
from monitor.judge.config import CanaryServiceConfig, EngineConfig
from monitor.observe.metrics.config import MetricsConfig
from monitor.recovery.config import DecisionConfig
from monitor.store.retention import RetentionConfig
from policies.devices import DevicesConfig
from policies.drills import DrillConfig


@dataclass(frozen=True)
class IngestConfig:
    """Limits of one ingest batch.

    32 MiB and 50,000 records: a 16,384-rank run's step records for one step fit in one
    batch (about 600 bytes each), while one client cannot make the service buffer gigabytes.

    ``copy_on_postgresql``: on PostgreSQL (psycopg2), write step records, device and link
    samples and heartbeats with ``COPY`` through a staging table instead of a multi-row
    ``INSERT``: the same answers at a fraction of the service's CPU per record
    (``benchmarks/ingest.py --postgres`` measures both paths side by side). Off only to
    compare the two, or behind a proxy that cannot pass ``COPY``.

    ``inline_rows``: with ``copy_on_postgresql``, a kind's rows in a batch up to this many go in
    as arrays inside the one statement that moves them, not by ``COPY``: the hook's one rank a
    post sends a few records a post, and for so few the staging table's three round trips cost
    more than they save (the default's measurement: ``monitor.ingest.postgres_copy.INLINE_ROWS``).
    0 sends every batch by ``COPY``.

    ``group_commit``: on a replica (``runhealth serve`` over PostgreSQL), batches of step
    records, heartbeats and device and link samples that wait for the store while another is
    written are written together, each run's in one transaction, each batch with its own
    answer (``monitor.ingest.group_commit``). Off only to compare.
    """

    max_batch_bytes: int = 32 * 1024 * 1024
    max_batch_records: int = 50_000
    # When batches are refused with 429 (load shedding): ``monitor.ingest.admission``.
    shedding: SheddingConfig = field(default_factory=SheddingConfig)
    copy_on_postgresql: bool = True
    inline_rows: int = INLINE_ROWS
    group_commit: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_bytes < 1024 or self.max_batch_records < 1:
            raise ConfigError("IngestConfig: max_batch_bytes >= 1024 and max_batch_records >= 1")
        if self.inline_rows < 0:
            raise ConfigError(f"ingest.inline_rows must be >= 0, got {self.inline_rows}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Periods of the service's scheduled jobs (``monitor.scheduler``).

    - ``hang_check_s`` 5: the hook's heartbeat interval, so a hang is seen within one
      heartbeat of its timeout; windows that nothing newer will release are judged as often.
    - ``peer_compare_s`` 300: error rates over five minutes; a single error in one 10 s
      sample interval is not a burst.
    - ``canary_s`` 30: how often due canary schedules are issued and rounds that lost a rank
      are judged; the schedules' own intervals (minutes to hours) are kept in the store.
    """

    hang_check_s: float = 5.0
    peer_compare_s: float = 300.0
    canary_s: float = 30.0

    def __post_init__(self) -> None:
        if self.hang_check_s <= 0 or self.peer_compare_s <= 0 or self.canary_s <= 0:
            raise ValueError("SchedulerConfig: periods must be positive")


@dataclass(frozen=True)
class ReplicaConfig:
    """Several ``runhealth serve`` over one PostgreSQL, one judging each run (``monitor.replicas``).

    - ``poll_s`` 0.5: how often a run's judge reads the records other replicas stored for it;
      half a second of the 2 s from a faulty record to its incident (issue 18's target), the
      rest left to the window's readiness watermark.
    - ``lease_s`` 1.0: how often a replica looks for runs nobody judges (their judge died) and
      shares runs out; with PostgreSQL freeing a dead replica's leases at once, the run is judged
      again within about this long (the 10 s target leaves room for a loaded machine).
    - ``dead_peer_s`` 8.0: TCP keepalives and PostgreSQL's ``idle_session_timeout`` on each lease
      session, so a replica whose host vanished, or that stopped looking at its leases (stopped,
      hung, or one judging pass longer than this), loses its leases within this long (inside the
      10 s target; measured 8.1 s for a SIGSTOPped replica).
    - ``replica_id``: this replica's name in ``/healthz`` and in PostgreSQL's session list;
      empty means ``<hostname>:<pid>``.
    - ``gather_s`` 0.1: woken by a batch, the judge waits this long before it looks, and takes
      in one look what arrived meanwhile. The hook's ranks post one small batch each (1,024
      ranks every 2 s: 512 batches a second), and a look costs its reads and passes whatever it
      finds, so a look per batch spent the service's CPU on looks, not records; at most ten
      looks a second add at most 0.1 s of the 2 s from a faulty record to its incident.
    """

    poll_s: float = 0.5
    lease_s: float = 1.0
    dead_peer_s: float = 8.0
    replica_id: str = ""
    gather_s: float = 0.1

    def __post_init__(self) -> None:
        if self.poll_s <= 0 or self.lease_s <= 0 or self.dead_peer_s < 2:
            raise ConfigError("ReplicaConfig: poll_s and lease_s > 0, dead_peer_s >= 2")
        if self.gather_s < 0:
            raise ConfigError(f"ReplicaConfig: gather_s >= 0, got {self.gather_s}")


@dataclass(frozen=True)
class ServiceConfig:
    db: str | None = None
    admin_token: str | None = None
    ingest: IngestConfig = field(default_factory=IngestConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    decisions: DecisionConfig = field(default_factory=DecisionConfig)
    canaries: CanaryServiceConfig = field(default_factory=CanaryServiceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    replicas: ReplicaConfig = field(default_factory=ReplicaConfig)
    # The serving process's garbage collector thresholds (``monitor.garbage``).
    garbage: GarbageConfig = field(default_factory=GarbageConfig)
    # `runhealth drill`'s tolerances and budgets (not the service's: read by the CLI that runs it)
    drills: DrillConfig = field(default_factory=DrillConfig)
