"""The Prometheus collector: everything read at scrape time, nothing kept between scrapes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import Metric as Family
from prometheus_client.registry import Collector, CollectorRegistry
from sqlalchemy.engine import Connection

from monitor.observe.metrics import names, reads, state
from monitor.observe.metrics.families import (
    RankedStraggler,
    admission_families,
    canary_families,
    device_families,
    family,
    incident_families,
    ingest_families,
    link_families,
    preemption_family,
    run_families,
    straggler_family,
)
from monitor.observe.metrics.goodput import goodput_families, read_goodput

if TYPE_CHECKING:
    from monitor.service import Service


class RunHealthCollector(Collector):
    """Per run, device, port and top straggler, from the store and the service's memory.

    One scrape opens one connection and makes a few index lookups per exported run (see
    ``monitor.observe.metrics.reads``), copies the fleet watch's newest readings, and picks the top
    stragglers from the engine's arrays: its cost follows the number of runs, devices and
    ports, and does not grow with a run's length or (beyond the heartbeat aggregate) its ranks.
    """

    def __init__(self, service: Service) -> None:
        self._service = service

    def describe(self) -> Iterator[Family]:
        """Every family, empty: lets a registry check names without querying the store."""
        for metric in names.ALL:
            yield family(metric)

    def collect(self) -> Iterator[Family]:
        service = self._service
        config = service.config.metrics
        hangs = service.config.engine.hangs
        silence_s = hangs.silence_s()
        now = service.clock()
        with service.engine.connect() as connection:
            runs = reads.read_runs(connection, now, config.recent_windows, silence_s, config.run_retention_s)
            incidents = reads.read_open_incidents(connection, [run.id for run in runs])
            proposals = service.metric_sources.pending_proposals(connection)
            canaries = service.metric_sources.canary_verdicts(connection, {r.id: r.ranks or 0 for r in runs})
            stragglers = self._stragglers(connection, runs)
            goodput = read_goodput(connection, runs, service.config.engine.checkpoint_interval, hangs)
        name_of = {run.id: run.name for run in runs}
        devices = [(name_of[i], r) for i, r in state.device_readings(service.fleet) if i in name_of]
        links = [(name_of[i], r) for i, r in state.link_readings(service.fleet) if i in name_of]
        device_grain = _grains(devices, config.device_grain)
        link_grain = _grains(links, config.link_grain)
        yield from run_families(runs)
        yield from goodput_families(goodput)
        budgets = {run.id: budget for run in runs if (budget := service.policies.budget(run.id)) is not None}
        yield from preemption_family(runs, budgets)
        yield from ingest_families(runs, service.counter_snapshot())
        admission = service.admission.state()
        yield from admission_families(admission.in_flight, admission.shed)
        yield from incident_families(runs, incidents, proposals, config.open_incidents_per_run)
        yield from straggler_family(stragglers)
        yield from canary_families(runs, canaries)
        yield from device_families(
            [(run, r) for run, r in devices if device_grain[run] != "off"],
            {run for run, grain in device_grain.items() if grain == "node"},
        )
        yield from link_families(
            [(run, r) for run, r in links if link_grain[run] != "off"],
            service.config.devices.active_states,
            {run for run, grain in link_grain.items() if grain == "node"},
        )

    def _stragglers(self, connection: Connection, runs: Sequence[reads.RunState]) -> list[RankedStraggler]:
        service = self._service
        k = service.config.metrics.top_stragglers
        min_windows = service.config.engine.stragglers.min_windows
        found: list[RankedStraggler] = []
        for run in runs:
            straggling = state.straggler_state(service.policies, run.id)
            scores = [] if straggling is None else state.top_stragglers(straggling, min_windows, k)
            nodes = reads.nodes_of_ranks(connection, run.id, run.incarnation, [s.rank for s in scores])
            found += [RankedStraggler(run.name, nodes.get(s.rank, ""), s) for s in scores]
        return found


def _grains(readings: Sequence[tuple[str, object]], grain_of: Callable[[int], str]) -> dict[str, str]:
    """Each run's granularity for its device (or port) series, from how many it has."""
    counts = Counter(run for run, _ in readings)
    return {run: grain_of(count) for run, count in counts.items()}


def metrics_registry(service: Service, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """A registry of its own for one service (never the process-wide default one)."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    registry.register(RunHealthCollector(service))
    return registry
