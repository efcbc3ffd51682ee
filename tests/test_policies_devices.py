"""Device and link policies over records shaped as collectors/nvml.py and collectors/links.py
write them (validated against the ingest schema), at each rule's boundaries."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from monitor.ingest.schemas import DeviceSampleIn, LinkSampleIn
from monitor.judge.readings import device_reading, link_reading
from policies.devices import (
    ClockConfig,
    CounterRates,
    DeviceReading,
    DevicesConfig,
    LinkReading,
    PeerConfig,
    SignalLimit,
    carry_forward,
    clock_event_fractions,
    counter_deltas,
    device_findings,
    device_peer_findings,
    device_rates,
    device_signal_of,
    elevated_clock_reasons,
    link_findings,
    link_peer_findings,
    link_rates,
    peer_judgements,
    peer_outliers,
    signal_rates,
    xid_findings,
)
from policies.types import Finding, Severity

CONFIG = DevicesConfig()
T0 = 1_700_000_000.0
UUID = "GPU-5b1e2c3d-9a8b-4c7d-8e6f-001122334455"
REASONS = (
    "sw_power_cap",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
)


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for name in parents:
        tree = tree.setdefault(name, {})
    tree[leaf] = value


def device_record(
    t: float,
    changes: Mapping[str, Any] | None = None,
    *,
    node: str = "node-1",
    uuid: str = UUID,
    rank: int | None = 0,
    xids: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """A device_sample as NvmlReader emits it: four active NVLinks, every counter at zero
    unless ``changes`` (dotted paths under ``counters``) says otherwise."""
    counters: dict[str, Any] = {
        "clock_event_ns": dict.fromkeys(REASONS, 0),
        "ecc": {
            "volatile": {"corrected": 0, "uncorrected": 0},
            "aggregate": {"corrected": 0, "uncorrected": 0},
        },
        "remapped_rows": {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False},
        "nvlink": {str(i): {"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0} for i in range(4)},
        "pcie_replay": 0,
    }
    for path, value in (changes or {}).items():
        _put(counters, path, value)
    record: dict[str, Any] = {
        "kind": "device_sample",
        "node": node,
        "device_uuid": uuid,
        "seq": int(t * 1_000_000),
        "time": t,
        "clock_event_reasons": 0,
        "sm_clock_mhz": 1980.0,
        "mem_clock_mhz": 2619.0,
        "power_w": 650.0,
        "power_limit_w": 700.0,
        "temperature_c": 61.0,
        "counters": counters,
    }
    if rank is not None:
        record["rank"] = rank
    if xids:
        record["xids"] = list(xids)
    DeviceSampleIn.model_validate(record)
    return record


def device(t: float, changes: Mapping[str, Any] | None = None, **kwargs: Any) -> DeviceReading:
    return device_reading(device_record(t, changes, **kwargs))


def link_record(
    t: float,
    changes: Mapping[str, Any] | None = None,
    *,
    node: str = "node-1",
    name: str = "mlx5_0",
    port: int = 1,
    state: str | None = "ACTIVE",
    saturated: Sequence[str] = (),
) -> dict[str, Any]:
    """A link_sample as LinkReader emits it."""
    counters: dict[str, Any] = {
        "symbol_error": 0,
        "link_error_recovery": 0,
        "link_downed": 0,
        "port_rcv_errors": 0,
        "port_xmit_discards": 0,
        "port_xmit_data": 4_000_000_000,
        "port_rcv_data": 4_000_000_000,
        "hw": {"rx_icrc_encapsulated": 0, "out_of_sequence": 0},
    }
    for path, value in (changes or {}).items():
        _put(counters, path, value)
    record: dict[str, Any] = {
        "kind": "link_sample",
        "node": node,
        "device": name,
        "port": port,
        "seq": int(t * 1_000_000),
        "time": t,
        "counters": counters,
    }
    if state is not None:
        record["state"] = state
    if saturated:
        record["saturated"] = list(saturated)
    LinkSampleIn.model_validate(record)
    return record


def link(t: float, changes: Mapping[str, Any] | None = None, **kwargs: Any) -> LinkReading:
    return link_reading(link_record(t, changes, **kwargs))


def kinds(found: Sequence[Finding]) -> list[tuple[str, Severity]]:
    return [(f.kind, f.severity) for f in found]


# --- readings ----------------------------------------------------------------------------------------


def test_a_device_reading_flattens_counters_and_keeps_flags_xids_and_errors_apart() -> None:
    record = device_record(T0, {"nvlink.2.replay": 7, "read_errors": {"pcie_replay": "NVMLError_Unknown"}})
    record["counters"]["xids_dropped"] = 2
    record["xids"] = [{"code": 79, "time": T0 - 1}, {"code": 94, "time": T0, "gpu_instance_id": 1}]
    reading = device_reading(record)
    assert (reading.node, reading.device, reading.rank, reading.seq) == ("node-1", UUID, 0, int(T0 * 1e6))
    assert reading.counters["nvlink.2.replay"] == 7
    assert reading.counters["clock_event_ns.hw_thermal_slowdown"] == 0
    assert "remapped_rows.pending" not in reading.counters  # a flag, not a counter
    assert reading.remap_pending is False and reading.remap_failure is False
    assert not any(name.startswith(("read_errors", "xids_dropped")) for name in reading.counters)
    assert reading.read_errors == {"pcie_replay": "NVMLError_Unknown"}
    assert reading.xids_dropped == 2
    assert [(x.code, x.gpu_instance_id) for x in reading.xids] == [(79, None), (94, 1)]
    assert reading.temperature_c == 61.0


def test_a_device_without_any_optional_field_reads_as_unknowns() -> None:
    record = {"kind": "device_sample", "node": "n", "device_uuid": "GPU-x", "seq": 5, "time": T0}
    DeviceSampleIn.model_validate(record)
    reading = device_reading(record)
    assert (reading.counters, reading.xids, reading.rank, reading.remap_pending) == ({}, (), None, None)
    assert device_findings(None, reading, CONFIG) == ()
    assert device_findings(reading, device_reading({**record, "seq": 6, "time": T0 + 1}), CONFIG) == ()


def test_malformed_values_are_left_out_rather_than_trusted() -> None:
    record = device_record(T0, {"pcie_replay": -3, "ecc.volatile.corrected": "7", "nvlink.0.crc_flit": 1.0})
    record["xids"] = [{"time": T0}, {"code": "13"}, {"code": 48}]
    reading = device_reading(record)
    assert "pcie_replay" not in reading.counters and "ecc.volatile.corrected" not in reading.counters
    assert reading.counters["nvlink.0.crc_flit"] == 1
    assert [x.code for x in reading.xids] == [48]
    assert device_reading({}).device == ""


def test_a_link_reading_keeps_hw_counters_by_prefix_and_the_saturated_names() -> None:
    reading = link(T0, {"symbol_error": 65535}, saturated=["symbol_error", "hw.out_of_sequence"])
    assert reading.name == "mlx5_0/1"
    assert reading.counters["hw.rx_icrc_encapsulated"] == 0
    assert reading.saturated == {"symbol_error", "hw.out_of_sequence"}
    assert link_reading({"node": "n"}).state is None


# --- deltas and rates ----------------------------------------------------------------------------


def test_rates_are_increments_over_the_interval_per_second() -> None:
    before = device(T0, {"nvlink.0.crc_flit": 100, "nvlink.1.crc_data": 50, "pcie_replay": 3})
    after = device(T0 + 10, {"nvlink.0.crc_flit": 600, "nvlink.1.crc_data": 550, "pcie_replay": 4})
    rates = device_rates(before, after)
    assert rates.interval_s == pytest.approx(10.0)
    assert rates.rate("nvlink.0.crc_flit") == pytest.approx(50.0)
    assert rates.rate("pcie_replay") == pytest.approx(0.1)
    assert rates.resets == frozenset() and rates.unknown == frozenset()
    signals = signal_rates(rates, device_signal_of)
    assert signals["nvlink_crc"] == pytest.approx(100.0)  # crc_flit + crc_data over the links
    assert signals["nvlink_replay"] == 0.0 and signals["ecc_corrected"] == 0.0


def test_a_counter_that_went_down_was_reset_and_counts_from_zero() -> None:
    before = device(T0, {"nvlink.0.replay": 900, "ecc.volatile.corrected": 40})
    after = device(T0 + 10, {"nvlink.0.replay": 2, "ecc.volatile.corrected": 40})  # driver reloaded
    rates = device_rates(before, after)
    assert rates.increments["nvlink.0.replay"] == 2  # never a negative rate
    assert rates.resets == {"nvlink.0.replay"}
    assert rates.increments["ecc.volatile.corrected"] == 0


def test_a_counter_without_a_baseline_or_saturated_has_no_rate_rather_than_zero() -> None:
    increments, resets, unknown = counter_deltas({"a": 1}, {"a": 3, "b": 5, "c": 65535}, frozenset({"c"}))
    assert increments == {"a": 2} and resets == frozenset() and unknown == {"b", "c"}
    before = link(T0, {"symbol_error": 65535}, saturated=["symbol_error"])
    after = link(T0 + 60, {"symbol_error": 65535, "link_downed": 1}, saturated=["symbol_error"])
    rates = link_rates(before, after)
    assert rates.rate("symbol_error") is None and "symbol_error" in rates.unknown
    assert rates.rate("link_downed") == pytest.approx(1 / 60)
    cleared = link(T0 + 120, {"symbol_error": 4})  # perfquery -R, then 4 new errors
    assert link_rates(after, cleared).increments["symbol_error"] == 4


def test_readings_out_of_order_give_no_rates() -> None:
    newer, older = device(T0 + 10, {"pcie_replay": 9}), device(T0, {"pcie_replay": 1})
    for rates in (device_rates(newer, older), device_rates(newer, newer)):
        assert rates.interval_s == 0 and rates.increments == {} and rates.rate("pcie_replay") is None
    assert link_rates(link(T0 + 10), link(T0)).interval_s == 0


def test_carry_forward_keeps_a_counter_across_a_failed_read() -> None:
    first = device(T0, {"ecc.aggregate.uncorrected": 2})
    gap_record = device_record(T0 + 10)
    del gap_record["counters"]["ecc"]["aggregate"]  # that read failed this time
    gap = device_reading(gap_record)
    kept = carry_forward(first, gap)
    assert kept.counters["ecc.aggregate.uncorrected"] == 2 and kept.seq == gap.seq
    later = device(T0 + 20, {"ecc.aggregate.uncorrected": 3})
    assert kinds(device_findings(kept, later, CONFIG)) == [("device_ecc", Severity.CRITICAL)]
    assert carry_forward(None, first) is first and carry_forward(later, first) is later


# --- ECC and row remapping ---------------------------------------------------------------------------


def test_ecc_history_on_the_first_reading_is_one_warning_not_critical() -> None:
    assert device_findings(None, device(T0), CONFIG) == ()
    (finding,) = device_findings(None, device(T0, {"ecc.aggregate.uncorrected": 3}), CONFIG)
    assert (finding.kind, finding.severity, finding.evidence["history"]) == (
        "device_ecc",
        Severity.WARNING,
        True,
    )
    assert finding.evidence["counts"] == {"ecc.aggregate.uncorrected": 3}
    assert (finding.node, finding.device, finding.rank) == ("node-1", UUID, 0)
    assert device_findings(None, device(T0, {"remapped_rows.uncorrected": 2}), CONFIG) == ()  # serviceable
    following = device(T0 + 10, {"ecc.aggregate.uncorrected": 3})
    assert device_findings(device(T0, {"ecc.aggregate.uncorrected": 3}), following, CONFIG) == ()


@pytest.mark.parametrize(
    "counter", ["ecc.volatile.uncorrected", "ecc.aggregate.uncorrected", "remapped_rows.uncorrected"]
)
def test_a_new_uncorrected_error_is_critical_at_plus_one(counter: str) -> None:
    before = device(T0, {counter: 4})
    assert device_findings(before, device(T0 + 10, {counter: 4}), CONFIG) == ()  # just under: no change
    (finding,) = device_findings(before, device(T0 + 10, {counter: 5}), CONFIG, step=120, incarnation="inc")
    assert (finding.kind, finding.severity, finding.step, finding.incarnation) == (
        "device_ecc",
        Severity.CRITICAL,
        120,
        "inc",
    )
    assert finding.evidence["new"] == {counter: 1}


def test_volatile_counters_reset_on_driver_reload_without_a_false_alarm() -> None:
    before = device(T0, {"ecc.volatile.uncorrected": 3, "ecc.aggregate.uncorrected": 3})
    reloaded = device(T0 + 10, {"ecc.volatile.uncorrected": 0, "ecc.aggregate.uncorrected": 3})
    assert device_findings(before, reloaded, CONFIG) == ()
    # 3 -> 1 across a reload: one error since the driver came back, and the aggregate agrees.
    after = device(T0 + 10, {"ecc.volatile.uncorrected": 1, "ecc.aggregate.uncorrected": 4})
    (finding,) = device_findings(before, after, CONFIG)
    assert finding.severity is Severity.CRITICAL
    assert finding.evidence["new"] == {"ecc.volatile.uncorrected": 1, "ecc.aggregate.uncorrected": 1}
    assert finding.evidence["resets"] == ["ecc.volatile.uncorrected"]


def test_a_pending_remap_or_a_remap_failure_is_critical_once() -> None:
    healthy = device(T0)
    pending = device(T0 + 10, {"remapped_rows.pending": True, "remapped_rows.uncorrected": 1})
    found = device_findings(healthy, pending, CONFIG)
    assert sorted(f.signal for f in found) == ["ecc.uncorrected", "remapped_rows.pending"]
    assert all(f.severity is Severity.CRITICAL for f in found)
    still = device(T0 + 20, {"remapped_rows.pending": True, "remapped_rows.uncorrected": 1})
    assert device_findings(pending, still, CONFIG) == ()
    (first_sight,) = device_findings(None, device(T0, {"remapped_rows.failure": True}), CONFIG)
    assert (first_sight.signal, first_sight.severity) == ("remapped_rows.failure", Severity.CRITICAL)


def test_a_lost_gpu_is_critical_when_it_is_first_lost() -> None:
    lost = device(T0 + 10, {"read_errors": {"ecc.volatile.corrected": "NVMLError_GpuIsLost"}})
    (finding,) = device_findings(device(T0), lost, CONFIG)
    assert (finding.kind, finding.severity) == ("device_lost", Severity.CRITICAL)
    again = device(T0 + 20, {"read_errors": {"pcie_replay": "NVMLError_GpuIsLost"}})
    assert device_findings(lost, again, CONFIG) == ()
    other = device(T0 + 10, {"read_errors": {"pcie_replay": "NVMLError_Unknown"}})
    assert device_findings(device(T0), other, CONFIG) == ()


# --- XIDs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [13, 31, 43, 45])
def test_application_xids_are_info_and_say_they_are_not_hardware(code: int) -> None:
    (finding,) = xid_findings(device(T0, xids=[{"code": code, "time": T0}]), CONFIG)
    assert (finding.kind, finding.severity, finding.evidence["cause"]) == (
        "device_xid",
        Severity.INFO,
        "application",
    )
    assert "not a hardware fault" in finding.message


@pytest.mark.parametrize(
    ("code", "severity", "cause"),
    [
        (48, Severity.CRITICAL, "hardware"),
        (64, Severity.CRITICAL, "hardware"),
        (74, Severity.CRITICAL, "hardware"),
        (79, Severity.CRITICAL, "hardware"),
        (94, Severity.CRITICAL, "hardware"),
        (95, Severity.CRITICAL, "hardware"),
        (63, Severity.WARNING, "hardware"),
        (92, Severity.WARNING, "hardware"),
        (119, Severity.CRITICAL, "device"),
    ],
)
def test_hardware_xids_are_judged_by_the_catalog(code: int, severity: Severity, cause: str) -> None:
    (finding,) = device_findings(device(T0), device(T0 + 10, xids=[{"code": code, "time": T0 + 9}]), CONFIG)
    assert (finding.severity, finding.evidence["cause"], finding.value) == (severity, cause, float(code))
    assert (finding.node, finding.device, finding.rank) == ("node-1", UUID, 0)
    assert finding.evidence["times"] == [T0 + 9] and finding.evidence["action"]


def test_an_unknown_xid_is_a_warning_pointing_at_the_catalog() -> None:
    (finding,) = xid_findings(device(T0, xids=[{"code": 999, "time": T0}]), CONFIG)
    assert (finding.severity, finding.evidence["cause"]) == (Severity.WARNING, "unknown")
    assert "unknown XID 999" in finding.message and "xid-errors" in finding.message


def test_xids_are_grouped_per_code_critical_first_with_their_mig_instance() -> None:
    xids = [
        {"code": 45, "time": T0},
        {"code": 45, "time": T0 + 0.1},
        {"code": 94, "time": T0 + 0.2, "gpu_instance_id": 2, "compute_instance_id": 0},
    ]
    found = xid_findings(device(T0 + 1, xids=xids), CONFIG)
    assert [(f.value, f.severity, f.evidence["count"]) for f in found] == [
        (94.0, Severity.CRITICAL, 1),
        (45.0, Severity.INFO, 2),
    ]
    assert found[0].evidence["mig_instances"] == [[2, 0]]


def test_dropped_xids_are_a_warning() -> None:
    record = device_record(T0)
    record["counters"]["xids_dropped"] = 3
    (finding,) = xid_findings(device_reading(record), CONFIG)
    assert (finding.signal, finding.severity, finding.value) == ("xids_dropped", Severity.WARNING, 3.0)


def test_a_late_reading_is_judged_on_its_xids_alone() -> None:
    newer = device(T0 + 20, {"ecc.volatile.uncorrected": 1})
    late = device(T0 + 10, {"remapped_rows.pending": True}, xids=[{"code": 79, "time": T0 + 9}])
    assert [f.value for f in device_findings(newer, late, CONFIG)] == [79.0]


def test_the_catalog_is_configuration() -> None:
    quiet = DevicesConfig(xid_catalog={}, unknown_xid_severity=Severity.INFO)
    (finding,) = xid_findings(device(T0, xids=[{"code": 79, "time": T0}]), quiet)
    assert finding.severity is Severity.INFO


# --- ports: state and saturation ---------------------------------------------------------------------


def test_a_port_that_leaves_active_is_a_warning_once() -> None:
    up, down = link(T0), link(T0 + 10, state="DOWN")
    (finding,) = link_findings(up, down, CONFIG)
    assert (finding.kind, finding.severity, finding.device, finding.node) == (
        "link_state",
        Severity.WARNING,
        "mlx5_0/1",
        "node-1",
    )
    assert "ACTIVE -> DOWN" in finding.message
    assert link_findings(down, link(T0 + 20, state="DOWN"), CONFIG) == ()
    assert link_findings(down, link(T0 + 30), CONFIG) == ()  # back up
    assert link_findings(up, link(T0 + 10, state="ACTIVE_DEFER"), CONFIG) == ()
    assert link_findings(up, link(T0 + 10, state=None), CONFIG) == ()


def test_a_port_down_at_first_sight_is_only_info() -> None:
    (finding,) = link_findings(None, link(T0, state="DOWN"), CONFIG)
    assert finding.severity is Severity.INFO
    assert link_findings(None, link(T0), CONFIG) == ()


def test_a_saturated_counter_is_reported_as_such_once() -> None:
    before = link(T0, {"symbol_error": 65000})
    after = link(
        T0 + 10,
        {"symbol_error": 65535, "hw.out_of_sequence": 2**32 - 1},
        saturated=["symbol_error", "hw.out_of_sequence"],
    )
    found = {f.signal: f for f in link_findings(before, after, CONFIG)}
    judged, other = found["symbol_error"], found["hw.out_of_sequence"]
    assert (judged.kind, judged.severity, judged.value) == ("counter_saturated", Severity.WARNING, 65535.0)
    assert "counter symbol_error on mlx5_0/1" in judged.message and "rate unknown" in judged.message
    assert "perfquery -R -C mlx5_0 -P 1" in judged.message
    assert other.severity is Severity.INFO and "perfquery cannot clear it" in other.message
    still = link(
        T0 + 20,
        {"symbol_error": 65535, "hw.out_of_sequence": 2**32 - 1},
        saturated=["symbol_error", "hw.out_of_sequence"],
    )
    assert link_findings(after, still, CONFIG) == ()
    assert [f.signal for f in link_findings(None, still, CONFIG)] == ["hw.out_of_sequence", "symbol_error"]


def test_a_late_port_sample_is_not_judged_again() -> None:
    assert link_findings(link(T0 + 10), link(T0, state="DOWN"), CONFIG) == ()


# --- peers -----------------------------------------------------------------------------------------


def test_an_outlier_must_be_above_ratio_times_the_peers_median() -> None:
    peers = {f"d{i}": v for i, v in enumerate([1.0, 1.0, 1.0, 1.0, 1.2, 0.8])}
    assert peer_outliers({**peers, "x": 10.0}, PeerConfig()) == ()  # just under: not above 10 x 1.0
    assert peer_outliers({**peers, "x": 10.01}, PeerConfig()) == ("x",)
    (verdict,) = peer_judgements({**peers, "x": 10.01}, PeerConfig())
    assert (verdict.peer_median, verdict.peers, verdict.bar) == (1.0, 6, 10.0)


def test_an_outlier_must_be_above_the_floor_when_peers_are_quiet() -> None:
    quiet = {f"d{i}": 0.0 for i in range(7)}
    assert peer_outliers({**quiet, "x": 100.0}, PeerConfig(), floor=100.0) == ()
    assert peer_outliers({**quiet, "x": 100.5}, PeerConfig(), floor=100.0) == ("x",)
    assert peer_judgements({**quiet, "x": 100.5}, PeerConfig(), floor=100.0)[0].z is None  # no spread


def test_an_outlier_must_be_out_of_its_peers_spread() -> None:
    config = PeerConfig(ratio=2.0)
    spread = {f"d{i}": v for i, v in enumerate([0.0, 1.0, 10.0, 20.0, 30.0])}  # median 10, MAD 10
    assert peer_outliers({**spread, "x": 21.0}, config) == ()  # above 2 x 10, but z = 0.7
    assert peer_outliers({**spread, "x": 84.0}, config) == ()  # z = 4.99
    assert peer_outliers({**spread, "x": 85.0}, config) == ("x",)  # z = 5.06


def test_with_one_or_two_peers_an_outlier_must_be_above_every_peer() -> None:
    assert peer_outliers({"a": 0.0, "b": 5.0}, PeerConfig()) == ("b",)
    assert peer_outliers({"a": 1.0, "b": 10.0}, PeerConfig()) == ()
    assert peer_outliers({"a": 1.0, "b": 10.5}, PeerConfig()) == ("b",)
    assert peer_outliers({"a": 1.0, "b": 2.0, "c": 20.0}, PeerConfig()) == ()
    assert peer_outliers({"a": 1.0, "b": 2.0, "c": 20.1}, PeerConfig()) == ("c",)
    assert peer_outliers({"a": 1.0, "b": 5.0, "c": 40.0}, PeerConfig()) == ()  # 40 > 10 x median, < 10 x max


def test_with_no_peer_nothing_is_an_outlier() -> None:
    assert peer_outliers({"a": 1e9}, PeerConfig()) == ()
    assert peer_outliers({}, PeerConfig()) == ()
    assert peer_outliers({"a": math.nan, "b": -1.0, "c": 1e9}, PeerConfig()) == ()


def test_two_failing_devices_do_not_hide_each_other() -> None:
    rates = {f"d{i}": 1.0 for i in range(6)} | {"x": 500.0, "y": 800.0}
    assert peer_outliers(rates, PeerConfig()) == ("x", "y")


@pytest.mark.parametrize("count", [8, 64, 65, 1024])
@pytest.mark.parametrize("seed", range(5))
def test_a_fleet_of_healthy_identical_devices_has_no_outlier(count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    noisy = {f"d{i}": float(v) for i, v in enumerate(rng.lognormal(0.0, 0.5, count))}
    assert peer_outliers(noisy, PeerConfig()) == ()
    counts = {f"d{i}": float(v) / 600 for i, v in enumerate(rng.poisson(3.0, count))}  # errors per 10 min
    assert peer_outliers(counts, PeerConfig(), floor=10 / 600) == ()


@pytest.mark.parametrize("count", [8, 64, 65, 1024])
def test_one_failing_device_stands_out_in_any_fleet(count: int) -> None:
    rng = np.random.default_rng(7)
    rates = {f"d{i:04d}": float(v) for i, v in enumerate(rng.lognormal(0.0, 0.5, count))}
    rates["d0003"] = 200.0
    assert peer_outliers(rates, PeerConfig()) == ("d0003",)


def nvlink_fleet(
    bad: Mapping[int, Mapping[str, int]], size: int = 8, span: float = 600.0
) -> list[CounterRates]:
    """Rates over a 10-minute comparison span of ``size`` devices, on two nodes; ``bad`` adds
    counts to some devices."""
    fleet = []
    for i in range(size):
        uuid, node = f"GPU-{i:08d}", f"node-{i // 4}"
        start = device(T0, uuid=uuid, node=node, rank=i)
        counts = {"nvlink.0.crc_flit": 60 * (1 + i % 3), **bad.get(i, {})}  # healthy: 0.1-0.3 CRC/s
        fleet.append(device_rates(start, device(T0 + span, counts, uuid=uuid, node=node, rank=i)))
    return fleet


def test_nvlink_crc_well_above_peers_is_a_warning_naming_the_device_and_link() -> None:
    (finding,) = device_peer_findings(nvlink_fleet({5: {"nvlink.2.crc_data": 120_000}}), CONFIG, step=40)
    assert (finding.kind, finding.severity, finding.signal) == (
        "device_error_rate",
        Severity.WARNING,
        "nvlink_crc",
    )
    assert (finding.node, finding.device, finding.rank, finding.step) == ("node-1", "GPU-00000005", 5, 40)
    assert finding.value == pytest.approx(200.3) and finding.threshold == pytest.approx(100.0)  # DCGM's floor
    assert next(iter(finding.evidence["counters"])) == "nvlink.2.crc_data"
    assert "evidence, not a diagnosis" in finding.message


def test_nvlink_crc_below_dcgm_100_per_second_is_not_a_warning_even_alone() -> None:
    assert device_peer_findings(nvlink_fleet({5: {"nvlink.2.crc_data": 59_000}}), CONFIG) == ()


@pytest.mark.parametrize("counter", ["nvlink.1.replay", "nvlink.3.recovery", "pcie_replay"])
def test_replays_and_recoveries_above_quiet_peers_are_warnings(counter: str) -> None:
    # PCIe: DCGM's 8 per minute; NVLink replay/recovery: any, when the peers had none.
    count = 81 if counter == "pcie_replay" else 1
    (finding,) = device_peer_findings(nvlink_fleet({2: {counter: count}}), CONFIG)
    assert (finding.device, finding.severity) == ("GPU-00000002", Severity.WARNING)
    if counter == "pcie_replay":
        assert device_peer_findings(nvlink_fleet({2: {counter: 80}}), CONFIG) == ()


def test_corrected_ecc_needs_more_than_one_a_minute_and_ten_in_the_span() -> None:
    assert device_peer_findings(nvlink_fleet({1: {"ecc.volatile.corrected": 10}}), CONFIG) == ()  # 1/min
    (finding,) = device_peer_findings(nvlink_fleet({1: {"ecc.volatile.corrected": 11}}), CONFIG)
    assert finding.signal == "ecc_corrected"
    short = {1: {"ecc.volatile.corrected": 9}}  # 1.8/min over 5 minutes, but only 9 errors
    assert device_peer_findings(nvlink_fleet(short, span=300.0), CONFIG) == ()
    assert (
        len(device_peer_findings(nvlink_fleet({1: {"ecc.volatile.corrected": 10}}, span=300.0), CONFIG)) == 1
    )


def test_device_rates_over_no_interval_take_no_part() -> None:
    stalled = device_rates(
        device(T0 + 10, uuid="GPU-z"), device(T0 + 10, {"nvlink.0.replay": 9}, uuid="GPU-z")
    )
    assert device_peer_findings([*nvlink_fleet({}), stalled], CONFIG) == ()


def port_fleet(
    bad: Mapping[int, Mapping[str, int]], saturated: Mapping[int, list[str]] | None = None
) -> list[CounterRates]:
    fleet = []
    for i in range(16):
        node = f"node-{i // 2}"
        name, port = f"mlx5_{i % 2}", 1
        counts = {"symbol_error": int(i % 4 == 1), **bad.get(i, {})}  # healthy: 0, a few 1, per span
        start = link(T0, node=node, name=name, port=port)
        end = link(T0 + 600, counts, node=node, name=name, port=port, saturated=(saturated or {}).get(i, []))
        fleet.append(link_rates(start, end))
    return fleet


def test_symbol_errors_need_ten_in_the_span_and_peers_well_below() -> None:
    assert link_peer_findings(port_fleet({}), CONFIG) == ()
    assert link_peer_findings(port_fleet({6: {"symbol_error": 9}}), CONFIG) == ()  # just under 10
    (finding,) = link_peer_findings(port_fleet({6: {"symbol_error": 10}}), CONFIG)
    assert (finding.kind, finding.signal, finding.severity) == (
        "link_error_rate",
        "symbol_error",
        Severity.WARNING,
    )
    assert (finding.node, finding.device) == ("node-3", "mlx5_0/1")


def test_a_link_downed_increment_with_quiet_peers_is_a_warning_never_critical() -> None:
    found = link_peer_findings(port_fleet({3: {"link_downed": 1, "link_error_recovery": 40}}), CONFIG)
    assert sorted(f.signal for f in found) == ["link_downed", "link_error_recovery"]
    assert {f.severity for f in found} == {Severity.WARNING}


def test_a_saturated_counter_never_reads_as_a_rate() -> None:
    saturated = port_fleet({4: {"symbol_error": 65535}}, saturated={4: ["symbol_error"]})
    assert link_peer_findings(saturated, CONFIG) == ()
    assert saturated[4].rate("symbol_error") is None


# --- clocks --------------------------------------------------------------------------------------------


def test_clock_event_fractions_are_delta_ns_over_wall_ns() -> None:
    before = device(
        T0, {"clock_event_ns.hw_thermal_slowdown": 10**9, "clock_event_ns.sw_power_cap": 5 * 10**9}
    )
    after = device(
        T0 + 10,
        {"clock_event_ns.hw_thermal_slowdown": 10**9 + 5 * 10**8, "clock_event_ns.sw_power_cap": 16 * 10**9},
    )
    fractions = clock_event_fractions(before, after)
    assert fractions["hw_thermal_slowdown"] == pytest.approx(0.05)
    assert fractions["sw_power_cap"] == 1.0  # 11 s in 10 s of wall time: sampling jitter, clipped
    assert fractions["sync_boost"] == 0.0
    reloaded = device(T0 + 10, {"clock_event_ns.hw_thermal_slowdown": 0})
    assert "hw_thermal_slowdown" not in clock_event_fractions(before, reloaded)
    assert clock_event_fractions(after, before) == {}
    assert clock_event_fractions(device_reading({}), after) == {}


def test_elevated_clock_reasons_against_peers_under_matched_work() -> None:
    config = ClockConfig()
    peers = [{"hw_thermal_slowdown": 0.0, "sw_power_cap": 0.4, "sync_boost": 0.0} for _ in range(3)]
    suspect = {"hw_thermal_slowdown": 0.3, "sw_power_cap": 0.55, "sync_boost": 0.9}
    (excess,) = elevated_clock_reasons(
        suspect, peers, config
    )  # power cap: 1.4x only; sync boost: not a cause
    assert (excess.reason, excess.fraction, excess.peer_median, excess.peers) == (
        "hw_thermal_slowdown",
        0.3,
        0.0,
        3,
    )
    assert elevated_clock_reasons({"hw_thermal_slowdown": 0.049}, peers, config) == ()
    assert len(elevated_clock_reasons({"hw_thermal_slowdown": 0.05}, peers, config)) == 1
    assert (
        len(elevated_clock_reasons({"hw_thermal_slowdown": 0.3}, peers[:1], config)) == 1
    )  # one peer suffices
    assert elevated_clock_reasons({"hw_thermal_slowdown": 0.3}, [], config) == ()


def test_largest_excess_first() -> None:
    found = elevated_clock_reasons(
        {"hw_thermal_slowdown": 0.2, "hw_power_brake_slowdown": 0.6}, [{}, {}], ClockConfig(min_peers=1)
    )
    assert found == ()  # peers without those counters are no baseline
    peers = [{"hw_thermal_slowdown": 0.0, "hw_power_brake_slowdown": 0.0}]
    found = elevated_clock_reasons(
        {"hw_thermal_slowdown": 0.2, "hw_power_brake_slowdown": 0.6}, peers, ClockConfig()
    )
    assert [e.reason for e in found] == ["hw_power_brake_slowdown", "hw_thermal_slowdown"]


# --- configuration ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: SignalLimit(floor_per_s=-1.0),
        lambda: SignalLimit(min_count=0),
        lambda: PeerConfig(ratio=1.0),
        lambda: PeerConfig(z=0.0),
        lambda: PeerConfig(min_peers_for_z=1),
        lambda: ClockConfig(min_excess=0.0),
        lambda: ClockConfig(ratio=0.5),
        lambda: DevicesConfig(active_states=frozenset()),
        lambda: DevicesConfig(device_limits={"nvlink_bogus": SignalLimit()}),
    ],
)
def test_invalid_configs_are_refused(build: Any) -> None:
    with pytest.raises(ValueError):
        build()


def test_the_defaults_are_the_cited_ones() -> None:
    assert CONFIG.device_limits["nvlink_crc"].floor_per_s == 100.0
    assert CONFIG.device_limits["pcie_replay"].floor_per_s == pytest.approx(8 / 60)
    assert CONFIG.link_limits["symbol_error"].min_count == 10
    assert copy.deepcopy(CONFIG) == CONFIG
