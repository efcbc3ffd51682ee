"""The local spool on a real directory: append, replay in order, cursor, torn lines, the disk
limit, dead letters, and adoption of files a finished or crashed process left behind."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from collectors import RunHealth, RunHealthConfig
from collectors.counters import Counters
from collectors.sender import SenderConfig
from collectors.spool import Spool, SpoolConfig, SpoolFile
from collectors.transport import Delivery, Outcome, TransportConfig
from collectors.wire import Record
from tests.collectors_support import RecordingTransport
from tests.support import require_module


def records(start: int, count: int) -> list[dict[str, object]]:
    return [{"kind": "heartbeat", "n": n} for n in range(start, start + count)]


def spool(
    root: Path, name: str = "node.rank0.aaa", counters: Counters | None = None, **config: object
) -> Spool:
    settings = {"directory": str(root), "fsync": False, **config}
    return Spool(SpoolConfig(**settings), "run/1", name, counters or Counters())  # type: ignore[arg-type]


def replay_all(target: Spool) -> list[list[dict[str, object]]]:
    seen = []
    while (batch := target.head()) is not None:
        seen.append(batch.records)
        target.advance(batch)
    return seen


def test_batches_replay_in_order_and_the_file_starts_over(tmp_path: Path) -> None:
    counters = Counters()
    target = spool(tmp_path, counters=counters)
    assert target.directory == tmp_path / "run_1"  # a run name made file-name safe
    assert not target.backlog()
    assert target.append(records(0, 2)) and target.append(records(2, 3))
    assert target.backlog() and counters.snapshot()["spooled"] == 5
    first = target.head()
    assert first is not None and first.records == records(0, 2)
    assert target.head() == first  # not advanced: the same batch again
    target.advance(first)
    assert replay_all(target) == [records(2, 3)]
    assert not target.backlog() and target.path.stat().st_size == 0


def test_a_replayed_cursor_survives_a_restart(tmp_path: Path) -> None:
    first = spool(tmp_path)
    first.append(records(0, 1))
    first.append(records(1, 1))
    batch = first.head()
    assert batch is not None
    first.advance(batch)
    path = first.path
    first.close()  # the process ends with one batch still spooled
    assert path.exists()

    later = spool(tmp_path, name="node.rank0.bbb")  # a new incarnation of the same rank
    assert later.backlog()
    assert replay_all(later) == [records(1, 1)]
    later.close()
    assert not path.exists() and not list(tmp_path.glob("run_1/*.jsonl"))


def test_a_held_spool_is_not_adopted(tmp_path: Path) -> None:
    live = spool(tmp_path, name="node.rank1.aaa")
    live.append(records(0, 1))
    other = spool(tmp_path, name="node.rank0.aaa")
    assert not other.backlog()  # rank 1's process is alive and holds its file
    live.close()
    other.close()
    assert spool(tmp_path, name="node.rank0.bbb").backlog()


def test_a_torn_line_is_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "run_1" / "node.rank3.old.jsonl"
    path.parent.mkdir(parents=True)
    good = json.dumps({"records": records(0, 1)})
    path.write_text(f"{good}\nnot json\n{good}\n" + '{"records": [{"kind": "he')  # a write cut short
    counters = Counters()
    target = spool(tmp_path, counters=counters)
    assert replay_all(target) == [records(0, 1), records(0, 1)]
    assert counters.snapshot()["spool_unreadable"] == 2
    target.close()
    assert not path.exists()


def test_past_the_disk_limit_batches_are_dropped_and_counted(tmp_path: Path) -> None:
    counters = Counters()
    target = spool(tmp_path, counters=counters, max_bytes=4096)
    big = [{"kind": "heartbeat", "pad": "x" * 1000}]
    stored = sum(target.append(big) for _ in range(6))
    assert stored == 3
    assert counters.snapshot()["dropped"] == 3 and counters.snapshot()["spooled"] == 3
    assert len(replay_all(target)) == 3  # what was kept is intact


def test_dead_letters_keep_the_records_and_the_reason(tmp_path: Path) -> None:
    counters = Counters()
    target = spool(tmp_path, counters=counters)
    target.dead_letter(records(0, 2), "422 invalid_record: record 1: field 'loss_sum'", 422)
    (line,) = target.dead_letter_path.read_text().splitlines()
    entry = json.loads(line)
    assert entry["status"] == 422 and "loss_sum" in entry["reason"] and entry["records"] == records(0, 2)
    assert counters.snapshot()["dead_lettered"] == 2
    target.close()
    assert target.dead_letter_path.exists()  # never replayed, never removed
    assert not spool(tmp_path, name="other").backlog()


def test_one_process_holds_a_spool_file_exclusively(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    held = SpoolFile.open_locked(path)
    assert held is not None
    assert SpoolFile.open_locked(path) is None
    held.close(remove_if_empty=False)
    again = SpoolFile.open_locked(path)
    assert again is not None
    again.close(remove_if_empty=True)
    assert not path.exists()


def test_configuration_is_validated() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        SpoolConfig(max_bytes=10)
    with pytest.raises(ValueError, match="directory"):
        SpoolConfig(directory="")


class Outage(RecordingTransport):
    """Refuses every batch (the service is down) until ``up`` is set, then keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.up = False

    def post(self, records: Sequence[Record]) -> Delivery:
        if not self.up:
            return Delivery(Outcome.RETRY, None, "connection refused")
        return super().post(records)


def test_a_spool_directory_that_cannot_be_written_keeps_the_records_in_memory_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The spool's parent is a file (as unwritable as a read-only mount, even for root): the
    hook attaches anyway, sends directly, and what the service could not take while it was
    down waits in memory and is delivered once it is back; nothing is dropped."""
    require_module("torch")
    (tmp_path / "not-a-dir").write_text("a file where the spool directory should be")
    transport = Outage()
    config = RunHealthConfig(
        transport=TransportConfig(run="memory-spool"),
        spool=SpoolConfig(directory=str(tmp_path / "not-a-dir" / "spool")),
        sender=SenderConfig(flush_interval_s=0.05, heartbeat_interval_s=60.0, retry_initial_s=0.05),
    )
    with RunHealth(config=config, transport=transport, environ={}) as rh:
        for window in range(250):
            rh.window_start(sample_ids=[window])
            rh.loss(1.0, tokens=4)
            rh.window_end()
            if window == 150:
                transport.up = True
    steps = transport.records("step")
    assert sorted(s["attempt"] for s in steps) == list(range(1, 251))
    assert rh.counters["dropped"] == 0 and rh.counters["hook_errors"] == 0
    said = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(said) == 1 and "sending directly" in said[0].getMessage()


def test_a_disk_that_fills_mid_run_keeps_the_batches_in_memory_in_order_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The disk refuses the spool's writes (ENOSPC: the first one half written, then none):
    those batches wait in memory behind what the file holds, nothing is lost or torn, it is
    said once, and once memory has drained the file takes batches again."""
    counters = Counters()
    target = spool(tmp_path, counters=counters)
    own_fd = target._own._fd  # the narrowest point: this file's write calls
    real_write = os.write
    full = {"on": False, "calls": 0}

    def write(fd: int, data: bytes) -> int:
        if fd != own_fd or not full["on"]:
            return real_write(fd, data)
        full["calls"] += 1
        if full["calls"] == 1:
            return real_write(fd, data[:7])  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write)
    assert target.append(records(0, 2))
    full["on"] = True
    assert target.append(records(2, 2)) and target.append(records(4, 1))
    assert target.path.read_bytes().count(b"\n") == 1  # the half-written line was taken back
    assert sum("cannot be written" in r.message for r in caplog.records) == 1
    assert counters.snapshot()["spooled"] == 5 and counters.snapshot().get("dropped", 0) == 0
    full["on"] = False
    assert target.append(records(5, 1))  # memory still holds batches: it waits behind them
    assert replay_all(target) == [records(0, 2), records(2, 2), records(4, 1), records(5, 1)]
    assert not target.backlog()
    assert target.append(records(6, 1)) and target.path.read_bytes().count(b"\n") == 1  # the file again
    assert counters.snapshot().get("spool_unreadable", 0) == 0
