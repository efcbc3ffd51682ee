"""InfiniBand/RoCE link reader: one ``link_sample`` record per port, read from sysfs.

For each ``<root>/<device>/ports/<n>/`` it reads the port state and every counter in
``counters/``, ``counters_ext/`` (older drivers' 64-bit copies, which win over the 32-bit ones
where both exist) and ``hw_counters/`` (kept apart, under ``counters["hw"]``). Runs on its own
daemon thread and interval, off the step path; without ``/sys/class/infiniband`` it says so once
and returns nothing.

The IB PortCounters saturate: they stop at their maximum instead of wrapping, so a counter at
its maximum no longer counts anything. Such a counter is listed in the record's ``saturated``,
and a consumer must not read its unchanged value as a zero error rate.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies import protocol

logger = logging.getLogger(__name__)

Record = dict[str, Any]
Sink = Callable[[Record], None]
Clock = Callable[[], float]

DEFAULT_ROOT = Path("/sys/class/infiniband")
STATE_LENGTH = protocol.LINK_SAMPLE.max_length("state")  # what the service takes of a port state

# Widths of the PortCounters fields (IBA spec 16.1.3.5), as the kernel reads them into
# counters/ (PORT_PMA_ATTR in drivers/infiniband/core/sysfs.c). A counter not listed here, and
# every hw_counters/ file, is taken as 32 bits; counters_ext/ files are 64 bits.
PORT_COUNTER_BITS: dict[str, int] = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
    "port_xmit_data": 32,
    "port_rcv_data": 32,
    "port_xmit_packets": 32,
    "port_rcv_packets": 32,
    "port_xmit_wait": 32,
}
DEFAULT_BITS = 32
EXT_BITS = 64
# Files in hw_counters/ that are settings, not counters.
NOT_COUNTERS = frozenset({"lifespan"})


@dataclass(frozen=True)
class PortReading:
    """One port now: its state, its counters, and the names of those stuck at their maximum."""

    state: str | None
    counters: Record
    saturated: list[str]


def read_port(port_dir: Path) -> PortReading:
    """Read one ``ports/<n>`` directory. Unreadable or non-numeric files are left out."""
    counters: Record = {}
    saturated: list[str] = []
    for name, value in _read_numbers(port_dir / "counters").items():
        _keep(counters, saturated, name, value, PORT_COUNTER_BITS.get(name, DEFAULT_BITS))
    for name, value in _read_numbers(port_dir / "counters_ext").items():
        base = name.removesuffix("_64")  # port_rcv_data_64 supersedes port_rcv_data
        if base in saturated:
            saturated.remove(base)
        _keep(counters, saturated, base, value, EXT_BITS)
    hw: Record = {}
    hw_saturated: list[str] = []
    for name, value in _read_numbers(port_dir / "hw_counters").items():
        if name not in NOT_COUNTERS:
            _keep(hw, hw_saturated, name, value, DEFAULT_BITS)
    if hw:
        counters["hw"] = hw
    saturated.extend(f"hw.{name}" for name in hw_saturated)
    return PortReading(_read_state(port_dir / "state"), counters, saturated)


def _keep(counters: Record, saturated: list[str], name: str, value: int, bits: int) -> None:
    counters[name] = value
    # Equality, not >=: where the HCA supports it the kernel serves the 64-bit extended
    # counters in counters/ too, and those legitimately pass 2**32 - 1.
    if value == (1 << bits) - 1:
        saturated.append(name)


def _read_numbers(directory: Path) -> dict[str, int]:
    try:
        paths = sorted(directory.iterdir())
    except OSError:  # absent (no counters_ext/ on current kernels) or unreadable
        return {}
    numbers: dict[str, int] = {}
    for path in paths:
        number = _read_int(path)
        if number is not None:
            numbers[path.name] = number
    return numbers


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError as error:  # EINVAL/EOPNOTSUPP where the HCA has no PMA, EACCES, a directory
        logger.debug("links: %s unreadable (%s)", path, error)
        return None
    # Some kernels write "N/A (no PMA)" instead of failing the read.
    return int(text) if text.isdecimal() else None


def _read_state(path: Path) -> str | None:
    """``4: ACTIVE`` -> ``ACTIVE``."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    state = text.split(":", 1)[-1].strip()
    return state[:STATE_LENGTH] or None


def find_ports(root: Path) -> list[tuple[str, int, Path]]:
    """(device, port number, port directory) for every port under ``root``, sorted."""
    ports: list[tuple[str, int, Path]] = []
    for device in sorted(root.iterdir()):
        ports_dir = device / "ports"
        if not ports_dir.is_dir():
            continue
        for port in ports_dir.iterdir():
            if port.name.isdecimal():
                ports.append((device.name, int(port.name), port))
    return sorted(ports, key=lambda found: (found[0], found[1]))


class LinkReader:
    """Samples every InfiniBand/RoCE port on its own interval and hands each ``link_sample``
    record to ``sink``, from the reader's thread, one record per call. An exception from the
    sink is logged once and otherwise ignored. Run one per node (on local rank 0): the ports
    belong to the node, not to a rank."""

    @dataclass(frozen=True)
    class Config:
        """How the reader samples.

        interval_s: 10 s, as for the NVML reader: the counters are cumulative, so the interval
            sets time resolution, not accuracy. Reading counters/ asks the HCA for its
            PortCounters, about twenty small reads per port: cheap at this rate.
        stop_timeout_s: 5 s to wait for the thread in ``stop()``; it is a daemon, so a read
            stuck in the kernel never holds the process open.
        """

        interval_s: float = 10.0
        stop_timeout_s: float = 5.0

        def __post_init__(self) -> None:
            if not self.interval_s > 0 or not self.stop_timeout_s > 0:
                raise ValueError("LinkReader.Config: interval_s and stop_timeout_s must be > 0")

    def __init__(
        self,
        sink: Sink,
        config: LinkReader.Config | None = None,
        *,
        root: Path | str = DEFAULT_ROOT,
        node: str | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.config = config or LinkReader.Config()
        self._sink = sink
        self._root = Path(root)
        self._node = node or socket.gethostname()
        self._clock = clock
        self._lock = threading.Lock()
        self._last_seq: dict[tuple[str, int], int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said: set[str] = set()
        self._absent: str | None = None

    @property
    def running(self) -> bool:
        """Whether the sampler thread runs (``start`` found ports)."""
        return self._thread is not None

    @property
    def unavailable_reason(self) -> str | None:
        """Why there is nothing to sample (said once in the log), or None."""
        return self._absent

    def sample(self) -> list[Record]:
        """One record per port now; [] without InfiniBand. Never raises."""
        with self._lock:
            return [self._sample_port(device, port, path) for device, port, path in self._ports()]

    def start(self) -> None:
        """Start the sampler thread; its first sample is taken at once. Without ports (no RDMA
        driver, no HCA) it says so once and starts nothing: ports do not appear mid-run."""
        with self._lock:
            if self._thread is not None or not self._ports():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="runhealth-links-sampler", daemon=True)
            self._thread.start()

    def _ports(self) -> list[tuple[str, int, Path]]:
        try:
            ports = find_ports(self._root)
        except OSError as error:  # no /sys/class/infiniband: no RDMA driver loaded
            ports, why = [], f"{error.strerror or error}"
        else:
            why = "no ports"
        self._absent = None if ports else f"no InfiniBand/RoCE ports under {self._root} ({why})"
        if self._absent is not None:
            self._say_once("absent", logging.INFO, f"links: {self._absent}; link samples are off")
        return ports

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.config.stop_timeout_s)
        self._thread = None

    def _sample_port(self, device: str, port: int, path: Path) -> Record:
        now = self._clock()
        reading = read_port(path)
        return protocol.build(
            protocol.LINK_SAMPLE,
            node=self._node,
            device=device,
            port=port,
            seq=self._next_seq((device, port), now),
            time=float(now),
            counters=reading.counters,
            state=reading.state,
            saturated=reading.saturated or None,
        )

    def _next_seq(self, key: tuple[str, int], now: float) -> int:
        # The store keys samples by (run, node, device, port, seq) with no incarnation, so a
        # restarted reader must not reuse numbers: seq counts microseconds, never less than last+1.
        seq = max(self._last_seq.get(key, -1) + 1, int(now * 1_000_000))
        self._last_seq[key] = seq
        return seq

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                records = self.sample()
            except Exception as error:  # a reader bug must not kill the thread or the trainer
                message = f"links: sampling failed: {error!r} (said once)"
                self._say_once("sampler", logging.WARNING, message)
                records = []
            for record in records:
                try:
                    self._sink(record)
                except Exception as error:
                    message = f"links: sink raised {error!r}; record dropped (said once)"
                    self._say_once("sink", logging.WARNING, message)
            self._stop.wait(self.config.interval_s)

    def _say_once(self, topic: str, level: int, message: str) -> None:
        if topic not in self._said:
            self._said.add(topic)
            logger.log(level, message)
