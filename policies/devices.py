"""Devices and links: ECC, row remapping, XIDs, NVLink/PCIe/InfiniBand error rates against peers,
port state, saturated counters, and clock-event time for the straggler evidence.

How the engine calls these (constant work per record; history is never rescanned):

- Per device sample: ``reading`` (the service makes it from the record:
  ``monitor.judge.readings``), then
  ``device_findings(previous, reading, config)`` with the previous reading of the same device
  (``None`` for its first), then keep ``reading`` as that device's previous. A reading whose
  ``seq`` is not after the previous one (late, replayed from a spool) is judged on its own
  XIDs only; keep the newer reading as previous. Links: ``LinkReading`` and ``link_findings``.
- Periodically, per run: ``device_rates(held, latest)`` for each device, where ``held`` is the
  reading kept at the previous comparison, so a rate spans the whole comparison period (minutes)
  rather than one 10 s sample interval, where a single error looks like a burst. Then
  ``device_peer_findings(all_rates, config)``; links likewise with ``link_rates`` and
  ``link_peer_findings``. Peers are every device (port) of the run: one run's devices are one
  model on one fabric.
- For a straggler: ``clock_event_fractions(previous, current)`` of its device and of its peers'
  devices over the same span, then ``elevated_clock_reasons``.

One counter alone is not reason to evict a node (the reference text, "Diagnose a symptom before
choosing a recovery"): error rates and port states are warnings, never critical. Critical is kept
for what the device itself reports as an uncorrectable fault: uncorrected ECC errors, row
remapping pending or failed, hardware XIDs, a GPU that NVML says is lost.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from policies.stats import array_median, robust_center_scale, robust_z
from policies.types import Finding, Severity
from policies.xid import XID_CATALOG, XID_CATALOG_SOURCE, XidCause, XidEntry

# --- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignalLimit:
    """A rate at or below ``floor_per_s``, or fewer than ``min_count`` new errors over the compared
    span, is never an outlier, however quiet the peers are."""

    floor_per_s: float = 0.0
    min_count: int = 1

    def __post_init__(self) -> None:
        if not (self.floor_per_s >= 0 and math.isfinite(self.floor_per_s)) or self.min_count < 1:
            raise ValueError("SignalLimit: finite floor_per_s >= 0, min_count >= 1")


# DCGM's health limits (NVIDIA DCGM, dcgm_gpu_hardware_limits.h and DcgmHealthWatch): "RM has
# informed us that CRC errors only matter at rates of 100+ per second"; any NVLink replay or
# recovery fails DCGM's NVLink health check (DCGM_LIMIT_MAX_NVLINK_ERROR = 1; here it needs its
# peers quiet too); "8 replays per minute is the maximum recommended by RM" for PCIe.
# Corrected ECC: authored (the driver raises XID 92 on its own for a high rate): 10 corrected
# errors and more than one a minute before a device can stand out.
DEVICE_LIMITS: Mapping[str, SignalLimit] = MappingProxyType(
    {
        "nvlink_crc": SignalLimit(floor_per_s=100.0),
        "nvlink_replay": SignalLimit(),
        "nvlink_recovery": SignalLimit(),
        "pcie_replay": SignalLimit(floor_per_s=8 / 60),
        "ecc_corrected": SignalLimit(floor_per_s=1 / 60, min_count=10),
    }
)
# InfiniBand PortCounters: infiniband-diags' ibqueryerrors thresholds (error_thresholds example:
# SymbolErrorCounter=10, LinkErrorRecoveryCounter=10) as counts over the compared span; the same
# 10 for port_rcv_errors (authored: the same physical-layer causes plus malformed packets). Any
# link_downed increment (a port that went down and retrained) counts when its peers had none.
LINK_LIMITS: Mapping[str, SignalLimit] = MappingProxyType(
    {
        "symbol_error": SignalLimit(min_count=10),
        "link_error_recovery": SignalLimit(min_count=10),
        "link_downed": SignalLimit(),
        "port_rcv_errors": SignalLimit(min_count=10),
    }
)


@dataclass(frozen=True)
class PeerConfig:
    """When a rate is well above its peers'.

    A key is an outlier when its rate is above ``ratio`` x its peers' median and above the
    signal's floor, and, with at least ``min_peers_for_z`` peers, its robust z (distance from the
    peers' median in units of 1.4826 x their median absolute deviation) reaches ``z``.

    - ``ratio`` 10: error counts are small and Poisson-like, so healthy links differ by a few-fold
      from one span to the next (a link expecting 1 error sees 4 or more 2% of the time); ten
      times the typical peer is beyond that noise at any count the floors let through.
    - ``z`` 5: against the peers' own spread, 5 robust sigmas one-sided is ~3e-7 under normal
      noise; it keeps a fleet whose rates legitimately spread over an order of magnitude quiet.
    - ``min_peers_for_z`` 3: the MAD of one or two values is no scale. With one or two peers a key
      must instead be above ``ratio`` x the largest peer (and the floor): above every peer by the
      margin. With no peer nothing is an outlier; the per-reading rules still apply.
    - ``exact_up_to`` 64 keys: each key is compared with the others alone (leave one out); beyond,
      with the median and MAD of all keys, which one key moves by at most one order statistic.
    """

    ratio: float = 10.0
    z: float = 5.0
    min_peers_for_z: int = 3
    exact_up_to: int = 64

    def __post_init__(self) -> None:
        if not self.ratio > 1 or not self.z > 0:
            raise ValueError("PeerConfig: ratio > 1, z > 0")
        if self.min_peers_for_z < 2 or self.exact_up_to < self.min_peers_for_z + 1:
            raise ValueError("PeerConfig: min_peers_for_z >= 2, exact_up_to > min_peers_for_z")


CLOCK_SLOWDOWN_REASONS = (
    "sw_power_cap",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
)


@dataclass(frozen=True)
class ClockConfig:
    """When a straggler's clock-event time is elevated against its peers'.

    There is no model-independent "bad clock" threshold (the reference text, after the
    nvidia-smi documentation): a reason counts only against devices under matched work, so one
    peer suffices (``min_peers`` 1) and the peers' median is the baseline.

    - ``min_excess`` 0.05 of wall time: NVML documents the HW slowdowns (thermal, power brake) as
      "reducing the core clocks by a factor of 2 or more" (nvmlClocksEventReasons), so 5% of the
      time in one costs at least 2.5% of throughput, a quarter of the straggler rule's 10%: the
      smallest share worth citing as a cause. (SW power cap and thermal slowdowns cut less.)
    - ``ratio`` 1.5: and at least 1.5x the peers' share, so a fleet that is power-capped most of
      the time does not make every straggler "power-capped".
    - ``reasons``: the slowdowns. Sync boost is left out: it holds a group's clocks to its slowest
      member, a consequence of a slow peer rather than a cause.
    """

    min_excess: float = 0.05
    ratio: float = 1.5
    min_peers: int = 1
    reasons: tuple[str, ...] = CLOCK_SLOWDOWN_REASONS

    def __post_init__(self) -> None:
        if not 0 < self.min_excess < 1 or self.ratio < 1 or self.min_peers < 1:
            raise ValueError("ClockConfig: 0 < min_excess < 1, ratio >= 1, min_peers >= 1")


@dataclass(frozen=True)
class DevicesConfig:
    """Thresholds of the device and link rules.

    - ``xid_catalog``: policies.xid.XID_CATALOG (NVIDIA's XID catalog, cited there); a code not in
      it is ``unknown_xid_severity`` (warning: unknown is not harmless, nor proven hardware).
    - ``device_limits`` and ``link_limits``: per-signal floors, sourced at DEVICE_LIMITS and
      LINK_LIMITS. A signal not listed is not compared.
    - ``active_states``: the kernel's names for a usable port (``ACTIVE``; ``ACTIVE_DEFER`` is
      active with deferred error handling), from drivers/infiniband/core/sysfs.c.
    """

    xid_catalog: Mapping[int, XidEntry] = field(default_factory=lambda: dict(XID_CATALOG))
    unknown_xid_severity: Severity = Severity.WARNING
    device_limits: Mapping[str, SignalLimit] = field(default_factory=lambda: dict(DEVICE_LIMITS))
    link_limits: Mapping[str, SignalLimit] = field(default_factory=lambda: dict(LINK_LIMITS))
    active_states: frozenset[str] = frozenset({"ACTIVE", "ACTIVE_DEFER"})
    peers: PeerConfig = field(default_factory=PeerConfig)
    clock: ClockConfig = field(default_factory=ClockConfig)

    def __post_init__(self) -> None:
        if not self.active_states:
            raise ValueError("DevicesConfig.active_states must not be empty")
        unknown = set(self.device_limits) - set(DEVICE_SIGNAL_NAMES)
        if unknown:
            raise ValueError(f"DevicesConfig.device_limits: unknown signals {sorted(unknown)}")


# --- readings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class XidEvent:
    code: int
    time: float | None = None
    gpu_instance_id: int | None = None  # MIG: the instance the XID came from
    compute_instance_id: int | None = None


@dataclass(frozen=True)
class DeviceReading:
    """One ``device_sample`` as the rules read it. ``counters`` holds every cumulative counter of
    the sample by dotted name (``ecc.volatile.uncorrected``, ``nvlink.3.crc_flit``,
    ``clock_event_ns.hw_thermal_slowdown``, ``pcie_replay``); a missing key is unsupported there.
    Mappings are never mutated after construction: treat the reading as the frozen value it is."""

    node: str
    device: str
    seq: int
    time: float
    rank: int | None = None
    counters: Mapping[str, int] = field(default_factory=dict)
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    xids: tuple[XidEvent, ...] = ()
    xids_dropped: int = 0
    read_errors: Mapping[str, str] = field(default_factory=dict)
    clock_event_reasons: int | None = None
    sm_clock_mhz: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None


@dataclass(frozen=True)
class LinkReading:
    """One ``link_sample``: port state, counters by name (``hw.<name>`` for hw_counters), and the
    names of those stuck at their maximum (which count nothing more)."""

    node: str
    device: str
    port: int
    seq: int
    time: float
    state: str | None = None
    counters: Mapping[str, int] = field(default_factory=dict)
    saturated: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"


def carry_forward(previous: DeviceReading | None, current: DeviceReading) -> DeviceReading:
    """The reading to keep as ``previous`` for the next sample: ``current``, with any counter it
    lacks (a read that failed this once, a link that went inactive) carried over from
    ``previous``, so an increment across the gap is still seen when the counter returns."""
    if previous is None or current.seq <= previous.seq:
        return current if previous is None else previous
    missing = {name: value for name, value in previous.counters.items() if name not in current.counters}
    if not missing:
        return current
    return replace(current, counters={**missing, **current.counters})


# --- counter deltas and rates --------------------------------------------------------------------


@dataclass(frozen=True)
class CounterRates:
    """What each cumulative counter of one device or port did between two of its readings.

    ``increments`` are counts over ``interval_s``. A counter that went down was reset (a driver
    reload resets the volatile ECC and NVLink counters; ``perfquery -R`` clears a port's): it
    counts from zero, so its increment is its new value (as Prometheus' ``rate()`` does), and
    it is listed in ``resets``. A counter that is saturated, or was absent from the earlier
    reading, has no known increment: it is in ``unknown``, never read as zero.
    """

    node: str
    device: str
    rank: int | None
    interval_s: float
    increments: Mapping[str, int]
    resets: frozenset[str] = frozenset()
    unknown: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return f"{self.node}:{self.device}"

    def rate(self, name: str) -> float | None:
        """Per second, or None when unknown."""
        count = self.increments.get(name)
        return None if count is None or self.interval_s <= 0 else count / self.interval_s


def _span(before_seq: int, before_time: float, after_seq: int, after_time: float) -> float | None:
    """Seconds between two readings of one source, or None when they are not in order."""
    interval = after_time - before_time
    if after_seq <= before_seq or not math.isfinite(interval) or interval <= 0:
        return None
    return interval


def counter_deltas(
    before: Mapping[str, int], after: Mapping[str, int], saturated: frozenset[str] = frozenset()
) -> tuple[dict[str, int], frozenset[str], frozenset[str]]:
    """(increments, resets, unknown) from one reading's counters to a later one's."""
    increments: dict[str, int] = {}
    resets, unknown = set(), set()
    for name, value in after.items():
        previous = before.get(name)
        if name in saturated or previous is None:
            unknown.add(name)
        elif value < previous:
            resets.add(name)
            increments[name] = value
        else:
            increments[name] = value - previous
    return increments, frozenset(resets), frozenset(unknown)


def device_rates(previous: DeviceReading, current: DeviceReading) -> CounterRates:
    """Counter increments of one device between two of its readings (any two, in order)."""
    interval = _span(previous.seq, previous.time, current.seq, current.time)
    if interval is None:
        return CounterRates(
            current.node, current.device, current.rank, 0.0, {}, unknown=frozenset(current.counters)
        )
    increments, resets, unknown = counter_deltas(previous.counters, current.counters)
    return CounterRates(current.node, current.device, current.rank, interval, increments, resets, unknown)


def link_rates(previous: LinkReading, current: LinkReading) -> CounterRates:
    """Counter increments of one port between two of its readings; saturated counters are unknown."""
    interval = _span(previous.seq, previous.time, current.seq, current.time)
    if interval is None:
        return CounterRates(current.node, current.name, None, 0.0, {}, unknown=frozenset(current.counters))
    increments, resets, unknown = counter_deltas(previous.counters, current.counters, current.saturated)
    return CounterRates(current.node, current.name, None, interval, increments, resets, unknown)


# Device signals: NVLink counters summed over the device's links, PCIe replays, corrected ECC.
_NVLINK_SIGNAL = {
    "crc_flit": "nvlink_crc",  # the legacy per-link counters
    "crc_data": "nvlink_crc",
    "crc": "nvlink_crc",  # the per-link field value (NVLink 5), flit and data CRC errors together
    "replay": "nvlink_replay",
    "recovery": "nvlink_recovery",
}
_DEVICE_SIGNAL = {"pcie_replay": "pcie_replay", "ecc.volatile.corrected": "ecc_corrected"}
DEVICE_SIGNAL_NAMES = ("nvlink_crc", "nvlink_replay", "nvlink_recovery", "pcie_replay", "ecc_corrected")


def device_signal_of(counter: str) -> str | None:
    parts = counter.split(".")
    if len(parts) == 3 and parts[0] == "nvlink":
        return _NVLINK_SIGNAL.get(parts[2])
    return _DEVICE_SIGNAL.get(counter)


def signal_counts(rates: CounterRates, signal_of: Callable[[str], str | None]) -> dict[str, dict[str, int]]:
    """Per signal, the increments of its known counters. A signal whose counters are partly
    unknown (a link that just came up) is a lower bound; one with none known is absent."""
    signals: dict[str, dict[str, int]] = {}
    for name, count in rates.increments.items():
        signal = signal_of(name)
        if signal is not None:
            signals.setdefault(signal, {})[name] = count
    return signals


def signal_rates(rates: CounterRates, signal_of: Callable[[str], str | None]) -> dict[str, float]:
    """Per signal, errors per second (e.g. ``device_signal_of`` for the straggler evidence)."""
    if rates.interval_s <= 0:
        return {}
    return {s: sum(parts.values()) / rates.interval_s for s, parts in signal_counts(rates, signal_of).items()}


# --- findings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Where:
    node: str
    device: str
    rank: int | None
    step: int
    incarnation: str

    def finding(
        self,
        kind: str,
        severity: Severity,
        signal: str,
        value: float | None,
        threshold: float | None,
        message: str,
        **evidence: Any,
    ) -> Finding:
        return Finding(
            step=self.step,
            kind=kind,
            severity=severity,
            signal=signal,
            value=value,
            threshold=threshold,
            message=message,
            incarnation=self.incarnation,
            rank=self.rank,
            evidence=evidence,
            node=self.node,
            device=self.device,
        )


def device_findings(
    previous: DeviceReading | None,
    current: DeviceReading,
    config: DevicesConfig,
    *,
    step: int = 0,
    incarnation: str = "",
) -> tuple[Finding, ...]:
    """Everything one new device sample says on its own (constant work).

    ``step`` is the run's newest step when the sample arrived (a device sample belongs to no step;
    grouping into incidents goes by step). Conditions (pending remap, lost GPU) are reported when
    they appear, not on every sample while they last.
    """
    where = _Where(current.node, current.device, current.rank, step, incarnation)
    found = _xid_findings(current, config, where)
    if previous is not None and current.seq <= previous.seq:
        return found  # late: its counters and flags are older than what was judged already
    return (
        _ecc(previous, current, where)
        + _remap(previous, current, where)
        + _lost(previous, current, where)
        + found
    )


# Any of these rising is a new uncorrectable error: the volatile count (since the driver loaded),
# the aggregate one (the GPU's lifetime, kept in its InfoROM) and rows remapped after one.
_UNCORRECTED = ("ecc.volatile.uncorrected", "ecc.aggregate.uncorrected", "remapped_rows.uncorrected")
_ECC_UNCORRECTED = _UNCORRECTED[:2]


def _ecc(previous: DeviceReading | None, current: DeviceReading, where: _Where) -> tuple[Finding, ...]:
    """A new uncorrected ECC error is critical. On the first reading, uncorrected ECC counts are
    history (before this run was watched): one warning. Remapped rows alone are not: a GPU with a
    few rows remapped is serviceable by NVIDIA's row-remapping design."""
    if previous is None:
        history = {n: current.counters[n] for n in _ECC_UNCORRECTED if current.counters.get(n, 0) > 0}
        if not history:
            return ()
        return (
            where.finding(
                "device_ecc",
                Severity.WARNING,
                "ecc.uncorrected",
                float(max(history.values())),
                None,
                f"{where.device} on {where.node} has uncorrected ECC errors on record from before it was "
                f"watched ({_listing(history)}): history, not a new fault",
                counts=history,
                remapped_rows={n: v for n, v in current.counters.items() if n.startswith("remapped_rows.")},
                history=True,
            ),
        )
    increments, resets, _ = counter_deltas(previous.counters, current.counters)
    new = {n: increments[n] for n in _UNCORRECTED if increments.get(n, 0) > 0}
    if not new:
        return ()
    return (
        where.finding(
            "device_ecc",
            Severity.CRITICAL,
            "ecc.uncorrected",
            float(max(new.values())),
            0.0,
            f"new uncorrected ECC error on {where.device} ({where.node}): {_listing(new, '+')}",
            new=new,
            counts={n: current.counters[n] for n in _UNCORRECTED if n in current.counters},
            resets=sorted(resets & set(_UNCORRECTED)),
        ),
    )


def _remap(previous: DeviceReading | None, current: DeviceReading, where: _Where) -> tuple[Finding, ...]:
    found = []
    rows = {
        n: current.counters[n]
        for n in ("remapped_rows.corrected", "remapped_rows.uncorrected")
        if n in current.counters
    }
    for flag, what in (
        (
            "remap_pending",
            "a row remap is pending: the row with an uncorrectable error stays in use until the GPU is reset",
        ),
        ("remap_failure", "row remapping failed: the GPU has no spare row left for a faulty one"),
    ):
        now, before = getattr(current, flag), getattr(previous, flag) if previous is not None else None
        if now and not before:
            signal = f"remapped_rows.{flag.removeprefix('remap_')}"
            found.append(
                where.finding(
                    "device_row_remap",
                    Severity.CRITICAL,
                    signal,
                    1.0,
                    None,
                    f"{where.device} ({where.node}): {what}",
                    rows=rows,
                )
            )
    return tuple(found)


def _lost(previous: DeviceReading | None, current: DeviceReading, where: _Where) -> tuple[Finding, ...]:
    """NVML answers GPU_IS_LOST for a GPU that stopped responding (the state behind XID 79)."""

    def lost(reading: DeviceReading | None) -> list[str]:
        return (
            [] if reading is None else sorted(k for k, v in reading.read_errors.items() if "GpuIsLost" in v)
        )

    reads = lost(current)
    if not reads or lost(previous):
        return ()
    message = f"NVML reports {where.device} on {where.node} as lost (GPU_IS_LOST): it no longer answers"
    return (
        where.finding(
            "device_lost", Severity.CRITICAL, "read_errors", float(len(reads)), None, message, reads=reads
        ),
    )


def xid_findings(
    current: DeviceReading, config: DevicesConfig, *, step: int = 0, incarnation: str = ""
) -> tuple[Finding, ...]:
    """One finding per XID code in the sample, judged by the catalog; plus dropped XIDs. Each XID
    is in exactly one sample (the reader drains them), so nothing here repeats."""
    return _xid_findings(
        current, config, _Where(current.node, current.device, current.rank, step, incarnation)
    )


def _xid_findings(current: DeviceReading, config: DevicesConfig, where: _Where) -> tuple[Finding, ...]:
    counts = Counter(x.code for x in current.xids)
    found = [_xid(code, count, current, config, where) for code, count in sorted(counts.items())]
    if current.xids_dropped:
        found.append(
            where.finding(
                "device_xid",
                Severity.WARNING,
                "xids_dropped",
                float(current.xids_dropped),
                None,
                f"{current.xids_dropped} XIDs from {where.device} ({where.node}) were dropped by the reader: "
                "their codes are unknown here, read the node's kernel log (dmesg | grep Xid)",
            )
        )
    return tuple(sorted(found, key=lambda f: -f.severity.rank))


def _xid(code: int, count: int, current: DeviceReading, config: DevicesConfig, where: _Where) -> Finding:
    events = [x for x in current.xids if x.code == code]
    evidence: dict[str, Any] = {"code": code, "count": count, "times": [x.time for x in events]}
    instances = {(x.gpu_instance_id, x.compute_instance_id) for x in events if x.gpu_instance_id is not None}
    if instances:
        evidence["mig_instances"] = [list(pair) for pair in sorted(instances)]
    what = f"XID {code}{f' x{count}' if count > 1 else ''} on {where.device} ({where.node})"
    entry = config.xid_catalog.get(code)
    if entry is None:
        severity, message = config.unknown_xid_severity, f"unknown {what}, see catalog {XID_CATALOG_SOURCE}"
        evidence["cause"] = "unknown"
    else:
        severity, message = entry.severity, f"{what}: {entry.name} [{entry.cause}]"
        if entry.cause is XidCause.APPLICATION:
            message += "; not a hardware fault"
        evidence.update(name=entry.name, cause=str(entry.cause), action=entry.action)
    return where.finding(
        "device_xid", severity, "xid", float(code), None, message, source=XID_CATALOG_SOURCE, **evidence
    )


def _listing(counts: Mapping[str, int], sign: str = "") -> str:
    return ", ".join(f"{name} {sign}{value}" for name, value in counts.items())


# --- links: state and saturation ------------------------------------------------------------------


def link_findings(
    previous: LinkReading | None,
    current: LinkReading,
    config: DevicesConfig,
    *,
    step: int = 0,
    incarnation: str = "",
) -> tuple[Finding, ...]:
    """What one new port sample says on its own: its state and newly saturated counters.

    Error rates need peers and a longer span: see ``link_peer_findings``.
    """
    if previous is not None and current.seq <= previous.seq:
        return ()  # late: the newer sample was judged already
    where = _Where(current.node, current.name, None, step, incarnation)
    return _port_state(previous, current, config, where) + _saturation(previous, current, config, where)


def _port_state(
    previous: LinkReading | None, current: LinkReading, config: DevicesConfig, where: _Where
) -> tuple[Finding, ...]:
    """A port that leaves ACTIVE is a warning. One already down when first seen is only info: nodes
    carry ports that are not cabled or not used by the run, and those are down all along."""
    state, before = current.state, previous.state if previous is not None else None
    if state is None or state in config.active_states:
        return ()
    if before is not None and before not in config.active_states:
        return ()  # still down: reported when it went down
    if before is None:
        message = f"port {current.name} on {current.node} is {state} at first sight: unused, or down already"
        return (where.finding("link_state", Severity.INFO, "state", None, None, message, state=state),)
    message = f"port {current.name} on {current.node} went {before} -> {state}"
    return (
        where.finding(
            "link_state", Severity.WARNING, "state", None, None, message, state=state, previous=before
        ),
    )


def _saturation(
    previous: LinkReading | None, current: LinkReading, config: DevicesConfig, where: _Where
) -> tuple[Finding, ...]:
    """A counter at its maximum counts nothing more: its rate is unknown, not zero."""
    found = []
    for name in sorted(current.saturated - (previous.saturated if previous is not None else frozenset())):
        judged = name in config.link_limits
        if name.startswith("hw."):
            remedy = "a driver counter (hw_counters): perfquery cannot clear it"
        else:
            remedy = f"clear it with perfquery -R -C {current.device} -P {current.port}"
        found.append(
            where.finding(
                "counter_saturated",
                Severity.WARNING if judged else Severity.INFO,
                name,
                float(current.counters[name]) if name in current.counters else None,
                None,
                f"counter {name} on {current.name} ({current.node}) is saturated: rate unknown; {remedy}",
                counter=name,
            )
        )
    return tuple(found)


# --- peers ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerVerdict:
    """Why a key is an outlier: its rate, the peers' median and count, the bar it passed, its z."""

    key: str
    rate: float
    peer_median: float
    peers: int
    bar: float
    z: float | None


def peer_judgements(
    rates: Mapping[str, float], config: PeerConfig, floor: float = 0.0
) -> tuple[PeerVerdict, ...]:
    """The keys whose rate is well above their peers' (see ``PeerConfig``), with the numbers."""
    items = sorted((k, float(v)) for k, v in rates.items() if math.isfinite(v) and v >= 0)
    if len(items) < 2:
        return ()  # no peer: nothing to be above
    keys, values = [k for k, _ in items], np.array([v for _, v in items])
    if len(values) > config.exact_up_to:
        center, scale = robust_center_scale(values)
        candidates = np.flatnonzero(values > max(config.ratio * center, floor))
        verdicts = (
            _verdict(keys[i], values[i], center, scale, len(values) - 1, config, floor) for i in candidates
        )
    else:
        verdicts = (_leave_one_out(i, keys, values, config, floor) for i in range(len(values)))
    return tuple(v for v in verdicts if v is not None)


def peer_outliers(rates: Mapping[str, float], config: PeerConfig, floor: float = 0.0) -> tuple[str, ...]:
    """Keys whose rate is well above their peers': above ``ratio`` x the peers' median and
    ``floor``, and at least ``z`` robust sigmas out (with 1-2 peers: above ``ratio`` x every peer).
    Robust because one failing device must not raise the bar it is judged against."""
    return tuple(v.key for v in peer_judgements(rates, config, floor))


def _leave_one_out(
    index: int, keys: list[str], values: np.ndarray[Any, Any], config: PeerConfig, floor: float
) -> PeerVerdict | None:
    peers = np.delete(values, index)
    if len(peers) < config.min_peers_for_z:
        bar = max(config.ratio * float(peers.max()), floor)
        rate = float(values[index])
        return (
            PeerVerdict(keys[index], rate, array_median(peers), len(peers), bar, None) if rate > bar else None
        )
    center, scale = robust_center_scale(peers)
    return _verdict(keys[index], float(values[index]), center, scale, len(peers), config, floor)


def _verdict(
    key: str, rate: float, center: float, scale: float, peers: int, config: PeerConfig, floor: float
) -> PeerVerdict | None:
    bar = max(config.ratio * center, floor)
    # Peers that all agree (error counters are often all zero) have no spread: any excess is out.
    z = robust_z(rate, center, scale)
    if rate <= bar or z < config.z:
        return None
    return PeerVerdict(key, rate, center, peers, bar, z if math.isfinite(z) else None)


def device_peer_findings(
    latest: Sequence[CounterRates], config: DevicesConfig, *, step: int = 0, incarnation: str = ""
) -> tuple[Finding, ...]:
    """Warnings for devices whose NVLink CRC/replay/recovery, PCIe replay or corrected-ECC rate is
    well above their peers' over the compared span (one call per run and period, O(n log n))."""
    return _peer_findings(
        latest, device_signal_of, config.device_limits, "device_error_rate", config, step, incarnation
    )


def link_peer_findings(
    latest: Sequence[CounterRates], config: DevicesConfig, *, step: int = 0, incarnation: str = ""
) -> tuple[Finding, ...]:
    """Warnings for ports whose symbol-error, link-recovery, link-downed or receive-error rate is
    well above their peers' over the compared span. Saturated counters take no part."""

    def signal_of(name: str) -> str | None:
        return name if name in config.link_limits else None

    return _peer_findings(latest, signal_of, config.link_limits, "link_error_rate", config, step, incarnation)


def _peer_findings(
    latest: Sequence[CounterRates],
    signal_of: Callable[[str], str | None],
    limits: Mapping[str, SignalLimit],
    kind: str,
    config: DevicesConfig,
    step: int,
    incarnation: str,
) -> tuple[Finding, ...]:
    measured = {r.key: (r, signal_counts(r, signal_of)) for r in latest if r.interval_s > 0}
    found = []
    for signal, limit in limits.items():
        rates = {k: sum(s[signal].values()) / r.interval_s for k, (r, s) in measured.items() if signal in s}
        for verdict in peer_judgements(rates, config.peers, limit.floor_per_s):
            source, signals = measured[verdict.key]
            parts = signals[signal]
            if sum(parts.values()) >= limit.min_count:
                found.append(_rate_finding(kind, signal, verdict, source, parts, step, incarnation))
    return tuple(found)


def _rate_finding(
    kind: str,
    signal: str,
    verdict: PeerVerdict,
    source: CounterRates,
    parts: Mapping[str, int],
    step: int,
    incarnation: str,
) -> Finding:
    where = _Where(source.node, source.device, source.rank, step, incarnation)
    count = sum(parts.values())
    worst = dict(sorted(parts.items(), key=lambda item: -item[1])[:8])
    return where.finding(
        kind,
        Severity.WARNING,
        signal,
        verdict.rate,
        verdict.bar,
        f"{signal} on {source.device} ({source.node}): {count} in {source.interval_s:.0f} s "
        f"({verdict.rate:.3g}/s), well above its {verdict.peers} peers (median {verdict.peer_median:.3g}/s); "
        "one counter is evidence, not a diagnosis",
        count=count,
        interval_s=source.interval_s,
        peer_median=verdict.peer_median,
        peers=verdict.peers,
        robust_z=verdict.z,
        counters=worst,
        resets=sorted(source.resets & set(parts)),
    )


# --- clocks: the straggler evidence ---------------------------------------------------------------


def clock_event_fractions(previous: DeviceReading, current: DeviceReading) -> Mapping[str, float]:
    """Per clock-event reason, the fraction of wall time between two readings that the clocks
    were held down for it (delta ns / delta wall ns, clipped to [0, 1] for sampling jitter). A
    reason whose counter went down (driver reload) or is new has no fraction."""
    interval = _span(previous.seq, previous.time, current.seq, current.time)
    if interval is None:
        return {}
    fractions = {}
    for name, after in current.counters.items():
        before = previous.counters.get(name)
        if not name.startswith("clock_event_ns.") or before is None or after < before:
            continue
        fractions[name.removeprefix("clock_event_ns.")] = min(1.0, (after - before) / (interval * 1e9))
    return fractions


@dataclass(frozen=True)
class ClockReasonExcess:
    reason: str
    fraction: float
    peer_median: float
    peers: int

    @property
    def excess(self) -> float:
        return self.fraction - self.peer_median


def elevated_clock_reasons(
    suspect: Mapping[str, float], peers: Iterable[Mapping[str, float]], config: ClockConfig
) -> tuple[ClockReasonExcess, ...]:
    """The slowdown reasons the suspect's device spent notably more of its time in than its peers'
    devices under matched work (see ``ClockConfig``), largest excess first."""
    peer_list = list(peers)
    elevated = []
    for reason in config.reasons:
        fraction = suspect.get(reason)
        values = [p[reason] for p in peer_list if reason in p and math.isfinite(p[reason])]
        if fraction is None or not math.isfinite(fraction) or len(values) < config.min_peers:
            continue
        median = array_median(values)
        if fraction - median >= config.min_excess and fraction >= config.ratio * median:
            elevated.append(ClockReasonExcess(reason, fraction, median, len(values)))
    return tuple(sorted(elevated, key=lambda e: -e.excess))


@dataclass(frozen=True)
class DeviceChange:
    """A device's new sample beside the one judged before it (None: its first)."""

    previous: DeviceReading | None
    current: DeviceReading
    step: int
    """The run's newest step when the sample arrived: a device sample belongs to no step."""


@dataclass(frozen=True)
class LinkChange:
    previous: LinkReading | None
    current: LinkReading
    step: int


@dataclass(frozen=True)
class PeerRates:
    """One run's device and port counter rates over the span since the last comparison."""

    devices: Sequence[CounterRates]
    links: Sequence[CounterRates]
    step: int


@dataclass(frozen=True)
class DeviceRules:
    """``policies.registry`` device policy: ``device_findings``."""

    config: DevicesConfig
    name: str = "device_rules"

    def start(self) -> None:
        return None

    def judge(self, state: None, observed: DeviceChange) -> tuple[None, tuple[Finding, ...]]:
        return None, device_findings(observed.previous, observed.current, self.config, step=observed.step)


@dataclass(frozen=True)
class LinkRules:
    """``policies.registry`` link policy: ``link_findings``."""

    config: DevicesConfig
    name: str = "link_rules"

    def start(self) -> None:
        return None

    def judge(self, state: None, observed: LinkChange) -> tuple[None, tuple[Finding, ...]]:
        return None, link_findings(observed.previous, observed.current, self.config, step=observed.step)


@dataclass(frozen=True)
class PeerRules:
    """``policies.registry`` peer policy: device then port error rates against their peers'."""

    config: DevicesConfig
    name: str = "peer_rates"

    def start(self) -> None:
        return None

    def judge(self, state: None, observed: PeerRates) -> tuple[None, tuple[Finding, ...]]:
        devices = device_peer_findings(observed.devices, self.config, step=observed.step)
        return None, devices + link_peer_findings(observed.links, self.config, step=observed.step)
