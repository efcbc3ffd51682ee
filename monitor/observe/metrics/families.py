"""Metric families from one scrape's snapshot: plain data in, prometheus-client families out.

Nothing here reads the store or the service: ``exporter.RunHealthCollector`` gathers the
snapshot, and these functions only shape it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric as Family

from monitor.observe.metrics import names
from monitor.observe.metrics.reads import OpenIncident, RunState
from monitor.observe.metrics.sources import CanaryVerdict
from policies.devices import DeviceReading, LinkReading
from policies.preemption import Budget
from policies.stragglers import StragglerScore

# The service's ingest counters (``Service.count``) by the metric that exports each.
INGEST_COUNTERS = (
    (names.RECORDS_INGESTED, "accepted"),
    (names.RECORDS_DUPLICATE, "duplicates"),
    (names.RECORDS_LATE, "late"),
    (names.RECORDS_REJECTED, "rejected"),
    (names.BATCHES_GROUPED, "grouped_batches"),
    (names.JUDGE_ERRORS, "judge_errors"),
)
NVLINK_TYPES = ("replay", "recovery", "crc_flit", "crc_data")
ECC_TYPES = ("corrected", "uncorrected")
# The port counters that count errors (monitor.judge.fleet compares the same ones between nodes).
LINK_ERROR_COUNTERS = ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors")
NS_PER_S = 1e9


def family(metric: names.Metric) -> GaugeMetricFamily | CounterMetricFamily:
    kind = GaugeMetricFamily if metric.type == "gauge" else CounterMetricFamily
    return kind(metric.name, metric.help, labels=list(metric.labels))


def run_families(runs: Sequence[RunState]) -> Iterator[Family]:
    """One series per run for each value the run has reported."""
    fields: tuple[tuple[names.Metric, str], ...] = (
        (names.RUN_STEP, "step"),
        (names.RUN_LOSS, "loss"),
        (names.RUN_TOKENS_PER_SECOND, "tokens_per_second"),
        (names.RUN_GRAD_NORM, "grad_norm"),
        (names.RUN_LEARNING_RATE, "lr"),
        (names.RUN_LOSS_SCALE, "loss_scale"),
        (names.RUN_SKIPPED_UPDATES, "skipped_updates"),
        (names.RUN_RANKS, "ranks"),
        (names.RUN_RANKS_HEARTBEATING, "ranks_heartbeating"),
        (names.RUN_LAST_HEARTBEAT, "last_heartbeat"),
        (names.RUN_OLDEST_HEARTBEAT, "oldest_heartbeat"),
        (names.RUN_LAST_RECORD, "last_record"),
        (names.RUN_FINISHED, "finished"),
        (names.RUN_LAST_CHECKPOINT, "checkpoint_time"),
        (names.RUN_LAST_CHECKPOINT_STEP, "checkpoint_step"),
    )
    for metric, field in fields:
        built = family(metric)
        for run in runs:
            value = getattr(run, field)
            if value is not None:
                built.add_metric([run.name], float(value))
        yield built


def preemption_family(runs: Sequence[RunState], budgets: Mapping[int, Budget]) -> Iterator[Family]:
    """Each run's preemption slack, for the runs whose budget the service has judged."""
    built = family(names.PREEMPTION_SLACK)
    for run in runs:
        budget = budgets.get(run.id)
        if budget is not None:
            built.add_metric([run.name], budget.slack_s)
    yield built


def ingest_families(runs: Sequence[RunState], counters: Mapping[tuple[str, str], int]) -> Iterator[Family]:
    """The service's own counts. Every exported run gets every counter, 0 included, so that
    ``increase()`` sees the first record after a quiet start."""
    for metric, what in INGEST_COUNTERS:
        built = family(metric)
        for run in runs:
            built.add_metric([run.name], float(counters.get((run.name, what), 0)))
        yield built


def admission_families(in_flight: int, shed: int) -> Iterator[Family]:
    """The service's own ingest load: batches in flight now, and shed since it started
    (``monitor.ingest.admission``)."""
    shed_family = family(names.INGEST_SHED)
    shed_family.add_metric([], float(shed))
    in_flight_family = family(names.INGEST_IN_FLIGHT)
    in_flight_family.add_metric([], float(in_flight))
    yield from (shed_family, in_flight_family)


def incident_families(
    runs: Sequence[RunState],
    incidents: Sequence[OpenIncident],
    proposals: Mapping[int, int],
    per_run: int,
) -> Iterator[Family]:
    """Open incidents counted by kind and severity, the newest ``per_run`` of each run one by
    one, and the proposals waiting for a decision (0 for a run with none)."""
    name_of = {run.id: run.name for run in runs}
    counts: Counter[tuple[str, str, str]] = Counter()
    opened = family(names.INCIDENT_OPENED)
    shown: Counter[int] = Counter()
    for incident in incidents:  # newest first
        run = name_of.get(incident.run_id)
        if run is None:
            continue
        counts[(run, incident.kind, incident.severity)] += 1
        if shown[incident.run_id] < per_run:
            shown[incident.run_id] += 1
            labels = [run, str(incident.id), incident.kind, incident.severity, incident.scope or ""]
            opened.add_metric(labels, incident.opened_at)
    open_now = family(names.INCIDENTS_OPEN)
    for (run_name, kind, severity), count in sorted(counts.items()):
        open_now.add_metric([run_name, kind, severity], float(count))
    pending = family(names.PROPOSALS_PENDING)
    for run_state in runs:
        pending.add_metric([run_state.name], float(proposals.get(run_state.id, 0)))
    yield from (open_now, opened, pending)


def device_families(devices: Iterable[tuple[str, DeviceReading]], per_node: Set[str]) -> Iterator[Family]:
    """Each device's cumulative counters from its newest reading, or for the runs in ``per_node``
    their sums over each node's devices (no device label; the remap gauge then counts devices). A
    counter the device does not offer (NVML said not supported) is absent, never a 0 that would
    read as healthy."""
    totals: dict[tuple[str, str, str], dict[tuple[str, str], int]] = {}
    remaps: dict[tuple[str, str, str], int] = {}
    kinds: dict[str, tuple[str, str] | None] = {}  # counter name -> (family, label), per scrape
    for run, reading in devices:
        where = (run, reading.node, "" if run in per_node else reading.device)
        sums = totals.setdefault(where, {})
        for name, value in reading.counters.items():
            kind = kinds[name] if name in kinds else kinds.setdefault(name, _device_counter(name))
            if kind is not None:
                sums[kind] = sums.get(kind, 0) + value
        if reading.remap_pending is not None:
            remaps[where] = remaps.get(where, 0) + int(reading.remap_pending)
    built = {
        "clock": family(names.DEVICE_CLOCK_EVENT),
        "ecc": family(names.DEVICE_ECC_ERRORS),
        "nvlink": family(names.DEVICE_NVLINK_ERRORS),
        "pcie": family(names.DEVICE_PCIE_REPLAYS),
    }
    for where, sums in totals.items():
        for (group, label), value in sums.items():
            if group == "clock":
                built[group].add_metric([*where, label], value / NS_PER_S)
            else:
                built[group].add_metric([*where, label] if label else list(where), float(value))
    remap = family(names.DEVICE_ROW_REMAP_PENDING)
    for where, count in remaps.items():
        remap.add_metric(list(where), float(count))
    yield from (*built.values(), remap)


def _device_counter(name: str) -> tuple[str, str] | None:
    """The family and label a device counter adds to: clock-event time by reason, volatile ECC
    errors by type, NVLink errors by type summed over links, PCIe replays; None for the rest."""
    parts = name.split(".")
    if parts[0] == "clock_event_ns" and len(parts) == 2:
        return ("clock", parts[1])
    if parts[:2] == ["ecc", "volatile"] and len(parts) == 3 and parts[2] in ECC_TYPES:
        return ("ecc", parts[2])
    if parts[0] == "nvlink" and len(parts) == 3 and parts[2] in NVLINK_TYPES:
        return ("nvlink", parts[2])
    return ("pcie", "") if name == "pcie_replay" else None


def link_families(
    links: Iterable[tuple[str, LinkReading]], active_states: frozenset[str], per_node: Set[str]
) -> Iterator[Family]:
    """Each port's error counters and state, or for the runs in ``per_node`` their sums over each
    node's ports (no hca and port labels; ``runhealth_link_active`` then counts active ports)."""
    errors: dict[tuple[str, str, str, str], dict[str, int]] = {}
    active: dict[tuple[str, str, str, str], int] = {}
    for run, reading in links:
        each = run not in per_node
        where = (run, reading.node, reading.device if each else "", str(reading.port) if each else "")
        sums = errors.setdefault(where, {})
        for counter in LINK_ERROR_COUNTERS:
            if counter in reading.counters:
                sums[counter] = sums.get(counter, 0) + reading.counters[counter]
        if reading.state is not None:
            active[where] = active.get(where, 0) + (reading.state in active_states)
    error_family, active_family = family(names.LINK_ERRORS), family(names.LINK_ACTIVE)
    for where, sums in errors.items():
        for counter, value in sums.items():
            error_family.add_metric([*where, counter], float(value))
    for where, count in active.items():
        active_family.add_metric(list(where), float(count))
    yield from (error_family, active_family)


@dataclass(frozen=True)
class RankedStraggler:
    run: str
    node: str
    score: StragglerScore


def straggler_family(stragglers: Iterable[RankedStraggler]) -> Iterator[Family]:
    built = family(names.STRAGGLER_SLOWDOWN)
    for item in stragglers:
        built.add_metric([item.run, str(item.score.rank), item.node, item.score.phase], item.score.ratio)
    yield built


def canary_families(runs: Sequence[RunState], verdicts: Sequence[CanaryVerdict]) -> Iterator[Family]:
    """Ranks by their newest canary verdict, per run (a rank with none is "unchecked", so the
    series exist before the first canary), and the devices whose newest canary missed."""
    name_of = {run.id: run.name for run in runs}
    tally: Counter[tuple[int, str]] = Counter()
    mismatched = family(names.CANARY_MISMATCH)
    for verdict in verdicts:
        run = name_of.get(verdict.run_id)
        if run is None:
            continue
        tally[(verdict.run_id, verdict.result)] += 1
        if verdict.result == "mismatch":
            mismatched.add_metric([run, verdict.node, verdict.device], verdict.time)
    by_result = family(names.CANARY_RANKS)
    for run_state in runs:
        checked = 0
        for result in ("match", "mismatch", "rerun"):
            count = tally[(run_state.id, result)]
            checked += count
            by_result.add_metric([run_state.name, result], float(count))
        by_result.add_metric([run_state.name, "unchecked"], float(max(0, (run_state.ranks or 0) - checked)))
    yield from (by_result, mismatched)
