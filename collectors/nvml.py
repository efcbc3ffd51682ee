"""NVML device reader: one ``device_sample`` record per device, on its own thread and clock.

Runs inside the trainer, so it must never slow or break it: it samples on a daemon thread off
the step path, catches everything, and on a machine without a GPU or without libnvidia-ml it
says so in one log line and then does nothing. ``pynvml`` (nvidia-ml-py) is imported lazily,
inside the reader, so ``collectors`` imports without it.

Devices are keyed by UUID and mapped to the rank's CUDA device through ``CUDA_VISIBLE_DEVICES``
(integers, ``GPU-...`` UUIDs or unique prefixes of them, ``MIG-...`` UUIDs), because CUDA's
indices are not NVML's: NVML enumerates every GPU on the node and ignores the variable.

NVLink error counters are read per link as field values where the device answers them (NVLink 5,
GB200, answers no other way), else through the legacy per-link error counter.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies import protocol

logger = logging.getLogger(__name__)

Record = dict[str, Any]
Sink = Callable[[Record], None]
Clock = Callable[[], float]

# pynvml raises these when a device or driver does not offer a reading: skipped once and
# remembered, since asking again every sample only costs time and log lines.
_UNSUPPORTED_ERRORS = (
    "NVMLError_NotSupported",
    "NVMLError_FunctionNotFound",
    "NVMLError_NoPermission",
)
# nvmlInit raises these where there is no NVML at all (a CPU machine, no driver loaded).
_ABSENT_ERRORS = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")
# Per-field return codes of nvmlDeviceGetFieldValues that mean "not here": the call itself
# succeeds and a field id the driver does not know comes back NOT_SUPPORTED or INVALID_ARGUMENT.
_UNSUPPORTED_CODES = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_INVALID_ARGUMENT",
)

# Cumulative time, in ns, the clocks were held down for each reason (NVML field values).
CLOCK_EVENT_FIELDS: tuple[tuple[str, str], ...] = (
    ("sw_power_cap", "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP"),
    ("sync_boost", "NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST"),
    ("sw_thermal_slowdown", "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN"),
    ("hw_thermal_slowdown", "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN"),
    ("hw_power_brake_slowdown", "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN"),
)
# NVLink error counters of one link as field values, asked with the link as the scope id: how
# NVLink 5 (GB200) answers, where the legacy nvmlDeviceGetNvLinkErrorCounter returns
# NOT_SUPPORTED. Ids 161-163 as nvidia-ml-py names them (the ones nvidia-resiliency-ext's
# NVLinkWindowHealthCheck reads); DL_CRC counts the link's CRC errors, flit and data together.
NVLINK_FIELDS: tuple[tuple[str, str], ...] = (
    ("replay", "NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY"),
    ("recovery", "NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY"),
    ("crc", "NVML_FI_DEV_NVLINK_ERROR_DL_CRC"),
)
# The legacy per-link counters, for devices and drivers that do not answer the fields above.
NVLINK_COUNTERS: tuple[tuple[str, str], ...] = (
    ("replay", "NVML_NVLINK_ERROR_DL_REPLAY"),
    ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY"),
    ("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
    ("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
)
# The member of NVML's value union that holds each integer value type.
_INTEGER_MEMBERS: tuple[tuple[str, str], ...] = (
    ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
    ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),
)


@dataclass(frozen=True)
class _Reading:
    """One value read with one handle-first pynvml call (the first function the driver has)."""

    key: str  # a record field, or a dotted path under ``counters``
    functions: tuple[str, ...]  # newest first: older drivers lack the newer names
    constants: tuple[str, ...] = ()  # pynvml constants passed after the handle
    divisor: float | None = None  # None: an integer counter; else a float divided by this


SCALAR_READINGS: tuple[_Reading, ...] = (
    _Reading(
        "clock_event_reasons",
        ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
    ),
    _Reading("sm_clock_mhz", ("nvmlDeviceGetClockInfo",), ("NVML_CLOCK_SM",), 1.0),
    _Reading("mem_clock_mhz", ("nvmlDeviceGetClockInfo",), ("NVML_CLOCK_MEM",), 1.0),
    _Reading("power_w", ("nvmlDeviceGetPowerUsage",), (), 1000.0),  # NVML reports mW
    _Reading("power_limit_w", ("nvmlDeviceGetEnforcedPowerLimit",), (), 1000.0),
    _Reading(
        "temperature_c",
        ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
        ("NVML_TEMPERATURE_GPU",),
        1.0,
    ),
)
COUNTER_READINGS: tuple[_Reading, ...] = (
    *(
        _Reading(
            f"ecc.{scope}.{kind}",
            ("nvmlDeviceGetTotalEccErrors",),
            (f"NVML_MEMORY_ERROR_TYPE_{kind.upper()}", f"NVML_{scope.upper()}_ECC"),
        )
        for scope in ("volatile", "aggregate")
        for kind in ("corrected", "uncorrected")
    ),
    _Reading("pcie_replay", ("nvmlDeviceGetPcieReplayCounter",)),
)


@dataclass(frozen=True)
class VisibleDevice:
    """A device as this process's CUDA sees it.

    For a MIG device, ``handle`` is its parent GPU's and ``gpu_uuid`` names that GPU: clocks,
    power, ECC and links belong to the whole GPU, and NVML answers them only there.
    """

    uuid: str
    cuda_index: int
    handle: Any
    gpu_uuid: str


class _Calls:
    """pynvml calls for one reader: what a device lacks is remembered; nothing raises."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.error: type[BaseException] = _error_class(nvml, "NVMLError")
        self.unsupported_errors = tuple(_error_class(nvml, name) for name in _UNSUPPORTED_ERRORS)
        self.invalid_argument = _error_class(nvml, "NVMLError_InvalidArgument")
        self.timeout = _error_class(nvml, "NVMLError_Timeout")
        self.unsupported_codes = {getattr(nvml, name, None) for name in _UNSUPPORTED_CODES}
        self.unsupported: dict[tuple[str, str], str] = {}

    def attempt(
        self,
        uuid: str,
        key: str,
        function: str,
        *args: Any,
        errors: dict[str, str] | None = None,
        absent: tuple[type[BaseException], ...] = (),
    ) -> tuple[bool, Any]:
        """(succeeded, value). ``absent`` adds errors that mean "not here" for this call only."""
        if (uuid, key) in self.unsupported:
            return False, None
        fn = getattr(self.nvml, function, None)
        if fn is None:
            self.remember(uuid, key, f"{function} is not in this pynvml")
            return False, None
        try:
            return True, fn(*args)
        except (*self.unsupported_errors, *absent) as error:
            self.remember(uuid, key, type(error).__name__)
        except self.error as error:
            if errors is not None:
                errors[key] = type(error).__name__
        return False, None

    def call(self, uuid: str, key: str, function: str, *args: Any, **kwargs: Any) -> Any:
        return self.attempt(uuid, key, function, *args, **kwargs)[1]

    def remember(self, uuid: str, key: str, why: str, level: int = logging.DEBUG) -> None:
        self.unsupported[(uuid, key)] = why
        logger.log(level, "NVML: %s on %s not read from now on (%s)", key, uuid, why)

    def constant(self, name: str) -> Any:
        return getattr(self.nvml, name, None)


def _error_class(nvml: Any, name: str) -> type[BaseException]:
    found = getattr(nvml, name, None)
    if isinstance(found, type) and issubclass(found, BaseException):
        return found
    return type(f"_Absent{name}", (Exception,), {})  # never raised: matches nothing


# --- which devices: CUDA_VISIBLE_DEVICES -> NVML handles ------------------------------------


def parse_cuda_visible_devices(value: str | None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES``; None when unset (every device is visible)."""
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",")] if value.strip() else []


def resolve_visible_devices(calls: _Calls, cuda_visible_devices: str | None) -> list[VisibleDevice]:
    """Visible devices in CUDA order, each with the NVML handle its readings use.

    Integer entries index NVML's order, which is CUDA's under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    (and under the default order on a node of identical GPUs). As CUDA does, parsing stops at
    the first entry that names no device (or one already listed).
    """
    gpus = _enumerate_gpus(calls)
    entries = parse_cuda_visible_devices(cuda_visible_devices)
    if entries is None:
        return [VisibleDevice(uuid, index, handle, uuid) for index, (uuid, handle) in enumerate(gpus)]
    visible: list[VisibleDevice] = []
    for entry in entries:
        device = _resolve_entry(calls, gpus, entry, cuda_index=len(visible))
        if device is None or any(seen.uuid == device.uuid for seen in visible):
            break
        visible.append(device)
    return visible


def _enumerate_gpus(calls: _Calls) -> list[tuple[str, Any]]:
    """(UUID, handle) of every GPU NVML sees, in NVML's order."""
    count = calls.call("", "device_count", "nvmlDeviceGetCount") or 0
    gpus: list[tuple[str, Any]] = []
    for index in range(count):
        handle = calls.call("", f"handle.{index}", "nvmlDeviceGetHandleByIndex", index)
        if handle is None:
            continue
        uuid = calls.call("", f"uuid.{index}", "nvmlDeviceGetUUID", handle)
        if uuid is not None:
            gpus.append((str(uuid), handle))
    return gpus


def _resolve_entry(
    calls: _Calls, gpus: Sequence[tuple[str, Any]], entry: str, cuda_index: int
) -> VisibleDevice | None:
    matches: list[tuple[str, Any]] = []
    if entry.isdecimal():
        matches = list(gpus[int(entry) : int(entry) + 1])
    elif entry.startswith("GPU-"):
        # CUDA accepts any prefix that names exactly one GPU.
        matches = [(uuid, handle) for uuid, handle in gpus if uuid.startswith(entry)]
    elif entry.startswith("MIG-"):
        return _resolve_mig(calls, entry, cuda_index)
    if len(matches) != 1:
        return None
    uuid, handle = matches[0]
    return VisibleDevice(uuid, cuda_index, handle, uuid)


def _resolve_mig(calls: _Calls, uuid: str, cuda_index: int) -> VisibleDevice | None:
    mig = calls.call(uuid, "mig_handle", "nvmlDeviceGetHandleByUUID", uuid)
    if mig is None:
        return None
    parent = calls.call(uuid, "mig_parent", "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", mig)
    if parent is None:
        return None
    parent_uuid = calls.call(uuid, "mig_parent_uuid", "nvmlDeviceGetUUID", parent)
    return None if parent_uuid is None else VisibleDevice(uuid, cuda_index, parent, str(parent_uuid))


def _bare_uuid(uuid: str) -> str:
    """A UUID without its GPU-/MIG- prefix: torch reports device UUIDs without it."""
    return uuid.split("-", 1)[1] if uuid[:4] in ("GPU-", "MIG-") else uuid


# --- one sample ------------------------------------------------------------------------------


def read_device(calls: _Calls, device: VisibleDevice, errors: dict[str, str]) -> tuple[Record, Record]:
    """(scalar fields, counters) of one device now. Failed reads land in ``errors``."""
    scalars: Record = {}
    for reading in SCALAR_READINGS:
        value = _read(calls, device, reading, errors)
        if value is not None:
            scalars[reading.key] = value
    counters: Record = {}
    for reading in COUNTER_READINGS:
        value = _read(calls, device, reading, errors)
        if value is not None:
            _put(counters, reading.key, value)
    for key, group in (
        ("clock_event_ns", _read_clock_event_ns(calls, device, errors)),
        ("remapped_rows", _read_remapped_rows(calls, device, errors)),
        ("nvlink", _read_nvlink(calls, device, errors)),
    ):
        if group:
            counters[key] = group
    return scalars, counters


def _read(calls: _Calls, device: VisibleDevice, reading: _Reading, errors: dict[str, str]) -> Any:
    args = [calls.constant(name) for name in reading.constants]
    if any(arg is None for arg in args):
        if (device.uuid, reading.key) not in calls.unsupported:
            calls.remember(device.uuid, reading.key, "constant missing from this pynvml")
        return None
    for function in reading.functions:
        key = reading.key if len(reading.functions) == 1 else f"{reading.key}:{function}"
        ok, value = calls.attempt(device.uuid, key, function, device.handle, *args, errors=errors)
        if ok:
            return int(value) if reading.divisor is None else float(value) / reading.divisor
    return None


def _put(tree: Record, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for name in parents:
        tree = tree.setdefault(name, {})
    tree[leaf] = value


def _read_clock_event_ns(calls: _Calls, device: VisibleDevice, errors: dict[str, str]) -> Record:
    wanted = [
        (name, calls.constant(constant))
        for name, constant in CLOCK_EVENT_FIELDS
        if calls.constant(constant) is not None
        and (device.uuid, f"clock_event_ns.{name}") not in calls.unsupported
    ]
    if not wanted:
        return {}
    values = calls.call(
        device.uuid,
        "clock_event_ns",
        "nvmlDeviceGetFieldValues",
        device.handle,
        [field_id for _, field_id in wanted],
        errors=errors,
    )
    out: Record = {}
    for (name, _), value in zip(wanted, values or (), strict=False):
        number = _field_counter(calls, device.uuid, f"clock_event_ns.{name}", value, errors)
        if number is not None:
            out[name] = number
    return out


def _field_counter(calls: _Calls, uuid: str, key: str, value: Any, errors: dict[str, str]) -> int | None:
    """An unsigned 64-bit counter from one NVML field value, or None."""
    code = value.nvmlReturn
    if code != calls.constant("NVML_SUCCESS"):
        if code in calls.unsupported_codes:
            calls.remember(uuid, key, f"field return code {code}")
        else:
            errors[key] = f"field return code {code}"
        return None
    if value.valueType != calls.constant("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG"):
        # Field ids have been renumbered between nvidia-ml-py releases (the thermal ones moved
        # from 251-253 to 269-271); a driver on the other numbering answers another field.
        why = f"value type {value.valueType}, not a 64-bit counter: field id mismatch?"
        calls.remember(uuid, key, why, logging.WARNING)
        return None
    return int(value.value.ullVal)


def _read_remapped_rows(calls: _Calls, device: VisibleDevice, errors: dict[str, str]) -> Record:
    rows = calls.call(device.uuid, "remapped_rows", "nvmlDeviceGetRemappedRows", device.handle, errors=errors)
    if rows is None:
        return {}
    corrected, uncorrected, pending, failure = rows
    return {
        "corrected": int(corrected),
        "uncorrected": int(uncorrected),
        "pending": bool(pending),
        "failure": bool(failure),
    }


def _read_nvlink(calls: _Calls, device: VisibleDevice, errors: dict[str, str]) -> Record:
    """Error counters of each active link: per-link field values where the device answers them,
    else the legacy counters. A link index past the device's links is absent."""
    active = _active_links(calls, device, errors)
    if not active:
        return {}
    links = _nvlink_fields(calls, device, active, errors)
    for link in active:
        if str(link) not in links:
            links[str(link)] = _nvlink_legacy(calls, device, link, errors)
    return links


def _active_links(calls: _Calls, device: VisibleDevice, errors: dict[str, str]) -> list[int]:
    enabled = getattr(calls.nvml, "NVML_FEATURE_ENABLED", 1)
    past_last = (calls.invalid_argument,)  # NVML's answer for a link index past the last
    return [
        link
        for link in range(calls.constant("NVML_NVLINK_MAX_LINKS") or 0)
        # inactive links are asked again next time: they can come up
        if calls.call(
            device.uuid,
            f"nvlink.{link}.state",
            "nvmlDeviceGetNvLinkState",
            device.handle,
            link,
            errors=errors,
            absent=past_last,
        )
        == enabled
    ]


def _nvlink_fields(
    calls: _Calls, device: VisibleDevice, links: Sequence[int], errors: dict[str, str]
) -> Record:
    """The links whose counters the device answers as field values, in one call for all. A
    device that answers none of them at the first ask is not asked again."""
    fields = [(name, calls.constant(c)) for name, c in NVLINK_FIELDS if calls.constant(c) is not None]
    if not fields or (device.uuid, "nvlink_fields") in calls.unsupported:
        return {}
    asked = [(link, name, field_id) for link in links for name, field_id in fields]
    values = calls.call(
        device.uuid,
        "nvlink_fields",
        "nvmlDeviceGetFieldValues",
        device.handle,
        [(field_id, link) for link, _, field_id in asked],
        errors=errors,
        absent=(TypeError,),  # a pynvml too old to take (field id, scope id) pairs
    )
    found: Record = {}
    answered = False
    for (link, name, _), value in zip(asked, values or (), strict=False):
        code = value.nvmlReturn
        if code in calls.unsupported_codes:
            continue
        answered = True
        number = _field_integer(calls, value) if code == calls.constant("NVML_SUCCESS") else None
        if number is None:
            errors[f"nvlink.{link}.{name}"] = f"field return code {code}, value type {value.valueType}"
        else:
            found.setdefault(str(link), {})[name] = number
    if values is not None and not answered:
        calls.remember(device.uuid, "nvlink_fields", "no link answered its error-counter fields")
    return found


def _field_integer(calls: _Calls, value: Any) -> int | None:
    """An integer field value of whichever integer type NVML gave it; None for any other type."""
    for type_name, member in _INTEGER_MEMBERS:
        if value.valueType == calls.constant(type_name):
            return int(getattr(value.value, member))
    return None


def _nvlink_legacy(calls: _Calls, device: VisibleDevice, link: int, errors: dict[str, str]) -> Record:
    counters = [(name, calls.constant(c)) for name, c in NVLINK_COUNTERS if calls.constant(c) is not None]
    read = {
        name: calls.call(
            device.uuid,
            f"nvlink.{link}.{name}",
            "nvmlDeviceGetNvLinkErrorCounter",
            device.handle,
            link,
            counter,
            errors=errors,
        )
        for name, counter in counters
    }
    return {name: int(value) for name, value in read.items() if value is not None}


# --- XID events --------------------------------------------------------------------------------


class _XidBuffer:
    """XIDs waiting for the next sample of their device, bounded per device."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._pending: dict[str, list[Record]] = {}
        self._dropped: dict[str, int] = {}

    def add(self, uuid: str, xid: Record) -> None:
        with self._lock:
            pending = self._pending.setdefault(uuid, [])
            if len(pending) < self._limit:
                pending.append(xid)
            else:
                self._dropped[uuid] = self._dropped.get(uuid, 0) + 1

    def drain(self, uuid: str) -> tuple[list[Record], int]:
        with self._lock:
            return self._pending.pop(uuid, []), self._dropped.pop(uuid, 0)

    def has(self, uuid: str) -> bool:
        with self._lock:
            return bool(self._pending.get(uuid) or self._dropped.get(uuid))


# --- the reader --------------------------------------------------------------------------------


class NvmlReader:
    """Samples NVML on its own interval and hands each ``device_sample`` record to ``sink``.

    ``sink`` is called from the reader's sampler thread (and once from the caller of ``stop()``
    to flush XIDs that arrived after the last sample), one record per call; it should return
    quickly, and an exception from it is logged once and otherwise ignored.
    """

    @dataclass(frozen=True)
    class Config:
        """How the reader samples.

        interval_s: 10 s. Clock-event times and ECC, replay and link error counts are
            cumulative, so the interval sets time resolution, not accuracy: at 10 s a throttling
            episode is placed within a few steps of a typical 1-10 s step, for well under a
            millisecond of sampler-thread CPU per sample (dcgm-exporter collects every 30 s).
        xid_wait_ms: 500 ms, the longest one ``nvmlEventSetWait`` blocks; it bounds how long
            ``stop()`` waits for the XID thread. Events arriving meanwhile wait in the event set.
        max_pending_xids: 256 per device between two samples (an XID also triggers a sample at
            once, so this fills only in a storm); beyond it XIDs are counted in
            ``counters["xids_dropped"]``, keeping memory bounded if the sink stalls.
        stop_timeout_s: 5 s to wait for each thread in ``stop()``; both are daemons, so one
            stuck in the driver never holds the process open.
        """

        interval_s: float = 10.0
        xid_wait_ms: int = 500
        max_pending_xids: int = 256
        stop_timeout_s: float = 5.0

        def __post_init__(self) -> None:
            if not self.interval_s > 0 or not self.stop_timeout_s > 0:
                raise ValueError("NvmlReader.Config: interval_s and stop_timeout_s must be > 0")
            if self.xid_wait_ms < 1 or self.max_pending_xids < 1:
                raise ValueError("NvmlReader.Config: xid_wait_ms and max_pending_xids must be >= 1")

    def __init__(
        self,
        sink: Sink,
        config: NvmlReader.Config | None = None,
        *,
        nvml: Any = None,
        environ: Mapping[str, str] | None = None,
        node: str | None = None,
        clock: Clock = time.time,
        rank: int | None = None,
        cuda_device: int | None = None,
        device_uuid: str | None = None,
    ) -> None:
        """``nvml``: the pynvml module (imported lazily when None). ``cuda_device`` (the rank's
        CUDA index) or ``device_uuid`` (as CUDA reports it, prefix optional) picks the rank's
        device; with neither, every visible device is sampled. ``rank`` is recorded when the
        samples are of the rank's own device: one was picked, or only one is visible."""
        self.config = config or NvmlReader.Config()
        self._sink = sink
        self._nvml_module = nvml
        environ = os.environ if environ is None else environ
        self._cuda_visible_devices = environ.get("CUDA_VISIBLE_DEVICES")
        self._cuda_device_order = environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
        self._node = node or socket.gethostname()
        self._clock = clock
        self._rank = rank
        self._cuda_device = cuda_device
        self._device_uuid = device_uuid
        self._lock = threading.RLock()
        self._calls: _Calls | None = None
        self._devices: list[VisibleDevice] = []
        self._unavailable: str | None = None
        self._last_seq: dict[str, int] = {}
        self._xids = _XidBuffer(self.config.max_pending_xids)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._event_gpus: dict[str, Any] = {}
        self._said: set[str] = set()

    # -- public surface --

    @property
    def available(self) -> bool:
        with self._lock:
            return self._open()

    @property
    def unavailable_reason(self) -> str | None:
        return self._unavailable

    @property
    def devices(self) -> tuple[VisibleDevice, ...]:
        with self._lock:
            self._open()
            return tuple(self._devices)

    @property
    def unsupported(self) -> dict[tuple[str, str], str]:
        """(device UUID, reading) -> why it is no longer read."""
        with self._lock:
            return dict(self._calls.unsupported) if self._calls else {}

    def sample(self) -> list[Record]:
        """One record per sampled device now; [] without NVML or devices. A failed NVML read
        is recorded under ``counters["read_errors"]``, never raised."""
        with self._lock:
            if not self._open():
                return []
            return [self._sample_device(device) for device in self._devices]

    def start(self) -> None:
        """Start the sampler thread (a first sample at once) and the XID thread."""
        with self._lock:
            if self._threads or not self._open():
                return
            self._stop.clear()
            self._wake.clear()
            event_set = self._open_event_set()
            if event_set is not None:
                self._spawn("runhealth-nvml-xid", self._run_xids, event_set)
            self._spawn("runhealth-nvml-sampler", self._run_sampler)

    def stop(self) -> None:
        """Stop both threads, hand over XIDs not yet sampled, and release NVML."""
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(self.config.stop_timeout_s)
        stuck = any(thread.is_alive() for thread in self._threads)
        self._threads = []
        self._flush_xids()
        if not stuck:  # never shut NVML down under a thread still inside it
            self._close()

    def _flush_xids(self) -> None:
        """XIDs that arrived after the last sample go out in one more sample of their device."""
        with self._lock:
            if self._calls is None:
                return
            pending = [device for device in self._devices if self._xids.has(device.uuid)]
            records = [self._sample_device(device) for device in pending]
        self._emit(records)

    # -- opening and closing NVML --

    def _open(self) -> bool:
        if self._calls is not None:
            return True
        if self._unavailable is not None:
            return False
        nvml = self._import()
        if nvml is None:
            return False
        calls = _Calls(nvml)
        if not self._init(calls):
            return False
        self._devices = self._select(calls)
        if not self._devices:
            self._shutdown(calls)
            return self._give_up(logging.INFO, "no visible GPU matches this process's device")
        self._calls = calls
        self._warn_if_order_ambiguous(calls)
        return True

    def _import(self) -> Any:
        if self._nvml_module is not None:
            return self._nvml_module
        try:
            self._nvml_module = importlib.import_module("pynvml")
        except ImportError as error:
            self._give_up(logging.INFO, f"pynvml (nvidia-ml-py) cannot be imported: {error}")
            return None
        return self._nvml_module

    def _init(self, calls: _Calls) -> bool:
        absent = tuple(_error_class(calls.nvml, name) for name in _ABSENT_ERRORS)
        try:
            calls.nvml.nvmlInit()
        except absent as error:
            return self._give_up(logging.INFO, f"NVML is not available here ({error})")
        except Exception as error:  # NoPermission, Unknown, a broken install: still not fatal
            return self._give_up(logging.WARNING, f"NVML failed to initialize ({error!r})")
        return True

    def _give_up(self, level: int, reason: str) -> bool:
        self._unavailable = reason
        logger.log(level, "%s; device samples are off in this process", reason)
        return False

    def _select(self, calls: _Calls) -> list[VisibleDevice]:
        visible = resolve_visible_devices(calls, self._cuda_visible_devices)
        if self._device_uuid is not None:
            wanted = _bare_uuid(self._device_uuid)
            return [device for device in visible if _bare_uuid(device.uuid) == wanted]
        if self._cuda_device is not None:
            in_range = 0 <= self._cuda_device < len(visible)
            return [visible[self._cuda_device]] if in_range else []
        return visible

    def _warn_if_order_ambiguous(self, calls: _Calls) -> None:
        """CUDA's default order is fastest first, NVML's is PCI bus order: integer indices
        agree only when the GPUs are identical or CUDA_DEVICE_ORDER=PCI_BUS_ID."""
        entries = parse_cuda_visible_devices(self._cuda_visible_devices)
        by_index = entries is None or any(entry.isdecimal() for entry in entries)
        if self._device_uuid is not None or not by_index or self._cuda_device_order == "PCI_BUS_ID":
            return
        names = {
            calls.call(uuid, "name", "nvmlDeviceGetName", handle) for uuid, handle in _enumerate_gpus(calls)
        }
        if len(names - {None}) > 1:
            self._say_once(
                "order",
                "NVML: GPUs of different models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA "
                "indices may not match NVML's; pass device_uuid to be sure of the rank's device",
            )

    def _close(self) -> None:
        with self._lock:
            if self._calls is not None:
                self._shutdown(self._calls)
            self._calls = None
            self._devices = []

    def _shutdown(self, calls: _Calls) -> None:
        try:
            calls.nvml.nvmlShutdown()
        except Exception as error:  # shutting down must not break the trainer's exit
            logger.debug("NVML shutdown failed: %r", error)

    # -- sampling --

    def _sample_device(self, device: VisibleDevice) -> Record:
        assert self._calls is not None
        now = self._clock()
        errors: dict[str, str] = {}
        scalars, counters = read_device(self._calls, device, errors)
        xids, dropped = self._xids.drain(device.uuid)
        if dropped:
            counters["xids_dropped"] = dropped
        if errors:
            counters["read_errors"] = errors
        return protocol.build(
            protocol.DEVICE_SAMPLE,
            node=self._node,
            device_uuid=device.uuid,
            seq=self._next_seq(device.uuid, now),
            time=float(now),
            rank=self._rank if self._rank is not None and self._owns_rank() else None,
            **scalars,
            counters=counters or None,
            xids=xids or None,
        )

    def _next_seq(self, uuid: str, now: float) -> int:
        # The store keys samples by (run, node, device, seq) with no incarnation, so a restarted
        # reader must not reuse numbers: seq counts microseconds, never less than last + 1.
        seq = max(self._last_seq.get(uuid, -1) + 1, int(now * 1_000_000))
        self._last_seq[uuid] = seq
        return seq

    def _owns_rank(self) -> bool:
        explicit = self._cuda_device is not None or self._device_uuid is not None
        return explicit or len(self._devices) == 1

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run_sampler(self) -> None:
        while not self._stop.is_set():
            try:
                self._emit(self.sample())
            except Exception as error:  # a reader bug must not kill the thread or the trainer
                self._say_once("sampler", f"NVML: sampling failed: {error!r} (said once)")
            self._wake.wait(self.config.interval_s)
            self._wake.clear()

    def _emit(self, records: list[Record]) -> None:
        for record in records:
            try:
                self._sink(record)
            except Exception as error:
                message = f"NVML: sink raised {error!r}; record dropped (said once)"
                self._say_once("sink", message)

    def _say_once(self, topic: str, message: str) -> None:
        if topic not in self._said:
            self._said.add(topic)
            logger.warning(message)

    # -- XID events --

    def _open_event_set(self) -> Any:
        assert self._calls is not None
        calls, xid = self._calls, self._calls.constant("nvmlEventTypeXidCriticalError")
        ok, event_set = calls.attempt("", "xid_events", "nvmlEventSetCreate")
        if xid is None or not ok:
            return None
        gpus = {device.gpu_uuid: device.handle for device in self._devices}
        self._event_gpus = {
            uuid: handle
            for uuid, handle in gpus.items()
            if calls.attempt(uuid, "xid_events", "nvmlDeviceRegisterEvents", handle, xid, event_set)[0]
        }
        if self._event_gpus:
            return event_set
        calls.attempt("", "xid_events_free", "nvmlEventSetFree", event_set)
        return None

    def _run_xids(self, event_set: Any) -> None:
        assert self._calls is not None
        calls = self._calls
        try:
            while not self._stop.is_set():
                try:
                    event = calls.nvml.nvmlEventSetWait(event_set, self.config.xid_wait_ms)
                except calls.timeout:
                    continue
                except Exception as error:  # back off rather than spin on a broken event set
                    self._say_once("xid", f"NVML: event wait failed: {error!r} (said once)")
                    self._stop.wait(self.config.xid_wait_ms / 1000)
                    continue
                self._on_event(event)
        finally:
            calls.attempt("", "xid_events_free", "nvmlEventSetFree", event_set)

    def _on_event(self, event: Any) -> None:
        calls = self._calls
        if calls is None or not event.eventType & calls.constant("nvmlEventTypeXidCriticalError"):
            return
        gpu_uuid = self._event_gpu(calls, event)
        xid: Record = {"code": int(event.eventData), "time": float(self._clock())}
        targets = [device for device in self._devices if device.gpu_uuid == gpu_uuid]
        if not targets:  # rare and important: every one is logged, none is misattributed
            logger.warning("NVML: XID %s from a device not sampled here: %s", xid["code"], gpu_uuid)
        for device in targets:
            self._xids.add(device.uuid, _with_instance(xid, device, event))
        self._wake.set()  # an XID is urgent evidence: sample now rather than at the next tick

    def _event_gpu(self, calls: _Calls, event: Any) -> str | None:
        if len(self._event_gpus) == 1:
            return next(iter(self._event_gpus))
        try:
            return str(calls.nvml.nvmlDeviceGetUUID(event.device))
        except Exception:  # an unknown handle: reported by the caller, never raised
            return None


def _with_instance(xid: Record, device: VisibleDevice, event: Any) -> Record:
    """A MIG device's XID names the GPU and compute instance it came from."""
    if device.uuid == device.gpu_uuid:
        return dict(xid)
    return {
        **xid,
        "gpu_instance_id": int(getattr(event, "gpuInstanceId", 0xFFFFFFFF)),
        "compute_instance_id": int(getattr(event, "computeInstanceId", 0xFFFFFFFF)),
    }


# --- describe: everything readable, for a device-check script -------------------------------

_STATIC_READINGS: tuple[tuple[str, str], ...] = (
    ("name", "nvmlDeviceGetName"),
    ("nvml_index", "nvmlDeviceGetIndex"),
    ("serial", "nvmlDeviceGetSerial"),
    ("pci", "nvmlDeviceGetPciInfo"),
    ("memory", "nvmlDeviceGetMemoryInfo"),
    ("ecc_mode", "nvmlDeviceGetEccMode"),
    ("mig_mode", "nvmlDeviceGetMigMode"),
    ("vbios_version", "nvmlDeviceGetVbiosVersion"),
    ("supported_clocks_event_reasons", "nvmlDeviceGetSupportedClocksEventReasons"),
    ("supported_event_types", "nvmlDeviceGetSupportedEventTypes"),
)


def describe(nvml: Any = None, environ: Mapping[str, str] | None = None) -> Record:
    """Everything the reader can read about every visible device, as plain JSON-able data."""
    reader = NvmlReader(lambda record: None, nvml=nvml, environ=environ)
    try:
        samples = reader.sample()
        calls = reader._calls
        if calls is None:
            return {"available": False, "reason": reader.unavailable_reason}
        devices = [
            _describe_device(calls, device, sample)
            for device, sample in zip(reader.devices, samples, strict=True)
        ]
        return {
            "available": True,
            "driver_version": _plain(calls.call("", "driver", "nvmlSystemGetDriverVersion")),
            "nvml_version": _plain(calls.call("", "nvml", "nvmlSystemGetNVMLVersion")),
            "cuda_visible_devices": reader._cuda_visible_devices,
            "devices": devices,
        }
    finally:
        reader.stop()


def _describe_device(calls: _Calls, device: VisibleDevice, sample: Record) -> Record:
    static = {key: _plain(calls.call(device.uuid, key, fn, device.handle)) for key, fn in _STATIC_READINGS}
    xid = calls.constant("nvmlEventTypeXidCriticalError") or 0
    return {
        "uuid": device.uuid,
        "gpu_uuid": device.gpu_uuid,
        "cuda_index": device.cuda_index,
        **static,
        "xid_events_supported": bool((static["supported_event_types"] or 0) & xid),
        "raw_clock_event_fields": _raw_fields(calls, device),
        "sample": sample,
        "not_read": {key: why for (uuid, key), why in calls.unsupported.items() if uuid == device.uuid},
    }


def _raw_fields(calls: _Calls, device: VisibleDevice) -> list[Record]:
    """The clock-event field values as NVML returns them, to check ids and types on hardware."""
    ids = [(name, calls.constant(c)) for name, c in CLOCK_EVENT_FIELDS if calls.constant(c) is not None]
    values = calls.call(
        device.uuid, "raw_fields", "nvmlDeviceGetFieldValues", device.handle, [i for _, i in ids]
    )
    return [
        {
            "name": name,
            "field_id": field_id,
            "return": int(value.nvmlReturn),
            "value_type": int(value.valueType),
            "ull": int(value.value.ullVal),
        }
        for (name, field_id), value in zip(ids, values or (), strict=False)
    ]


def _plain(value: Any) -> Any:
    """ctypes structures and bytes from pynvml as dicts and strings."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    fields = getattr(value, "_fields_", None)
    if fields is not None:
        return {name: _plain(getattr(value, name)) for name, *_ in fields}
    return value
