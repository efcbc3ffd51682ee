"""The link reader on a real directory tree laid out like /sys/class/infiniband."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from collectors.links import LinkReader, read_port
from monitor.ingest.schemas import LinkSampleIn

U8, U16, U32 = 0xFF, 0xFFFF, 0xFFFF_FFFF


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """Two HCAs: mlx5_0 (IB, two ports, an older driver's counters_ext/ on port 1) and
    mlx5_1 (RoCE, one port, hw_counters/ only besides counters/)."""
    p1, p2, roce = "mlx5_0/ports/1", "mlx5_0/ports/2", "mlx5_1/ports/1"
    root = write_tree(
        tmp_path / "infiniband",
        {
            "mlx5_0/node_guid": "0c42:a103:0012:3456",
            f"{p1}/state": "4: ACTIVE",
            f"{p1}/phys_state": "5: LinkUp",
            f"{p1}/counters/symbol_error": "12",
            f"{p1}/counters/link_downed": "1",
            f"{p1}/counters/link_error_recovery": str(U8),  # 8 bits wide: stuck
            f"{p1}/counters/port_rcv_errors": str(U16 - 1),  # one short of its maximum
            f"{p1}/counters/port_xmit_discards": str(U16),  # 16 bits wide: stuck
            f"{p1}/counters/port_xmit_data": str(U32),  # superseded by counters_ext
            f"{p1}/counters/port_rcv_data": "123",
            f"{p1}/counters/VL15_dropped": "N/A (no PMA)",
            f"{p1}/counters_ext/port_xmit_data_64": "99999999999",
            f"{p1}/counters_ext/port_rcv_data_64": "456",
            f"{p1}/counters_ext/port_unicast_rcv_packets": "789",
            f"{p1}/hw_counters/out_of_buffer": str(U32),  # 32 bits: stuck
            f"{p1}/hw_counters/rnr_nak_retry_err": "2",
            f"{p1}/hw_counters/lifespan": "10",  # a setting, not a counter
            f"{p2}/state": "1: DOWN",
            f"{p2}/counters/symbol_error": str(U16),
            f"{p2}/counters/link_downed": "7",
            f"{p2}/counters/port_rcv_packets": str(U32 + 5),  # the kernel served 64 bits
            f"{roce}/state": "4: ACTIVE",
            f"{roce}/counters/port_rcv_errors": "0",
            f"{roce}/counters/port_xmit_wait": str(U32),
            f"{roce}/hw_counters/out_of_sequence": "3",
            f"{roce}/hw_counters/np_cnp_sent": "44",
        },
    )
    (root / p1 / "counters" / "a_directory").mkdir()  # not a counter: skipped
    (root / "mlx5_0" / "ports" / "README").write_text("not a port\n")
    return root


def valid(record: dict[str, Any]) -> dict[str, Any]:
    LinkSampleIn.model_validate(record)
    return record


def by_port(records: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["device"], r["port"]): valid(r) for r in records}


def test_every_port_of_every_device_is_sampled_and_validates(sysfs: Path) -> None:
    records = LinkReader(lambda r: None, root=sysfs, node="node-3").sample()
    assert [(r["device"], r["port"]) for r in records] == [
        ("mlx5_0", 1),
        ("mlx5_0", 2),
        ("mlx5_1", 1),
    ]
    ports = by_port(records)
    first = ports[("mlx5_0", 1)]
    assert (first["kind"], first["node"], first["state"]) == ("link_sample", "node-3", "ACTIVE")
    assert ports[("mlx5_0", 2)]["state"] == "DOWN"
    counters = first["counters"]
    assert {key: counters[key] for key in ("symbol_error", "link_downed", "port_rcv_errors")} == {
        "symbol_error": 12,
        "link_downed": 1,
        "port_rcv_errors": U16 - 1,
    }
    assert counters["hw"] == {"out_of_buffer": U32, "rnr_nak_retry_err": 2}
    assert "VL15_dropped" not in counters and "a_directory" not in counters
    assert ports[("mlx5_1", 1)]["counters"] == {
        "port_rcv_errors": 0,
        "port_xmit_wait": U32,
        "hw": {"np_cnp_sent": 44, "out_of_sequence": 3},
    }


def test_counters_ext_supersedes_the_32_bit_counter(sysfs: Path) -> None:
    counters = read_port(sysfs / "mlx5_0/ports/1").counters
    assert counters["port_xmit_data"] == 99999999999
    assert counters["port_rcv_data"] == 456
    assert counters["port_unicast_rcv_packets"] == 789
    assert "port_xmit_data_64" not in counters


def test_a_counter_at_its_maximum_is_marked_saturated_by_its_width(sysfs: Path) -> None:
    ports = by_port(LinkReader(lambda r: None, root=sysfs).sample())
    assert ports[("mlx5_0", 1)]["saturated"] == [
        "link_error_recovery",
        "port_xmit_discards",
        "hw.out_of_buffer",
    ]
    assert ports[("mlx5_0", 2)]["saturated"] == ["symbol_error"]  # 64-bit packets: not stuck
    assert ports[("mlx5_1", 1)]["saturated"] == ["port_xmit_wait"]


def test_a_port_with_nothing_stuck_has_no_saturated_list(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"hfi1_0/ports/1/counters/symbol_error": "0"})
    [record] = LinkReader(lambda r: None, root=root).sample()
    assert "saturated" not in valid(record) and "state" not in record


def test_seq_increases_per_port_and_past_a_restart(sysfs: Path) -> None:
    stalled = LinkReader(lambda r: None, root=sysfs, clock=lambda: 500.0)
    rounds = [stalled.sample() for _ in range(3)]
    for column in zip(*rounds, strict=True):
        seqs = [r["seq"] for r in column]
        assert seqs == sorted(set(seqs))
    restarted = LinkReader(lambda r: None, root=sysfs, clock=lambda: 501.0)
    newest = max(r["seq"] for r in rounds[-1])
    assert all(r["seq"] > newest for r in restarted.sample())


def test_without_infiniband_one_log_line_and_quiet(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="collectors.links")
    sunk: list[dict[str, Any]] = []
    reader = LinkReader(sunk.append, LinkReader.Config(interval_s=0.01), root=tmp_path / "none")
    assert reader.sample() == [] and reader.sample() == []
    reader.start()
    assert not reader.running  # without ports no thread is started
    assert not any(t.name == "runhealth-links-sampler" for t in threading.enumerate())
    threading.Event().wait(0.05)
    reader.stop()
    assert sunk == []
    assert (
        reader.unavailable_reason
        == f"no InfiniBand/RoCE ports under {tmp_path / 'none'} (No such file or directory)"
    )
    [line] = [r.getMessage() for r in caplog.records if r.name == "collectors.links"]
    assert "link samples are off" in line


def test_the_thread_hands_records_to_the_sink_until_stopped(sysfs: Path) -> None:
    sunk: queue.Queue[dict[str, Any]] = queue.Queue()
    reader = LinkReader(sunk.put, LinkReader.Config(interval_s=0.01), root=sysfs)
    reader.start()
    assert reader.running and reader.unavailable_reason is None
    records = [valid(sunk.get(timeout=3)) for _ in range(6)]  # two rounds of three ports
    reader.stop()
    assert not reader.running
    assert {(r["device"], r["port"]) for r in records} == {
        ("mlx5_0", 1),
        ("mlx5_0", 2),
        ("mlx5_1", 1),
    }
    assert not any(t.name == "runhealth-links-sampler" for t in threading.enumerate())


def test_a_failing_sink_is_logged_once_and_sampling_goes_on(
    sysfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []
    done = threading.Event()

    def sink(record: dict[str, Any]) -> None:
        calls.append(record["port"])
        if len(calls) >= 6:
            done.set()
        raise OSError("spool disk full")

    reader = LinkReader(sink, LinkReader.Config(interval_s=0.01), root=sysfs)
    reader.start()
    assert done.wait(3)
    reader.stop()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "spool disk full" in warnings[0].getMessage()


@pytest.mark.parametrize("field", ["interval_s", "stop_timeout_s"])
def test_config_is_validated(field: str) -> None:
    make: Callable[..., LinkReader.Config] = LinkReader.Config
    with pytest.raises(ValueError, match=field):
        make(**{field: 0})
