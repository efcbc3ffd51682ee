"""The fleet benchmark's simulated ranks: pre-encoded records and the processes that post them.

Each rank's records are encoded once, as JSON text with ``%`` slots for what changes from window
to window (attempt, step, consumed examples, time, sample id, loss, grad norm, forward time). A
window's record is one ``%``-format of its template with values from precomputed string tables:
no ``json.dumps`` and no float formatting per record, so a sender process offers tens of
thousands of records a second from a fraction of a core, and the machine's cores go to the
service under test.

A ``Poster`` is one batch's worth of ranks: by default one rank, posting every ``flush_s`` what
it did since its last post (its step records, a heartbeat every ``heartbeat_s`` and a device
sample every ``device_s``), as the hook's sender thread does (``collectors.sender``).
"""

from __future__ import annotations

import http.client
import json
import os
import pickle
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode

# Precomputed values, indexed by a hash of (rank, attempt): the loss, grad norm and forward time
# move from window to window by about 1%, like a healthy run's, so the engine's robust
# statistics see ordinary noise and a planted fault stands out.
TABLE = 4096
TOKENS = 4096


def _table(seed: int, centre: float, spread: float, scale: float = 1.0) -> tuple[str, ...]:
    rng = random.Random(seed)
    return tuple(repr(round(scale * (centre + rng.uniform(-spread, spread)), 6)) for _ in range(TABLE))


LOSS_SUMS = _table(1, 2.5, 0.025, TOKENS)
REPORTED = tuple(repr(round(float(total) / TOKENS, 6)) for total in LOSS_SUMS)
GRAD_NORMS = _table(2, 1.0, 0.02)
FORWARD_S = _table(3, 0.3, 0.003)
NAN = '"NaN"'  # the NaN-by-name codec (policies.protocol.nonfinite)
# A batch unanswered this long is a service not keeping up: counted failed, the load moves on.
ANSWER_TIMEOUT_S = 30.0


def _slot(rank: int, attempt: int) -> int:
    return (rank * 7919 + attempt * 104729) % TABLE


def node_of(rank: int) -> str:
    return f"node-{rank // 8:05d}"


def device_of(rank: int) -> str:
    return f"GPU-{rank:08d}-0000-4000-8000-000000000000"


def _open(fixed: dict[str, object]) -> str:
    """The JSON text of ``fixed`` without its closing brace, for slots to follow."""
    return json.dumps(fixed, separators=(",", ":"))[:-1]


@dataclass(frozen=True)
class RankTemplates:
    """One rank's records as format strings."""

    rank: int
    step: str
    heartbeat: str
    device: str

    @classmethod
    def of(cls, incarnation: str, rank: int) -> RankTemplates:
        identity = {"incarnation": incarnation, "rank": rank}
        step = _open(
            {
                "kind": "step",
                **identity,
                "node": node_of(rank),
                "device_uuid": device_of(rank),
                "dp_rank": rank,
                "microbatches": 8,
                "tokens": TOKENS,
                "lr": 3e-4,
                "loss_scale": 65536.0,
                "skipped": False,
                "data_wait_s": 0.001,
                "backward_s": 0.6,
                "optimizer_s": 0.05,
            }
        )
        step += (
            ',"attempt":%d,"step":%d,"consumed":%d,"time":%.3f,"sample_ids":[%d],'
            '"loss_sum":%s,"reported_loss":%s,"grad_norm":%s,"forward_s":%s}'
        )
        heartbeat = _open({"kind": "heartbeat", **identity, "node": node_of(rank), "phase": "forward"})
        heartbeat += ',"phase_since":%.3f,"time":%.3f,"step":%d,"attempt":%d}'
        device = _open(
            {
                "kind": "device_sample",
                "node": node_of(rank),
                "device_uuid": device_of(rank),
                "rank": rank,
                "clock_event_reasons": 0,
                "sm_clock_mhz": 1980.0,
                "mem_clock_mhz": 2619.0,
                "power_w": 610.0,
                "power_limit_w": 700.0,
                "temperature_c": 61.0,
                "counters": {"ecc": {"volatile": {"corrected": 0, "uncorrected": 0}}, "pcie_replay": 0},
                "xids": [],
            }
        )
        device += ',"seq":%d,"time":%.3f}'
        return cls(rank, step, heartbeat, device)

    def step_record(self, attempt: int, ranks: int, now: float, fault: bool) -> str:
        slot = _slot(self.rank, attempt)
        loss_sum, reported = (NAN, NAN) if fault else (LOSS_SUMS[slot], REPORTED[slot])
        return self.step % (
            attempt,
            attempt,
            attempt * ranks * 8,
            now,
            attempt * ranks + self.rank,
            loss_sum,
            reported,
            GRAD_NORMS[slot],
            FORWARD_S[slot],
        )


@dataclass(frozen=True)
class Fault:
    """A nonfinite loss planted on one rank of one run: at ``first_step``, then every ``every``
    steps (0: once). Apart by more than the incident grouping's 50-step gap, each is its own
    incident (``policies.incidents.GroupingConfig``)."""

    run_index: int
    rank: int
    first_step: int
    every: int

    def hits(self, run_index: int, rank: int, attempt: int) -> bool:
        if run_index != self.run_index or rank != self.rank or attempt < self.first_step:
            return False
        return attempt == self.first_step or (
            self.every > 0 and (attempt - self.first_step) % self.every == 0
        )


@dataclass(frozen=True)
class Poster:
    """Ranks ``first_rank .. last_rank - 1`` of one run, posting one batch every ``flush_s``
    at ``offset_s`` into each interval, to the replica at ``host:port``."""

    run: str
    run_index: int
    token: str
    host: str
    port: int
    first_rank: int
    last_rank: int
    offset_s: float


@dataclass(frozen=True)
class Plan:
    """What every sender process shares: the load's shape and its clock."""

    incarnations: tuple[str, ...]
    ranks: int
    flush_s: float
    heartbeat_s: float
    device_s: float
    started_at: float  # the wall time at which attempt 0 ends; attempt a ends a seconds later
    seconds: float
    fault: Fault | None
    threads: int
    ask_directives: bool = False
    """Each post asks for its ranks' pending directives, as the hook (one rank: ``rank``) and a
    node relay (its ranks: ``ranks``) do."""


@dataclass
class Sent:
    """What one sender process did, for the benchmark to read back."""

    # One row per batch: (run index, first attempt, last attempt, ranks, due, sent, answered,
    # status, records). Window latency is computed from these, a record at a time.
    batches: list[tuple[int, int, int, int, float, float, float, int, int]] = field(default_factory=list)
    faults: list[tuple[int, int, float]] = field(default_factory=list)  # (run index, attempt, sent)
    errors: list[str] = field(default_factory=list)
    cpu_s: float = 0.0


class _Connection:
    """One keep-alive HTTP/1.1 connection, reopened after an error."""

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._connection: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes, token: str) -> int:
        if self._connection is None:
            self._connection = http.client.HTTPConnection(self._host, self._port, timeout=ANSWER_TIMEOUT_S)
        headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
        try:
            self._connection.request("POST", path, body=body, headers=headers)
            response = self._connection.getresponse()
            response.read()
            return response.status
        except (OSError, http.client.HTTPException):
            self._connection.close()
            self._connection = None
            raise


class _PosterState:
    def __init__(self, poster: Poster, plan: Plan) -> None:
        self.poster = poster
        incarnation = plan.incarnations[poster.run_index]
        self.templates = [
            RankTemplates.of(incarnation, r) for r in range(poster.first_rank, poster.last_rank)
        ]
        self.path = f"/v1/runs/{poster.run}/records"
        if plan.ask_directives:
            ranks = range(poster.first_rank, poster.last_rank)
            asked = [("rank", r) for r in ranks] if len(ranks) == 1 else [("ranks", r) for r in ranks]
            self.path += "?" + urlencode([("incarnation", incarnation), *asked])
        self.last_attempt = 0
        self.next_heartbeat = plan.started_at + poster.offset_s
        self.next_device = plan.started_at + poster.offset_s
        self.device_seq = 0

    def body(self, plan: Plan, now: float) -> tuple[bytes, int, int, int, list[int]]:
        """The batch due now: (body, first attempt, last attempt, records, faulty attempts)."""
        # The load's last window is its ``seconds``-th; the posts after it carry what is left,
        # as the hook's close flushes its sender.
        newest = min(int(now - plan.started_at), int(plan.seconds))
        first = self.last_attempt + 1
        parts: list[str] = []
        faulty: list[int] = []
        fault, run_index = plan.fault, self.poster.run_index
        for attempt in range(first, newest + 1):
            done_at = plan.started_at + attempt
            for t in self.templates:
                hit = fault is not None and fault.hits(run_index, t.rank, attempt)
                if hit:
                    faulty.append(attempt)
                parts.append(t.step_record(attempt, plan.ranks, done_at, hit))
        self.last_attempt = max(self.last_attempt, newest)
        if now >= self.next_heartbeat:
            self.next_heartbeat += plan.heartbeat_s
            parts += [t.heartbeat % (now - 0.1, now, newest, newest + 1) for t in self.templates]
        if now >= self.next_device:
            self.next_device += plan.device_s
            self.device_seq += 1
            parts += [t.device % (self.device_seq, now) for t in self.templates]
        body = ('{"records":[' + ",".join(parts) + "]}").encode()
        return body, first, newest, len(parts), faulty


def _sender_thread(states: list[_PosterState], plan: Plan, sent: Sent, lock: threading.Lock) -> None:
    states = sorted(states, key=lambda s: s.poster.offset_s)
    connections: dict[tuple[str, int], _Connection] = {}
    # One more flush interval after the last window, so every rank has posted it.
    ends_at = plan.started_at + plan.seconds + plan.flush_s
    interval = 0
    while True:
        for state in states:
            due = plan.started_at + interval * plan.flush_s + state.poster.offset_s
            if due > ends_at:
                return
            pause = due - time.time()
            if pause > 0:
                time.sleep(pause)
            elif -pause > plan.seconds:
                return  # a service that answers this slowly is not keeping up: stop, say late
            poster = state.poster
            body, first, last, records, faulty = state.body(plan, max(due, time.time()))
            connection = connections.setdefault(
                (poster.host, poster.port), _Connection(poster.host, poster.port)
            )
            sent_at = time.time()
            try:
                status = connection.post(state.path, body, poster.token)
            except (OSError, http.client.HTTPException) as exc:
                status = -1
                with lock:
                    sent.errors.append(
                        f"{poster.run} ranks {poster.first_rank}-{poster.last_rank - 1}: {exc!r}"
                    )
            answered = time.time()
            with lock:
                sent.batches.append(
                    (poster.run_index, first, last, poster.last_rank - poster.first_rank, due, sent_at,
                     answered, status, records)
                )  # fmt: skip
                sent.faults += [(poster.run_index, attempt, sent_at) for attempt in faulty]
        interval += 1


def run_sender(posters: list[Poster], plan: Plan, out: Path) -> None:
    """A sender process: ``plan.threads`` threads share the posters; what they did is pickled
    to ``out`` at the end."""
    states = [_PosterState(p, plan) for p in posters]
    sent, lock = Sent(), threading.Lock()
    threads = [
        threading.Thread(
            target=_sender_thread, args=(states[i :: plan.threads], plan, sent, lock), daemon=True
        )
        for i in range(min(plan.threads, len(states)))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    times = os.times()
    sent.cpu_s = times.user + times.system
    out.write_bytes(pickle.dumps(sent))


def main() -> None:
    """``fleet_senders.py PLAN OUT``: post the pickled (posters, plan) and pickle what was sent."""
    posters, plan = pickle.loads(Path(sys.argv[1]).read_bytes())
    run_sender(posters, plan, Path(sys.argv[2]))


if __name__ == "__main__":
    main()
