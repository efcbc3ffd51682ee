"""A compiling rank's CPU use (``collectors/cpu_use.py``): read from ``/proc`` for the process
tree, and turned into the ``cpu_busy_at`` its heartbeats carry."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from collectors.cpu_use import CompileActivity, process_tree_cpu_s
from tests.collectors_support import RecordingTransport, wait_until

LINUX = sys.platform.startswith("linux")


def own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


@pytest.mark.skipif(not LINUX, reason="/proc is Linux's")
def test_the_cpu_of_a_live_grandchild_is_counted(tmp_path: Path) -> None:
    """A worker pool's process (a child) whose worker (a grandchild) burns CPU, as Inductor's
    compile workers do: the tree's CPU grows by a second while this process's own barely does."""
    burner = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])"
    before, own_before = process_tree_cpu_s(), own_cpu_s()
    assert before is not None
    child = subprocess.Popen([sys.executable, "-c", burner], start_new_session=True)
    try:
        assert wait_until(lambda: (process_tree_cpu_s() or 0.0) - before >= 1.0, 60.0)
        assert own_cpu_s() - own_before < 0.5
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the child and its grandchild, by the group's PID
        child.wait()


def test_stat_lines_are_read_past_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    """``/proc/PID/stat``'s second field is the command name in parentheses, which may hold
    both; utime, stime, cutime and cstime are fields 14 to 17. A fake ``/proc`` of a process
    with one child whose own child exited between the two reads."""
    ticks = os.sysconf("SC_CLK_TCK")

    def process(pid: int, name: str, times: tuple[int, int, int, int], children: str = "") -> None:
        task = tmp_path / str(pid) / "task" / str(pid)
        task.mkdir(parents=True)
        rest = ["S", "1", "1", "1", "0", "-1", "0", "0", "0", "0", "0", *map(str, times), "20", "0"]
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) {' '.join(rest)}\n")
        (task / "children").write_text(children)

    process(100, "python ) train (x", (3 * ticks, ticks, 0, 2 * ticks), children="200 ")
    process(200, "worker", (ticks, 0, 0, 0), children="300")  # 300 has no entry: it exited
    assert process_tree_cpu_s(100, proc=tmp_path) == pytest.approx(7.0)
    assert process_tree_cpu_s(999, proc=tmp_path) is None
    (tmp_path / "100" / "stat").write_text("100 (truncated")  # not a stat line: cannot say
    assert process_tree_cpu_s(100, proc=tmp_path) is None


class CpuReadings:
    def __init__(self) -> None:
        self.value: float | None = 0.0

    def __call__(self) -> float | None:
        return self.value


def test_a_compile_is_busy_while_its_processes_use_a_quarter_of_a_core() -> None:
    cpu = CpuReadings()
    activity = CompileActivity(cpu)
    assert activity.busy_at(False, 10.0, 11.0) is None  # not compiling: nothing said
    assert activity.busy_at(True, 10.0, 12.0) == 10.0  # the compile's start counts as busy
    cpu.value = 1.26  # 0.252 cores over the next 5 s
    assert activity.busy_at(True, 10.0, 17.0) == 17.0
    cpu.value = 2.5  # 0.248 cores
    assert activity.busy_at(True, 10.0, 22.0) == 17.0
    assert activity.busy_at(True, 10.0, 27.0) == 17.0  # idle
    assert activity.busy_at(True, 40.0, 41.0) == 40.0  # the next compilation starts afresh
    cpu.value = None
    assert activity.busy_at(True, 40.0, 46.0) is None  # this platform cannot say


def test_a_failing_cpu_reading_leaves_the_heartbeat_without_it_from_then_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = []

    def broken() -> float:
        calls.append(1)
        raise PermissionError("/proc/1/stat")

    activity = CompileActivity(broken)
    assert activity.busy_at(True, 10.0, 12.0) is None and activity.busy_at(True, 10.0, 17.0) is None
    assert len(calls) == 1 and "reading the process tree's CPU use failed" in caplog.text


@pytest.mark.skipif(not LINUX, reason="/proc is Linux's")
@pytest.mark.parametrize("backend_works", [True, False], ids=["working", "hung"])
def test_compiling_heartbeats_say_whether_the_compiler_uses_cpu(tmp_path: Path, backend_works: bool) -> None:
    """A ``torch.compile`` backend that computes for 1.5 s (a compiler at work) and one that
    waits for 1.5 s (a compile that hangs): the heartbeats in between say ``compiling`` both
    times, with a ``cpu_busy_at`` that keeps up with them only for the first (the second's
    falls a second behind while it waits; Dynamo's own work after it is busy again)."""
    import torch
    import torch._dynamo

    from tests.test_collectors_hook import compiled_and_attached, lm_loss

    torch._dynamo.reset()
    transport = RecordingTransport()

    def backend(graph: Any, _inputs: Any) -> Any:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            if not backend_works:
                threading.Event().wait(0.05)
        return graph.forward

    with compiled_and_attached(tmp_path, transport, backend, heartbeat_s=0.1) as (rh, compiled):
        rh.window_start()
        rh.loss(lm_loss(compiled, torch.randint(0, 32, (2, 9))), tokens=16)
        rh.window_end()
    torch._dynamo.reset()
    beats = [b for b in transport.records("heartbeat") if b["phase"] == "compiling"]
    assert len(beats) >= 5 and all("cpu_busy_at" in b for b in beats)
    idle = max(b["time"] - b["cpu_busy_at"] for b in beats)
    if backend_works:
        assert idle < 0.6
    else:
        assert idle > 1.0
    others = [b for b in transport.records("heartbeat") if b["phase"] != "compiling"]
    assert others and not any("cpu_busy_at" in b for b in others)
