"""Running the trainer for a drill: one process per rank, its output, signals and peak memory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from monitor.drills.convention import TrainerCommand


class RunFailed(Exception):
    """A trainer run of a drill that crashed or timed out: the drill reports it as a failed check."""


@dataclass(frozen=True)
class Finished:
    """How a run ended: exit codes per rank, wall seconds, peak resident memory per rank."""

    returncodes: tuple[int, ...]
    seconds: float
    peak_rss_mib: dict[int, float]
    killed: bool


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _peak_mib(pid: int) -> float | None:
    """VmHWM: the process's peak resident set so far (Linux), in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Job:
    """The trainer started on ``nproc`` ranks (torchrun's variables, as ``--standalone``)."""

    def __init__(
        self,
        command: TrainerCommand,
        fields: Mapping[str, Any],
        log: Path,
        nproc: int = 1,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        base = dict(os.environ if environ is None else environ)
        port = str(_free_port())
        self.argv = command.argv(fields)
        self.log = log
        self._handle: IO[bytes] = log.open("ab")
        self._handle.write(f"$ {' '.join(self.argv)}  (x{nproc})\n".encode())
        self._handle.flush()
        self.started = time.monotonic()
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(nproc):
            env = {
                **base,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"),
            }
            self.processes.append(
                subprocess.Popen(
                    self.argv, env=env, stdout=self._handle, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        self.peaks: dict[int, float] = {}
        self._watching = True
        self._watcher = threading.Thread(target=self._watch_memory, daemon=True)
        self._watcher.start()
        self.killed = False

    def _watch_memory(self) -> None:
        # VmHWM is kept by the kernel: polling only has to catch each process before it exits
        while self._watching:
            for rank, process in enumerate(self.processes):
                if process.poll() is None and (peak := _peak_mib(process.pid)) is not None:
                    self.peaks[rank] = max(self.peaks.get(rank, 0.0), peak)
            time.sleep(0.02)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def running(self) -> bool:
        return any(process.poll() is None for process in self.processes)

    def signal(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signum)
        if signum == signal.SIGKILL:
            self.killed = True

    def wait(self, timeout_s: float) -> Finished:
        """Wait for every rank; past ``timeout_s`` they are killed and the run fails."""
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        timed_out = self.running()
        if timed_out:
            self.signal(signal.SIGKILL)
        return self._finish(timed_out)

    def _finish(self, timed_out: bool) -> Finished:
        codes = tuple(process.wait() for process in self.processes)
        self._watching = False
        self._watcher.join()
        self._handle.close()
        finished = Finished(codes, time.monotonic() - self.started, dict(self.peaks), self.killed)
        if timed_out:
            raise RunFailed(f"`{' '.join(self.argv)}` ran past its timeout: see {self.log}")
        return finished

    def close(self) -> None:
        """Kill what still runs (a drill that stopped early)."""
        if self.running():
            self.signal(signal.SIGKILL)
        if not self._handle.closed:
            self._finish(False)


def run(
    command: TrainerCommand,
    fields: Mapping[str, Any],
    log: Path,
    timeout_s: float,
    nproc: int = 1,
    environ: Mapping[str, str] | None = None,
) -> Finished:
    """One run to its end; a rank that exits non-zero fails the run, with its output's tail."""
    job = Job(command, fields, log, nproc, environ)
    try:
        return finish(job, timeout_s)
    finally:
        job.close()


def finish(job: Job, timeout_s: float) -> Finished:
    """Wait for a started run; a rank that exits non-zero fails it, with its output's tail."""
    finished = job.wait(timeout_s)
    failed = [code for code in finished.returncodes if code != 0]
    if failed:
        raise RunFailed(f"`{' '.join(job.argv)}` exited {failed[0]}: {tail(job.log)}")
    return finished


def tail(log: Path, size: int = 400) -> str:
    text = log.read_text(errors="replace").strip()
    lines = [line for line in text.splitlines() if line.strip()][-4:]
    return " | ".join(lines)[-size:]
