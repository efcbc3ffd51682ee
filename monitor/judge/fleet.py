"""Devices and links of each run: every new sample judged on arrival, error rates compared
with peers on a period, and clock-event time kept for the straggler evidence.

The rules are pure (``policies.devices``); this module holds each device's and port's
previous reading in memory (after a service restart, the newest stored one is read once per
device, so history is not reported again) and persists what the rules find.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from monitor.judge.incidents import IncidentRecorder
from monitor.judge.readings import device_reading, link_reading
from monitor.store import models
from policies.devices import (
    DeviceChange,
    DeviceReading,
    DevicesConfig,
    LinkChange,
    LinkReading,
    PeerRates,
    carry_forward,
    clock_event_fractions,
    device_rates,
    elevated_clock_reasons,
    link_rates,
)
from policies.registry import (
    DevicePolicy,
    LinkPolicy,
    PeerPolicy,
    device_policies,
    link_policies,
    peer_policies,
)
from policies.types import Finding

DEVICE = models.table_of(models.DeviceSample)
LINK = models.table_of(models.LinkSample)

LINK_ERROR_COUNTERS = ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors")


class FleetWatch:
    """Runs the device, link and peer policies (by default ``policies.registry``'s over
    ``config``) over each run's samples."""

    def __init__(
        self,
        engine: Engine,
        config: DevicesConfig,
        recorder: IncidentRecorder,
        last_step: Callable[[int], int],
        devices: Sequence[DevicePolicy] | None = None,
        links: Sequence[LinkPolicy] | None = None,
        peers: Sequence[PeerPolicy] | None = None,
    ) -> None:
        self._engine = engine
        self._config = config
        self._device_policies = tuple(devices if devices is not None else device_policies(config))
        self._link_policies = tuple(links if links is not None else link_policies(config))
        self._peer_policies = tuple(peers if peers is not None else peer_policies(config))
        self._recorder = recorder
        self._last_step = last_step
        self._lock = threading.Lock()
        self._devices: dict[tuple[int, str, str], DeviceReading] = {}
        self._held_devices: dict[tuple[int, str, str], DeviceReading] = {}
        self._fractions: dict[tuple[int, str], dict[str, float]] = {}
        self._links: dict[tuple[int, str, str, int], LinkReading] = {}
        self._held_links: dict[tuple[int, str, str, int], LinkReading] = {}
        self._link_errors: dict[tuple[int, str], float] = {}

    def observe(
        self, run_id: int, device_rows: Sequence[dict[str, Any]], link_rows: Sequence[dict[str, Any]]
    ) -> list[int]:
        """Judge a batch's new device and link samples; returns incidents touched."""
        if not device_rows and not link_rows:
            return []
        step = self._last_step(run_id)
        with self._lock, self._engine.begin() as connection:
            findings: list[Finding] = []
            for row in sorted(device_rows, key=lambda r: r["seq"]):
                findings += self._device(connection, run_id, device_reading(row), step)
            for row in sorted(link_rows, key=lambda r: r["seq"]):
                findings += self._link(connection, run_id, link_reading(row), step)
            return self._recorder.record(connection, run_id, findings, step)

    def _device(
        self, connection: Connection, run_id: int, reading: DeviceReading, step: int
    ) -> list[Finding]:
        key = (run_id, reading.node, reading.device)
        previous = self._devices.get(key)
        if previous is None:
            previous = self._stored_device(connection, run_id, reading)
        change = DeviceChange(previous, reading, step)
        found = [f for policy in self._device_policies for f in policy.judge(None, change)[1]]
        if previous is None or reading.seq > previous.seq:
            if previous is not None:
                self._fractions[(run_id, reading.device)] = dict(clock_event_fractions(previous, reading))
            self._devices[key] = carry_forward(previous, reading)
            self._held_devices.setdefault(key, self._devices[key])
        return found

    def _stored_device(
        self, connection: Connection, run_id: int, reading: DeviceReading
    ) -> DeviceReading | None:
        row = (
            connection.execute(
                sa.select(DEVICE)
                .where(
                    DEVICE.c.run_id == run_id,
                    DEVICE.c.node == reading.node,
                    DEVICE.c.device_uuid == reading.device,
                    DEVICE.c.seq < reading.seq,
                )
                .order_by(DEVICE.c.seq.desc())
                .limit(1)
            )
            .mappings()
            .first()
        )
        # Its XIDs were judged when it arrived: keep its counters and flags, not its events.
        return None if row is None else replace(device_reading(dict(row)), xids=())

    def _link(self, connection: Connection, run_id: int, reading: LinkReading, step: int) -> list[Finding]:
        key = (run_id, reading.node, reading.device, reading.port)
        previous = self._links.get(key)
        if previous is None:
            row = (
                connection.execute(
                    sa.select(LINK)
                    .where(
                        LINK.c.run_id == run_id,
                        LINK.c.node == reading.node,
                        LINK.c.device == reading.device,
                        LINK.c.port == reading.port,
                        LINK.c.seq < reading.seq,
                    )
                    .order_by(LINK.c.seq.desc())
                    .limit(1)
                )
                .mappings()
                .first()
            )
            previous = None if row is None else link_reading(dict(row))
        change = LinkChange(previous, reading, step)
        found = [f for policy in self._link_policies for f in policy.judge(None, change)[1]]
        if previous is None or reading.seq > previous.seq:
            if previous is not None:
                errors = sum(
                    max(0, reading.counters.get(name, 0) - previous.counters.get(name, 0))
                    for name in LINK_ERROR_COUNTERS
                )
                span = max(reading.time - previous.time, 1e-9)
                self._link_errors[(run_id, reading.node)] = errors / span
            self._links[key] = reading
            self._held_links.setdefault(key, reading)
        return found

    def forget(self, run_id: int) -> None:
        """Drop the run's readings: another replica judges it now (and reads its own)."""
        with self._lock:
            for table in (
                self._devices,
                self._held_devices,
                self._fractions,
                self._links,
                self._held_links,
                self._link_errors,
            ):
                _drop_run(table, run_id)

    def compare_peers(self) -> list[int]:
        """Error rates of every device and port against its run's peers since the last call."""
        touched: list[int] = []
        with self._lock:
            runs = {key[0] for key in self._devices} | {key[0] for key in self._links}
            for run_id in sorted(runs):
                device_spans = [
                    device_rates(self._held_devices[k], r)
                    for k, r in self._devices.items()
                    if k[0] == run_id and r.seq > self._held_devices[k].seq
                ]
                link_spans = [
                    link_rates(self._held_links[k], r)
                    for k, r in self._links.items()
                    if k[0] == run_id and r.seq > self._held_links[k].seq
                ]
                step = self._last_step(run_id)
                rates = PeerRates(device_spans, link_spans, step)
                findings = [f for policy in self._peer_policies for f in policy.judge(None, rates)[1]]
                for key, reading in self._devices.items():
                    if key[0] == run_id:
                        self._held_devices[key] = reading
                for link_key, link in self._links.items():
                    if link_key[0] == run_id:
                        self._held_links[link_key] = link
                if findings:
                    with self._engine.begin() as connection:
                        touched += self._recorder.record(connection, run_id, findings, step)
        return touched

    def straggler_evidence(self, run_id: int, finding: Finding) -> Finding:
        """A straggler finding with its device's slowdown reasons and its node's link errors,
        each against its peers'."""
        with self._lock:
            evidence = dict(finding.evidence)
            mine = self._fractions.get((run_id, finding.device or ""))
            if mine is not None:
                peers = [
                    f
                    for (run, device), f in self._fractions.items()
                    if run == run_id and device != finding.device
                ]
                evidence["clock_event_reasons"] = [
                    {"reason": e.reason, "fraction": e.fraction, "peer_median": e.peer_median}
                    for e in elevated_clock_reasons(mine, peers, self._config.clock)
                ]
            errors = self._link_errors.get((run_id, finding.node or ""))
            if errors is not None:
                peers_errors = [
                    v
                    for (run, node), v in self._link_errors.items()
                    if run == run_id and node != finding.node
                ]
                evidence["link_errors_per_s"] = errors
                evidence["peer_link_errors_per_s"] = float(np.median(peers_errors)) if peers_errors else None
        return replace(finding, evidence=evidence)


def _drop_run(table: dict[Any, Any], run_id: int) -> None:
    for key in [key for key in table if key[0] == run_id]:
        del table[key]
