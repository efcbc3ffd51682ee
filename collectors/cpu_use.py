"""Whether a compilation is at work: the CPU its process tree uses, read from the sender thread.

A compilation (``compiles.py``) may take many minutes, so the hang rule gives the ``compiling``
phase a save's timeout (30 minutes). A compiler at work keeps at least one core busy: TorchDynamo
and Inductor lower on the training thread, and Inductor's code generation and Triton's kernel
builds run in its worker processes, children of the trainer. A compilation that itself hangs (a
dead worker pool, a lock that is never released) uses next to none. So while a rank compiles,
each heartbeat says when the process and its live descendants last used CPU at a compiler's rate
(``cpu_busy_at``), and the rule names a compile idle for two minutes (``policies.hangs``).

Read on Linux from ``/proc`` (the process's own time, its waited-for children's, and each live
descendant's); elsewhere nothing is read and the heartbeats say nothing, leaving the 30 minutes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("runhealth.collectors")

# A quarter of a core over a heartbeat interval: a compiler uses a whole one; an idle trainer's
# own threads (the sender, the device readers) use a percent or two.
BUSY_CORES = 0.25
PROC = Path("/proc")


def process_tree_cpu_s(pid: int | None = None, proc: Path = PROC) -> float | None:
    """CPU seconds used by process ``pid`` (this one by default), its reaped children and every
    live descendant; None where ``/proc`` cannot say."""
    sysconf = getattr(os, "sysconf", None)
    if sysconf is None:  # Windows: no /proc either
        return None
    root = os.getpid() if pid is None else pid
    ticks = float(sysconf("SC_CLK_TCK"))
    total, pending, seen = 0.0, [root], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        used = _own_and_reaped_ticks(proc / str(current) / "stat")
        if used is None:
            if current == root:
                return None
            continue  # a descendant that exited between the two reads
        total += used
        pending.extend(_children(proc, current))
    return total / ticks


def _own_and_reaped_ticks(stat: Path) -> float | None:
    try:
        text = stat.read_text()
        # Fields after the command name (which may hold spaces and parentheses): utime is the
        # 14th field of the line, stime, cutime, cstime the next three.
        fields = text[text.rindex(")") + 2 :].split()
        return float(sum(int(value) for value in fields[11:15]))
    except (OSError, ValueError):  # gone, or a kernel whose line reads otherwise
        return None


def _children(proc: Path, pid: int) -> list[int]:
    """Every thread's children (``/proc/PID/task/TID/children``, Linux 3.5 and later)."""
    found: list[int] = []
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found.extend(int(child) for child in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return found


def _unreadable() -> None:
    return None


class CompileActivity:
    """The ``cpu_busy_at`` a compiling rank's heartbeat carries, kept on the sender thread.
    ``read_cpu_s``: the process tree's CPU seconds (``process_tree_cpu_s``), or None."""

    def __init__(self, read_cpu_s: Callable[[], float | None] = process_tree_cpu_s) -> None:
        self._read_cpu_s = read_cpu_s
        self._compile: float | None = None  # the phase start of the compilation being watched
        self._last: tuple[float, float] | None = None  # (time, cpu seconds) at the last beat
        self._busy_at: float | None = None

    def busy_at(self, compiling: bool, phase_since: float, now: float) -> float | None:
        """When the process tree last used CPU at a compiler's rate during this compilation
        (its start counts as busy); None when not compiling or the CPU cannot be read."""
        if not compiling:
            self._compile = self._last = None
            return None
        try:
            cpu = self._read_cpu_s()
        except Exception:  # the heartbeat must go out whatever /proc does
            log.exception("runhealth hook: reading the process tree's CPU use failed")
            self._read_cpu_s = _unreadable
            return None
        if cpu is None:
            return None
        if self._compile != phase_since or self._last is None:
            self._compile, self._busy_at = phase_since, phase_since
        else:
            since, used = self._last
            if now > since and (cpu - used) / (now - since) >= BUSY_CORES:
                self._busy_at = now
        self._last = (now, cpu)
        return self._busy_at
