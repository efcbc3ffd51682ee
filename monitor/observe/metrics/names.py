"""Every series ``/metrics`` writes: name, type, labels and help, in one table.

The dashboards are generated from these constants and the alert rules are tested against them,
so a renamed metric cannot leave a panel or a rule silently empty. Names follow the Prometheus
conventions: the ``runhealth_`` prefix, base units in the name (``_seconds``, ``_ratio``), and
``_total`` on counters. Moments are exported as Unix timestamps (``_timestamp_seconds``), not
ages, as the Prometheus instrumentation guide asks: ``time() - x`` is the age, and it stays right
between scrapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Metric:
    name: str
    type: Literal["gauge", "counter"]
    labels: tuple[str, ...]
    help: str

    def __post_init__(self) -> None:
        if not self.name.startswith("runhealth_"):
            raise ValueError(f"{self.name}: every runhealth metric starts with runhealth_")
        if (self.type == "counter") != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters, and only counters, end in _total")


RUN = ("run",)
DEVICE = ("run", "node", "device")
PORT = ("run", "node", "hca", "port")

# --- per run ---------------------------------------------------------------------------------------

RUN_STEP = Metric(
    "runhealth_run_step", "gauge", RUN, "Step (successful optimizer updates) of the newest window."
)
RUN_LOSS = Metric(
    "runhealth_run_loss",
    "gauge",
    RUN,
    "Token-weighted loss (loss_sum / tokens over every rank) of the newest judged window.",
)
RUN_TOKENS_PER_SECOND = Metric(
    "runhealth_run_tokens_per_second",
    "gauge",
    RUN,
    "Supervised tokens per second over the newest judged windows of the current incarnation.",
)
RUN_GRAD_NORM = Metric(
    "runhealth_run_grad_norm", "gauge", RUN, "Gradient norm before clipping, newest judged window."
)
RUN_LEARNING_RATE = Metric(
    "runhealth_run_learning_rate", "gauge", RUN, "Learning rate, newest judged window."
)
RUN_LOSS_SCALE = Metric(
    "runhealth_run_loss_scale", "gauge", RUN, "Smallest AMP loss scale on any rank, newest judged window."
)
RUN_SKIPPED_UPDATES = Metric(
    "runhealth_run_skipped_updates_total",
    "counter",
    RUN,
    "Windows attempted without an optimizer update (AMP skips) in the current incarnation.",
)
RUN_RANKS = Metric(
    "runhealth_run_ranks", "gauge", RUN, "World size of the current incarnation (declared, else seen)."
)
RUN_RANKS_HEARTBEATING = Metric(
    "runhealth_run_ranks_heartbeating",
    "gauge",
    RUN,
    "Ranks of the current incarnation whose newest heartbeat is within the hang policy's silence limit.",
)
RUN_LAST_HEARTBEAT = Metric(
    "runhealth_run_last_heartbeat_timestamp_seconds",
    "gauge",
    RUN,
    "When the service last received a heartbeat of the current incarnation (any rank).",
)
RUN_OLDEST_HEARTBEAT = Metric(
    "runhealth_run_oldest_heartbeat_timestamp_seconds",
    "gauge",
    RUN,
    "The least recent of the ranks' newest heartbeats: time() minus this is the worst rank's silence.",
)
RUN_LAST_RECORD = Metric(
    "runhealth_run_last_record_timestamp_seconds",
    "gauge",
    RUN,
    "Newest record of the run: its newest window's time, heartbeat or run start.",
)
RUN_FINISHED = Metric(
    "runhealth_run_finished", "gauge", RUN, "1 when the current incarnation sent its finish record, else 0."
)
RUN_LAST_CHECKPOINT = Metric(
    "runhealth_run_last_checkpoint_timestamp_seconds",
    "gauge",
    RUN,
    "Time of the newest resumable checkpoint (one reported with its manifest).",
)
RUN_LAST_CHECKPOINT_STEP = Metric(
    "runhealth_run_last_checkpoint_step", "gauge", RUN, "Step of the newest resumable checkpoint."
)
PREEMPTION_SLACK = Metric(
    "runhealth_preemption_slack_seconds",
    "gauge",
    RUN,
    "Preemption budget slack: the configured warning minus (p99 window + longest recent save + "
    "margin), after the newest measured save; negative when a save cannot finish within the notice.",
)

# --- ingest (the service's own counters: they restart from 0 with the service) ----------------------

RECORDS_INGESTED = Metric(
    "runhealth_records_ingested_total", "counter", RUN, "Records stored (duplicates excluded)."
)
RECORDS_DUPLICATE = Metric(
    "runhealth_records_duplicate_total", "counter", RUN, "Records re-sent with a stored key and content."
)
RECORDS_LATE = Metric(
    "runhealth_records_late_total",
    "counter",
    RUN,
    "Step records that arrived after their window was judged (replayed from a spool).",
)
RECORDS_REJECTED = Metric(
    "runhealth_records_rejected_total", "counter", RUN, "Batches refused (invalid, conflicting or too large)."
)
BATCHES_GROUPED = Metric(
    "runhealth_ingest_grouped_batches_total",
    "counter",
    RUN,
    "Batches written in one transaction with others of their run that waited for the store beside "
    "them (group commit, on a replica).",
)
JUDGE_ERRORS = Metric(
    "runhealth_judge_errors_total", "counter", RUN, "Batches stored but not judged because judging failed."
)
# Service-wide: batches are shed before their run's token is checked (monitor.ingest.admission).
INGEST_SHED = Metric(
    "runhealth_ingest_shed_batches_total",
    "counter",
    (),
    "Batches answered 429 because the service had its bound of batches in flight (the hooks keep "
    "and resend them).",
)
INGEST_IN_FLIGHT = Metric(
    "runhealth_ingest_batches_in_flight",
    "gauge",
    (),
    "Batches being read, validated, written or judged now (shed past ingest.shedding.max_in_flight_batches).",
)

# --- incidents and decisions -----------------------------------------------------------------------

INCIDENTS_OPEN = Metric(
    "runhealth_incidents_open", "gauge", ("run", "kind", "severity"), "Open incidents by kind and severity."
)
INCIDENT_OPENED = Metric(
    "runhealth_incident_opened_timestamp_seconds",
    "gauge",
    ("run", "incident", "kind", "severity", "scope"),
    "When each open incident was opened (the newest open ones per run; scope: its device, port or rank).",
)
PROPOSALS_PENDING = Metric(
    "runhealth_proposals_pending", "gauge", RUN, "Recovery proposals waiting for an operator's decision."
)

# --- devices, links, stragglers, canaries -----------------------------------------------------------

DEVICE_CLOCK_EVENT = Metric(
    "runhealth_device_clock_event_seconds_total",
    "counter",
    (*DEVICE, "reason"),
    "Time the device's clocks were held down, by reason (NVML clock-event counters).",
)
DEVICE_ECC_ERRORS = Metric(
    "runhealth_device_ecc_errors_total",
    "counter",
    (*DEVICE, "type"),
    "Volatile ECC errors (since the driver loaded): corrected or uncorrected.",
)
DEVICE_NVLINK_ERRORS = Metric(
    "runhealth_device_nvlink_errors_total",
    "counter",
    (*DEVICE, "type"),
    "NVLink errors summed over the device's links: replay, recovery, crc_flit, crc_data.",
)
DEVICE_PCIE_REPLAYS = Metric(
    "runhealth_device_pcie_replays_total", "counter", DEVICE, "PCIe replays of the device."
)
DEVICE_ROW_REMAP_PENDING = Metric(
    "runhealth_device_row_remap_pending",
    "gauge",
    DEVICE,
    "Devices with a row remap waiting for a GPU reset (an uncorrectable error's row still in use): "
    "1 or 0 per device, a count where the series are per node.",
)
LINK_ERRORS = Metric(
    "runhealth_link_errors_total",
    "counter",
    (*PORT, "counter"),
    "InfiniBand/RoCE port error counters: symbol_error, link_downed, link_error_recovery, port_rcv_errors.",
)
LINK_ACTIVE = Metric(
    "runhealth_link_active",
    "gauge",
    PORT,
    "Ports whose state is ACTIVE: 1 or 0 per port, a count where the series are per node.",
)
STRAGGLER_SLOWDOWN = Metric(
    "runhealth_straggler_slowdown_ratio",
    "gauge",
    ("run", "rank", "node", "phase"),
    "The slowest ranks only (top k): smoothed time of the rank's worst phase over its peers' median.",
)
CANARY_RANKS = Metric(
    "runhealth_canary_ranks",
    "gauge",
    ("run", "result"),
    "Ranks (devices) by their newest canary verdict: match, mismatch, rerun (a miss being re-run) "
    "or unchecked (no canary yet).",
)
CANARY_MISMATCH = Metric(
    "runhealth_canary_mismatch_timestamp_seconds",
    "gauge",
    DEVICE,
    "Devices whose newest canary missed their stack's reference (only those): when it ran.",
)

# The series of the service itself, not of a run: no run label.
SERVICE_WIDE: tuple[Metric, ...] = (INGEST_SHED, INGEST_IN_FLIGHT)

# --- goodput and checkpoint interval advice (monitor.judge.goodput) ---------------------------------
RUN_GOODPUT = Metric(
    "runhealth_run_goodput_ratio",
    "gauge",
    RUN,
    "Productive training time over the run's wall time, across its incarnations (runhealth goodput RUN).",
)
RUN_BADPUT = Metric(
    "runhealth_run_badput_seconds",
    "gauge",
    (*RUN, "cause"),
    "Wall time not spent training productively, by cause (policies.goodput.Cause: startup_restore, "
    "checkpoint_save, redone_rollback, redone_restart, hung_before_detection, canary, data_wait, hold, "
    "down, other); a cause that was not measured has no series.",
)
RUN_CHECKPOINT_INTERVAL = Metric(
    "runhealth_run_checkpoint_interval_seconds",
    "gauge",
    RUN,
    "Compute between two checkpoint saves today: the median time between saves less the save cost.",
)
RUN_CHECKPOINT_INTERVAL_ADVISED = Metric(
    "runhealth_run_checkpoint_interval_advised_seconds",
    "gauge",
    RUN,
    "Young/Daly's checkpoint interval sqrt(2 x save cost x mean time between interruptions).",
)

ALL: tuple[Metric, ...] = tuple(value for value in list(globals().values()) if isinstance(value, Metric))
BY_NAME = {metric.name: metric for metric in ALL}
