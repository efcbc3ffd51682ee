"""The NVML reader against a fake ``pynvml``: the module object it is given, faked at the
narrowest point (only the functions, constants and exception classes the reader calls), and
checked against the real nvidia-ml-py so the fake cannot drift from the API it stands for."""

from __future__ import annotations

import ctypes
import inspect
import logging
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from collectors.nvml import NvmlReader, describe, parse_cuda_visible_devices
from monitor.ingest.schemas import DeviceSampleIn

ROOT = Path(__file__).resolve().parents[1]


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # named as pynvml names them
    pass


class NVMLError_FunctionNotFound(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_InvalidArgument(NVMLError):
    pass


class NVMLError_NotFound(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


SW_POWER_CAP, SYNC_BOOST, SW_THERM, HW_THERM, HW_BRAKE = 74, 76, 269, 270, 271
NVLINK_REPLAY, NVLINK_RECOVERY, NVLINK_CRC = 161, 162, 163  # asked per link: (field id, link)


@dataclass
class FakeGpu:
    """One GPU's readings; ``unsupported``/``missing``/``lost`` name functions that raise
    NotSupported / FunctionNotFound / GpuIsLost on it."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    power_mw: int = 612_345
    nvlink_states: tuple[int, ...] = (1, 1, 0)  # link 3 (of 4) is past the device's last
    fields: dict[int, int] = field(
        default_factory=lambda: {
            SW_POWER_CAP: 5_000,
            SYNC_BOOST: 0,
            SW_THERM: 7,
            HW_THERM: 0,
            HW_BRAKE: 0,
        }
    )
    field_types: dict[int, int] = field(default_factory=dict)
    # (field id, link) -> value of the per-link NVLink fields; absent: the driver answers
    # NOT_SUPPORTED, as on every GPU before NVLink 5 here. Unsigned int, as NVML types them.
    link_fields: dict[tuple[int, int], int] = field(default_factory=dict)
    # (error type, counter type) -> ECC count; None: 10 * counter type + error type
    ecc_counts: dict[tuple[int, int], int] | None = None
    remapped_rows: tuple[int, int, int, int] = (2, 1, 1, 0)  # corrected, uncorrected, pending, failure
    unsupported: set[str] = field(default_factory=set)
    missing: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)


@dataclass
class FakeMig:
    uuid: str
    parent: FakeGpu


class FakeNvml:
    """The slice of pynvml the reader uses. Counts every call as (function, device UUID)."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVML_SUCCESS = 0
    NVML_ERROR_INVALID_ARGUMENT = 2
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_VALUE_TYPE_UNSIGNED_INT = 1
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
    NVML_FEATURE_ENABLED = 1
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_NVLINK_MAX_LINKS = 4  # the real binding says 36; four keeps the fake small
    NVML_NVLINK_ERROR_DL_REPLAY = 0
    NVML_NVLINK_ERROR_DL_RECOVERY = 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
    NVML_NVLINK_ERROR_DL_CRC_DATA = 3
    NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY = NVLINK_REPLAY
    NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY = NVLINK_RECOVERY
    NVML_FI_DEV_NVLINK_ERROR_DL_CRC = NVLINK_CRC
    NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP = SW_POWER_CAP
    NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST = SYNC_BOOST
    NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN = SW_THERM
    NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN = HW_THERM
    NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN = HW_BRAKE
    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, gpus: list[FakeGpu], migs: tuple[FakeMig, ...] = (), init_error: Any = None) -> None:
        self.gpus, self.migs, self.init_error = gpus, migs, init_error
        self.calls: Counter[tuple[str, str]] = Counter()
        self.field_requests: list[list[Any]] = []  # ids, or (id, scope) pairs for per-link fields
        self.events: queue.Queue[SimpleNamespace] = queue.Queue()
        self.registered: list[str] = []

    def _on(self, function: str, gpu: FakeGpu | None = None) -> None:
        self.calls[(function, gpu.uuid if gpu else "")] += 1
        if gpu and function in gpu.unsupported:
            raise NVMLError_NotSupported()
        if gpu and function in gpu.missing:
            raise NVMLError_FunctionNotFound()
        if gpu and function in gpu.lost:
            raise NVMLError_GpuIsLost()

    def count(self, function: str, gpu: FakeGpu) -> int:
        return self.calls[(function, gpu.uuid)]

    def nvmlInit(self) -> None:
        self._on("nvmlInit")
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self._on("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu | FakeMig:
        devices: list[FakeGpu | FakeMig] = [*self.gpus, *self.migs]
        for device in devices:
            if device.uuid == uuid:
                return device
        raise NVMLError_NotFound()

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, mig: FakeMig) -> FakeGpu:
        return mig.parent

    def nvmlDeviceGetUUID(self, handle: FakeGpu | FakeMig) -> str:
        return handle.uuid

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        return gpu.name

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        self._on("nvmlDeviceGetCurrentClocksEventReasons", gpu)
        return 0x4  # SW power cap

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu: FakeGpu) -> int:
        self._on("nvmlDeviceGetCurrentClocksThrottleReasons", gpu)
        return 0x20  # SW thermal slowdown

    def nvmlDeviceGetClockInfo(self, gpu: FakeGpu, clock: int) -> int:
        self._on("nvmlDeviceGetClockInfo", gpu)
        return {1: 1980, 2: 2619}[clock]

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        self._on("nvmlDeviceGetPowerUsage", gpu)
        return gpu.power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: FakeGpu) -> int:
        self._on("nvmlDeviceGetEnforcedPowerLimit", gpu)
        return 700_000

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        self._on("nvmlDeviceGetTemperature", gpu)
        return 61

    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, error_type: int, counter_type: int) -> int:
        self._on("nvmlDeviceGetTotalEccErrors", gpu)
        if gpu.ecc_counts is not None:
            return gpu.ecc_counts.get((error_type, counter_type), 0)
        return 10 * counter_type + error_type  # volatile: 0/1, aggregate: 10/11

    def nvmlDeviceGetRemappedRows(self, gpu: FakeGpu) -> tuple[int, int, int, int]:
        self._on("nvmlDeviceGetRemappedRows", gpu)
        return gpu.remapped_rows

    def nvmlDeviceGetPcieReplayCounter(self, gpu: FakeGpu) -> int:
        self._on("nvmlDeviceGetPcieReplayCounter", gpu)
        return 3

    def nvmlDeviceGetNvLinkState(self, gpu: FakeGpu, link: int) -> int:
        self._on(f"nvmlDeviceGetNvLinkState.{link}", gpu)
        if link >= len(gpu.nvlink_states):
            raise NVMLError_InvalidArgument()
        return gpu.nvlink_states[link]

    def nvmlDeviceGetNvLinkErrorCounter(self, gpu: FakeGpu, link: int, counter: int) -> int:
        self._on(f"nvmlDeviceGetNvLinkErrorCounter.{link}", gpu)
        return 100 * link + counter

    def nvmlDeviceGetFieldValues(self, gpu: FakeGpu, field_ids: list[Any]) -> list[SimpleNamespace]:
        self._on("nvmlDeviceGetFieldValues", gpu)
        self.field_requests.append(list(field_ids))
        return [self._field(gpu, field_id) for field_id in field_ids]

    def _field(self, gpu: FakeGpu, field_id: Any) -> SimpleNamespace:
        if isinstance(field_id, tuple):  # (field id, scope id): pynvml's form for a scoped field
            known, value = field_id in gpu.link_fields, gpu.link_fields.get(field_id, 0)
            return SimpleNamespace(
                fieldId=field_id[0],
                scopeId=field_id[1],
                nvmlReturn=0 if known else 3,
                valueType=1,
                value=SimpleNamespace(uiVal=value),
            )
        known = field_id in gpu.fields
        return SimpleNamespace(
            fieldId=field_id,
            nvmlReturn=0 if known else 3,
            valueType=gpu.field_types.get(field_id, 3),
            value=SimpleNamespace(ullVal=gpu.fields.get(field_id, 0)),
        )

    def clock_field_requests(self) -> list[list[int]]:
        """The requests of unscoped fields (the clock-event times)."""
        return [ids for ids in self.field_requests if all(isinstance(i, int) for i in ids)]

    def nvmlEventSetCreate(self) -> str:
        self._on("nvmlEventSetCreate")
        return "event-set"

    def nvmlDeviceRegisterEvents(self, gpu: FakeGpu, event_types: int, event_set: str) -> None:
        self._on("nvmlDeviceRegisterEvents", gpu)
        self.registered.append(gpu.uuid)

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        self._on("nvmlEventSetWait")
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError_Timeout() from None

    def nvmlEventSetFree(self, event_set: str) -> None:
        self._on("nvmlEventSetFree")

    def xid(self, gpu: FakeGpu, code: int) -> None:
        self.events.put(SimpleNamespace(device=gpu, eventType=0x8, eventData=code))


def gpu(letter: str, **kwargs: Any) -> FakeGpu:
    return FakeGpu(uuid=f"GPU-{letter * 8}-0000-1111-2222-333333333333", **kwargs)


def reader(nvml: Any, environ: dict[str, str] | None = None, **kwargs: Any) -> NvmlReader:
    return NvmlReader(
        kwargs.pop("sink", lambda record: None),
        kwargs.pop("config", None),
        nvml=nvml,
        environ=environ or {},
        node="node-7",
        **kwargs,
    )


def valid(record: dict[str, Any]) -> dict[str, Any]:
    DeviceSampleIn.model_validate(record)
    return record


def nvml_lines(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "collectors.nvml" and r.levelno >= level]


@pytest.fixture
def caplog_nvml(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="collectors.nvml")
    return caplog


def wait_for(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


# --- the fake is the real API, narrowed ----------------------------------------------------


def test_fake_exposes_only_names_real_pynvml_has_with_the_same_values() -> None:
    import pynvml

    public = [name for name in vars(FakeNvml) if name.startswith(("nvml", "NVML"))]
    assert public, "the fake exposes nothing"
    for name in public:
        assert hasattr(pynvml, name), f"pynvml has no {name}"
        ours = vars(FakeNvml)[name]
        if isinstance(ours, int) and name != "NVML_NVLINK_MAX_LINKS":
            assert getattr(pynvml, name) == ours, name
        elif callable(ours) and not isinstance(ours, type):
            ours_args = list(inspect.signature(ours).parameters)[1:]
            real_args = [
                p.name
                for p in inspect.signature(getattr(pynvml, name)).parameters.values()
                if p.default is inspect.Parameter.empty
            ]
            assert len(ours_args) == len(real_args), f"{name}: {ours_args} vs {real_args}"


# --- one sample: every reading, in the wire format -------------------------------------------


def test_a_sample_carries_every_reading_and_validates() -> None:
    nvml = FakeNvml([gpu("a")])
    [record] = reader(nvml, rank=3).sample()
    valid(record)
    assert record["kind"] == "device_sample" and record["node"] == "node-7"
    assert record["device_uuid"] == nvml.gpus[0].uuid and record["rank"] == 3
    assert record["clock_event_reasons"] == 0x4
    assert (record["sm_clock_mhz"], record["mem_clock_mhz"]) == (1980.0, 2619.0)
    assert record["power_w"] == pytest.approx(612.345) and record["power_limit_w"] == 700.0
    assert record["temperature_c"] == 61.0
    counters = record["counters"]
    assert counters["clock_event_ns"] == {
        "sw_power_cap": 5_000,
        "sync_boost": 0,
        "sw_thermal_slowdown": 7,
        "hw_thermal_slowdown": 0,
        "hw_power_brake_slowdown": 0,
    }
    assert counters["ecc"] == {
        "volatile": {"corrected": 0, "uncorrected": 1},
        "aggregate": {"corrected": 10, "uncorrected": 11},
    }
    assert counters["remapped_rows"] == {
        "corrected": 2,
        "uncorrected": 1,
        "pending": True,
        "failure": False,
    }
    assert counters["pcie_replay"] == 3
    assert "xids" not in record and "read_errors" not in counters


def test_nvlink_counters_only_for_active_links() -> None:
    nvml = FakeNvml([gpu("a", nvlink_states=(1, 0, 1))])
    rh = reader(nvml)
    for _ in range(3):
        [record] = rh.sample()
        valid(record)
        assert record["counters"]["nvlink"] == {
            "0": {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3},
            "2": {"replay": 200, "recovery": 201, "crc_flit": 202, "crc_data": 203},
        }
    a = nvml.gpus[0]
    assert nvml.count("nvmlDeviceGetNvLinkErrorCounter.1", a) == 0  # the inactive link
    assert nvml.count("nvmlDeviceGetNvLinkState.1", a) == 3  # asked again: links come up
    assert nvml.count("nvmlDeviceGetNvLinkState.3", a) == 1  # past the last link: once


def test_nvlink_5_counters_come_from_per_link_field_values() -> None:
    """GB200: the legacy error counter is not supported; each active link's replay, recovery
    and CRC counts are field values asked with the link as scope, all links in one call."""
    legacy = {f"nvmlDeviceGetNvLinkErrorCounter.{link}" for link in range(4)}
    fields = {(field_id, link): 10 * link + offset for link in (0, 2)
              for offset, field_id in enumerate((NVLINK_REPLAY, NVLINK_RECOVERY, NVLINK_CRC))}  # fmt: skip
    a = gpu("a", nvlink_states=(1, 0, 1), unsupported=legacy, link_fields=fields)
    nvml = FakeNvml([a])
    rh = reader(nvml)
    for _ in range(2):
        [record] = rh.sample()
        assert valid(record)["counters"]["nvlink"] == {
            "0": {"replay": 0, "recovery": 1, "crc": 2},
            "2": {"replay": 20, "recovery": 21, "crc": 22},
        }
        assert "read_errors" not in record["counters"]
    scoped = [ids for ids in nvml.field_requests if ids not in nvml.clock_field_requests()]
    assert (
        scoped == [[(f, link) for link in (0, 2) for f in (NVLINK_REPLAY, NVLINK_RECOVERY, NVLINK_CRC)]] * 2
    )
    assert all(nvml.count(name, a) == 0 for name in legacy)  # never asked: the fields answered


def test_nvlink_fields_unanswered_fall_back_to_the_legacy_counter_and_are_not_asked_again() -> None:
    nvml = FakeNvml([gpu("a", nvlink_states=(1, 1))])
    rh = reader(nvml)
    for _ in range(3):
        assert valid(rh.sample()[0])["counters"]["nvlink"]["1"] == {
            "replay": 100,
            "recovery": 101,
            "crc_flit": 102,
            "crc_data": 103,
        }
    assert len(nvml.field_requests) - len(nvml.clock_field_requests()) == 1  # the first sample only
    assert (nvml.gpus[0].uuid, "nvlink_fields") in rh.unsupported


def test_every_nvlink_counter_the_reader_writes_is_one_the_service_judges() -> None:
    from collectors.nvml import NVLINK_COUNTERS, NVLINK_FIELDS
    from policies.devices import device_signal_of

    for name, _ in (*NVLINK_FIELDS, *NVLINK_COUNTERS):
        assert device_signal_of(f"nvlink.0.{name}") is not None, name


def test_seq_increases_per_device_and_past_a_restart() -> None:
    nvml = FakeNvml([gpu("a"), gpu("b")])
    stalled = reader(nvml, clock=lambda: 1_000.0)
    seqs = [[r["seq"] for r in stalled.sample()] for _ in range(3)]
    for device in range(2):
        column = [row[device] for row in seqs]
        assert column == sorted(set(column)) and len(column) == 3
    restarted = reader(nvml, clock=lambda: 1_001.0)
    assert all(r["seq"] > max(max(row) for row in seqs) for r in restarted.sample())


def test_a_read_error_is_reported_and_asked_again() -> None:
    nvml = FakeNvml([gpu("a", lost={"nvmlDeviceGetPowerUsage"})])
    rh = reader(nvml)
    records = [valid(rh.sample()[0]) for _ in range(2)]
    assert all("power_w" not in r for r in records)
    assert records[1]["counters"]["read_errors"] == {"power_w": "NVMLError_GpuIsLost"}
    assert nvml.count("nvmlDeviceGetPowerUsage", nvml.gpus[0]) == 2


# --- which device: CUDA_VISIBLE_DEVICES ------------------------------------------------------


def test_cuda_visible_devices_by_index_maps_cuda_to_nvml_order() -> None:
    nvml = FakeNvml([gpu("a"), gpu("b"), gpu("c")])
    environ = {"CUDA_VISIBLE_DEVICES": "2,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    [first] = reader(nvml, environ, cuda_device=0, rank=8).sample()
    [second] = reader(nvml, environ, cuda_device=1, rank=9).sample()
    assert (first["device_uuid"], first["rank"]) == (nvml.gpus[2].uuid, 8)
    assert (second["device_uuid"], second["rank"]) == (nvml.gpus[0].uuid, 9)


def test_cuda_visible_devices_by_uuid_and_unique_prefix() -> None:
    nvml = FakeNvml([gpu("a"), gpu("b"), gpu("c")])
    environ = {"CUDA_VISIBLE_DEVICES": f"GPU-cccc,{nvml.gpus[1].uuid}"}
    records = reader(nvml, environ).sample()
    assert [r["device_uuid"] for r in records] == [nvml.gpus[2].uuid, nvml.gpus[1].uuid]
    assert all("rank" not in valid(r) for r in records)  # no rank: not one rank's device


def test_an_entry_naming_no_device_hides_the_rest(caplog_nvml: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml([gpu("a"), gpu("b")])
    environ = {"CUDA_VISIBLE_DEVICES": "1,7,0"}
    assert [r["device_uuid"] for r in reader(nvml, environ).sample()] == [nvml.gpus[1].uuid]
    assert reader(nvml, environ, cuda_device=1).sample() == []
    ambiguous = {"CUDA_VISIBLE_DEVICES": "GPU-,1"}  # a prefix of both GPUs names neither
    assert reader(nvml, ambiguous).sample() == []


def test_no_visible_device_says_so_once(caplog_nvml: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml([gpu("a")])
    rh = reader(nvml, {"CUDA_VISIBLE_DEVICES": ""})
    assert [rh.sample() for _ in range(3)] == [[], [], []]
    assert len(nvml_lines(caplog_nvml)) == 1
    assert nvml.calls[("nvmlInit", "")] == 1 and nvml.calls[("nvmlShutdown", "")] == 1


def test_device_uuid_as_torch_reports_it_picks_the_rank_device() -> None:
    nvml = FakeNvml([gpu("a"), gpu("b")])
    bare = nvml.gpus[1].uuid.removeprefix("GPU-")
    [record] = reader(nvml, device_uuid=bare, rank=1).sample()
    assert (record["device_uuid"], record["rank"]) == (nvml.gpus[1].uuid, 1)


def test_a_mig_device_is_keyed_by_its_uuid_and_read_on_its_gpu() -> None:
    parent = gpu("a", power_mw=300_000)
    mig = FakeMig("MIG-1234abcd-0000-1111-2222-333333333333", parent)
    nvml = FakeNvml([parent], (mig,))
    rh = reader(nvml, {"CUDA_VISIBLE_DEVICES": mig.uuid}, cuda_device=0, rank=0)
    [record] = rh.sample()
    assert record["device_uuid"] == mig.uuid and valid(record)["power_w"] == 300.0
    assert rh.devices[0].gpu_uuid == parent.uuid


def test_different_gpu_models_without_pci_bus_order_warn_once(
    caplog_nvml: pytest.LogCaptureFixture,
) -> None:
    nvml = FakeNvml([gpu("a"), gpu("b", name="NVIDIA L4")])
    reader(nvml, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, cuda_device=1).sample()
    assert nvml_lines(caplog_nvml, logging.WARNING) == []
    rh = reader(nvml, {}, cuda_device=1)
    rh.sample()
    rh.sample()
    [warning] = nvml_lines(caplog_nvml, logging.WARNING)
    assert "CUDA_DEVICE_ORDER" in warning


def test_parse_cuda_visible_devices() -> None:
    assert parse_cuda_visible_devices(None) is None
    assert parse_cuda_visible_devices("") == [] and parse_cuda_visible_devices(" ") == []
    assert parse_cuda_visible_devices(" 0, GPU-ab ,MIG-1") == ["0", "GPU-ab", "MIG-1"]


# --- what a device lacks is skipped once and remembered --------------------------------------


def test_an_unsupported_reading_is_asked_once_and_not_logged_again(
    caplog_nvml: pytest.LogCaptureFixture,
) -> None:
    a = gpu("a", unsupported={"nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetRemappedRows"})
    del a.fields[SW_THERM]  # the driver answers this field NOT_SUPPORTED
    nvml = FakeNvml([a])
    rh = reader(nvml)
    records = [valid(rh.sample()[0]) for _ in range(4)]
    assert nvml.count("nvmlDeviceGetPcieReplayCounter", a) == 1
    assert nvml.count("nvmlDeviceGetRemappedRows", a) == 1
    clock_requests = nvml.clock_field_requests()
    assert SW_THERM in clock_requests[0]
    assert all(SW_THERM not in ids and SW_POWER_CAP in ids for ids in clock_requests[1:])
    assert all("pcie_replay" not in r["counters"] for r in records)
    assert "sw_thermal_slowdown" not in records[-1]["counters"]["clock_event_ns"]
    assert set(rh.unsupported) >= {
        (a.uuid, "pcie_replay"),
        (a.uuid, "remapped_rows"),
        (a.uuid, "clock_event_ns.sw_thermal_slowdown"),
    }
    lines = nvml_lines(caplog_nvml)  # one debug line per reading given up, over four samples
    assert len(lines) == len(set(lines)) == len(rh.unsupported)
    assert nvml_lines(caplog_nvml, logging.INFO) == []


def test_an_older_driver_falls_back_to_throttle_reasons() -> None:
    a = gpu("a", missing={"nvmlDeviceGetCurrentClocksEventReasons"})
    nvml = FakeNvml([a])
    rh = reader(nvml)
    reasons = [valid(rh.sample()[0])["clock_event_reasons"] for _ in range(3)]
    assert reasons == [0x20] * 3
    assert nvml.count("nvmlDeviceGetCurrentClocksEventReasons", a) == 1
    assert nvml.count("nvmlDeviceGetCurrentClocksThrottleReasons", a) == 3


def test_a_field_answered_with_another_type_is_refused_with_one_warning(
    caplog_nvml: pytest.LogCaptureFixture,
) -> None:
    a = gpu("a", field_types={HW_THERM: 1})  # unsigned int: another field than the counter
    nvml = FakeNvml([a])
    rh = reader(nvml)
    for _ in range(3):
        assert "hw_thermal_slowdown" not in valid(rh.sample()[0])["counters"]["clock_event_ns"]
    [warning] = nvml_lines(caplog_nvml, logging.WARNING)
    assert "hw_thermal_slowdown" in warning


# --- without NVML: one line, then quiet --------------------------------------------------------


def test_without_the_library_one_log_line_and_quiet(caplog_nvml: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml([], init_error=NVMLError_LibraryNotFound())
    sunk: list[dict[str, Any]] = []
    rh = reader(nvml, sink=sunk.append)
    assert [rh.sample() for _ in range(3)] == [[], [], []]
    rh.start()
    rh.stop()
    assert not rh.available and sunk == []
    [line] = nvml_lines(caplog_nvml)
    assert "not available" in line
    assert nvml.calls[("nvmlInit", "")] == 1


def test_real_pynvml_without_libnvidia_ml(caplog_nvml: pytest.LogCaptureFixture) -> None:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        pass
    else:
        pytest.skip("libnvidia-ml is installed here: this test is for machines without it")
    import pynvml

    rh = reader(pynvml)
    assert rh.sample() == [] and rh.sample() == []
    rh.stop()
    [line] = nvml_lines(caplog_nvml)
    assert "NVML Shared Library Not Found" in line


def test_without_pynvml_installed_one_log_line(
    caplog_nvml: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    rh = reader(None)
    assert rh.sample() == [] and rh.sample() == []
    [line] = nvml_lines(caplog_nvml)
    assert "pynvml" in line


def test_importing_the_reader_does_not_import_pynvml() -> None:
    # The module file alone, so what the package's __init__ imports does not count here.
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('nvml_alone', 'collectors/nvml.py')\n"
        "module = sys.modules['nvml_alone'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "sys.exit('pynvml' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, check=False)
    assert result.returncode == 0, result.stderr.decode()


# --- the threads: sampling and XID events ------------------------------------------------------


@pytest.fixture
def running() -> Iterator[Callable[..., NvmlReader]]:
    started: list[NvmlReader] = []

    def start(nvml: FakeNvml, **kwargs: Any) -> NvmlReader:
        rh = reader(nvml, **kwargs)
        rh.start()
        started.append(rh)
        return rh

    yield start
    for rh in started:
        rh.stop()


def test_an_xid_is_delivered_by_the_thread_at_once(running: Callable[..., NvmlReader]) -> None:
    nvml = FakeNvml([gpu("a"), gpu("b")])
    sunk: queue.Queue[dict[str, Any]] = queue.Queue()
    config = NvmlReader.Config(interval_s=60.0, xid_wait_ms=20)
    rh = running(nvml, sink=sunk.put, config=config, clock=lambda: 2_000.0)
    baseline = [sunk.get(timeout=3), sunk.get(timeout=3)]  # the first sample, at start
    assert all("xids" not in valid(r) for r in baseline)
    assert sorted(nvml.registered) == sorted(g.uuid for g in nvml.gpus)
    nvml.xid(nvml.gpus[1], 79)
    woken = [sunk.get(timeout=3), sunk.get(timeout=3)]  # long before the 60 s interval
    by_device = {r["device_uuid"]: valid(r) for r in woken}
    assert by_device[nvml.gpus[1].uuid]["xids"] == [{"code": 79, "time": 2_000.0}]
    assert "xids" not in by_device[nvml.gpus[0].uuid]
    rh.stop()
    assert not any(t.name.startswith("runhealth-nvml") for t in threading.enumerate())
    assert nvml.calls[("nvmlEventSetFree", "")] == 1 and nvml.calls[("nvmlShutdown", "")] == 1


def test_every_xid_of_a_storm_is_delivered_or_counted(running: Callable[..., NvmlReader]) -> None:
    nvml = FakeNvml([gpu("a")])
    sunk: list[dict[str, Any]] = []
    config = NvmlReader.Config(interval_s=60.0, xid_wait_ms=20, max_pending_xids=2)
    rh = running(nvml, sink=sunk.append, config=config)
    for code in range(40, 50):
        nvml.xid(nvml.gpus[0], code)
    wait_for(nvml.events.empty)
    rh.stop()  # hands over what arrived after the last sample
    delivered = [x["code"] for r in sunk for x in valid(r).get("xids", [])]
    dropped = sum(r.get("counters", {}).get("xids_dropped", 0) for r in sunk)
    assert len(delivered) + dropped == 10 and delivered == sorted(delivered)


def test_an_xid_after_the_last_sample_is_handed_over_at_stop(
    running: Callable[..., NvmlReader],
) -> None:
    nvml = FakeNvml([gpu("a")])
    sunk: list[dict[str, Any]] = []
    in_sink, release = threading.Event(), threading.Event()

    def slow_sink(record: dict[str, Any]) -> None:
        sunk.append(record)
        in_sink.set()
        release.wait(3)

    config = NvmlReader.Config(interval_s=60.0, xid_wait_ms=20)
    rh = running(nvml, sink=slow_sink, config=config)
    assert in_sink.wait(3)  # the sampler is held inside the sink with the first sample
    waits = nvml.calls[("nvmlEventSetWait", "")]
    nvml.xid(nvml.gpus[0], 48)
    wait_for(lambda: nvml.calls[("nvmlEventSetWait", "")] >= waits + 2)  # XID taken, buffered
    stopping = threading.Thread(target=rh.stop)
    stopping.start()
    wait_for(lambda: nvml.calls[("nvmlEventSetFree", "")] == 1)  # stop() is under way
    release.set()  # the sampler now sees the stop and exits without another sample
    stopping.join(3)
    baseline, flushed = (valid(r) for r in sunk)
    assert "xids" not in baseline and [x["code"] for x in flushed["xids"]] == [48]


def test_a_failing_sink_does_not_stop_sampling(
    running: Callable[..., NvmlReader], caplog_nvml: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    def sink(record: dict[str, Any]) -> None:
        calls.append(record["seq"])
        raise RuntimeError("spool full")

    running(FakeNvml([gpu("a")]), sink=sink, config=NvmlReader.Config(interval_s=0.01))
    wait_for(lambda: len(calls) >= 3)
    [warning] = nvml_lines(caplog_nvml, logging.WARNING)
    assert "spool full" in warning


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        NvmlReader.Config(interval_s=0)
    with pytest.raises(ValueError, match="max_pending_xids"):
        NvmlReader.Config(max_pending_xids=0)


# --- describe ----------------------------------------------------------------------------------


def test_describe_reports_every_device_and_what_it_lacks() -> None:
    nvml = FakeNvml([gpu("a"), gpu("b", unsupported={"nvmlDeviceGetPcieReplayCounter"})])
    found = describe(nvml, environ={})
    assert found["available"] is True
    first, second = found["devices"]
    assert (first["uuid"], first["name"], first["cuda_index"]) == (
        nvml.gpus[0].uuid,
        "NVIDIA H100 80GB HBM3",
        0,
    )
    valid(first["sample"])
    assert [f["name"] for f in first["raw_clock_event_fields"]][:2] == [
        "sw_power_cap",
        "sync_boost",
    ]
    assert "pcie_replay" in second["not_read"] and "pcie_replay" not in first["not_read"]
    assert nvml.calls[("nvmlShutdown", "")] == 1


def test_describe_without_nvml() -> None:
    found = describe(FakeNvml([], init_error=NVMLError_LibraryNotFound()), environ={})
    assert found["available"] is False and "not available" in found["reason"]
