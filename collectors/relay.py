"""A node's relay: the ranks of one node reach the service in one request per flush.

The service's cost is mostly per request, not per record (``benchmarks/fleet.py``: at 256
ranks, about 3 ms of service CPU and 2.5 ms of PostgreSQL CPU per one-rank post of two step
records, against 530 us per step record in posts of 16 ranks), and a job whose every rank
posts for itself every 2 s sends the service ``world_size / 2`` requests a second. Local rank
0 runs this relay on the loopback interface; every rank of its node (itself included) posts
its batches to it, and it sends what arrived together upstream as one batch. Each rank keeps
its own spool and its own retry: the relay answers a rank only with the service's answer to
the batch that carried its records, so nothing is acknowledged that the service did not take.

Ranks flush on a grid shared by the node (``Sender`` aligned to the node's phase), so the
node's batches arrive within milliseconds of each other; the relay sends when every rank of
the node has a batch waiting, or ``gather_s`` after the first, whichever is sooner. A merged
batch the service refuses (409, 413, 422) is sent again one rank's batch at a time, so each
rank hears exactly what it would have heard alone. A rank whose relay does not answer (local
rank 0 ended or is stuck) sends directly (``RelayTransport``).

At the end of a run local rank 0 often closes its hook first. Each rank says so to the relay
when its sender has sent its last batch (``/closed``), and local rank 0 keeps the relay up until
every rank of the node has said it, or ``close_wait_s``: the ranks' last batches and closing
heartbeats still go together, not around the relay.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from collectors.counters import Counters
from collectors.transport import Connection, Delivery, HttpTransport, Outcome, TransportConfig, json_body
from collectors.wire import Record, encode_batch

log = logging.getLogger("runhealth.collectors")

CLOSED_TIMEOUT_S = 2.0
"""How long a closing rank tries to tell its relay: the relay answers at once, or is gone."""


@dataclass(frozen=True)
class RelayConfig:
    """The node relay (``RUNHEALTH_RELAY__*``).

    ``enabled``: True. On where torchrun says how many ranks share the node (``LOCAL_WORLD_SIZE``
    above 1) and the job has a c10d store to find the relay through; off otherwise.
    ``gather_s``: 0.1 s, the most a batch waits for the node's other ranks. Their flushes are
    aligned to one grid, so on a healthy node they arrive within milliseconds; the bound only
    matters for a rank that is gone or a batch sent off the grid (a replay, a full queue), and
    it is small beside the 2 s a record already waits in its rank's queue.
    ``max_records``: 20,000 records per upstream batch, under the service's 50,000 limit.
    ``retry_relay_s``: 30 s: a rank whose relay did not answer sends directly for this long
    before it tries the relay again.
    ``close_wait_s``: 10 s, the most local rank 0's close waits for the node's other ranks to
    close theirs (a run that ends well ends its ranks within a step of each other; a rank that
    died never says it closed). Not waited for when the run failed.
    """

    enabled: bool = True
    gather_s: float = 0.1
    max_records: int = 20_000
    retry_relay_s: float = 30.0
    close_wait_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.gather_s <= 5:
            raise ValueError(f"RelayConfig.gather_s must be in (0, 5] s, got {self.gather_s}")
        if self.max_records < 1 or self.retry_relay_s <= 0 or self.close_wait_s < 0:
            raise ValueError("RelayConfig: max_records >= 1, retry_relay_s > 0, close_wait_s >= 0")


def local_world_size(environ: Mapping[str, str]) -> int | None:
    """How many ranks share this node, as the launcher says: torchrun's ``LOCAL_WORLD_SIZE``."""
    raw = environ.get("LOCAL_WORLD_SIZE", "")
    return int(raw) if raw.isdigit() else None


def node_key(environ: Mapping[str, str], host: str) -> str:
    """The node's name among the job's nodes, the same for every rank on it: torchrun's node
    rank (``GROUP_RANK``, which differs even for two launches on one machine), else Slurm's
    (``SLURM_NODEID``), else the machine's host name (not ``RUNHEALTH_NODE``: that names the
    records' node, and a launch may set it per rank)."""
    for name, prefix in (("GROUP_RANK", "group"), ("SLURM_NODEID", "slurm")):
        value = environ.get(name, "")
        if value.isdigit():
            return f"{prefix}{value}"
    return f"host-{host}"


class RelayLookup:
    """Where the node's relay listens, once local rank 0 has said so. Asked of the job's store
    without waiting, on the sender thread before a post: a rank never waits at attach for its
    node's relay (a relay that is never published would otherwise hold the rank while its peers
    wait for it in a collective). Until it is known the rank sends directly; after ``for_s``
    without an answer it stops asking."""

    def __init__(
        self,
        read: Callable[[], tuple[bool, str | None]],
        for_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._clock = clock
        self._until = clock() + for_s
        self._url: str | None = None
        self._settled = False

    @classmethod
    def known(cls, url: str) -> RelayLookup:
        lookup = cls(lambda: (True, url))
        lookup.url()
        return lookup

    def url(self) -> str | None:
        if self._settled:
            return self._url
        try:
            published, url = self._read()
        except Exception as exc:  # the job's store is gone: send directly from now on
            log.warning("runhealth: could not look up the node's relay (%s); sending directly", exc)
            published, url = True, None
        if published or self._clock() >= self._until:
            self._settled, self._url = True, url
        return url


# --- the relay, in local rank 0's process ------------------------------------------------


@dataclass
class Waiting:
    """One rank's batch, waiting for the upstream answer that carries it."""

    records: list[Any]
    incarnation: str | None
    rank: int | None
    done: threading.Event = field(default_factory=threading.Event)
    answer: tuple[int, bytes, str | None] = (503, b"", None)


class NodeRelay:
    """Gathers the node's batches and sends them upstream together (one sending thread)."""

    def __init__(
        self, config: RelayConfig, upstream: TransportConfig, expected_ranks: int, counters: Counters
    ) -> None:
        if upstream.url is None or upstream.run is None:
            raise ValueError("NodeRelay needs the service's URL and the run")
        self._config = config
        self._expected = expected_ranks
        self._token = upstream.token or ""
        self._path = records_path(upstream.run)
        self._upstream = Connection(upstream.url, upstream.timeout_s)
        self._headers = {"authorization": f"Bearer {self._token}", "content-type": "application/json"}
        self._waiting: list[Waiting] = []
        self._closed: set[int | None] = set()  # ranks that said their sender closed
        self._changed = threading.Condition()
        self._stopping = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._threads = [
            threading.Thread(target=self._server.serve_forever, name="runhealth-relay-http", daemon=True),
            threading.Thread(target=self._send_loop, name="runhealth-relay", daemon=True),
        ]
        self._counters = counters

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> str:
        for thread in self._threads:
            thread.start()
        return self.url

    @property
    def closed_path(self) -> str:
        return f"{self._path}/closed"

    def stop(self, timeout_s: float = 10.0, wait_for_ranks_s: float = 0.0) -> None:
        """Stop taking batches (a rank's next one goes directly), answer those already here.
        First, for at most ``wait_for_ranks_s``, wait until every rank of the node said its
        sender closed."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._closed) >= self._expected, wait_for_ranks_s)
            self._stopping = True
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._threads[1].join(timeout_s)
        self._upstream.close()

    # Arrivals (one handler thread per rank's connection).

    def relay(
        self, records: list[Any], incarnation: str | None, rank: int | None
    ) -> tuple[int, bytes, str | None]:
        """A rank's batch: returns the service's answer to it (status, body, Retry-After)."""
        waiting = Waiting(records, incarnation, rank)
        with self._changed:
            if self._stopping:
                raise RelayStopped
            self._waiting.append(waiting)
            self._changed.notify_all()
        waiting.done.wait()
        return waiting.answer

    # The sending thread.

    def _send_loop(self) -> None:
        while True:
            group = self._gather()
            if group is None:
                return
            try:
                self._send(group)
            except Exception as exc:  # the thread must outlive any one failure
                log.exception("runhealth relay: a send failed")
                for waiting in group:
                    answer_once(waiting, (503, error_body("relay_failed", str(exc)), None))

    def _gather(self) -> list[Waiting] | None:
        """The next group to send: every expected rank waiting, ``gather_s`` after the first
        arrival, the record bound reached, or the relay stopping."""
        with self._changed:
            while not self._waiting:
                if self._stopping:
                    return None
                self._changed.wait()
            deadline = time.monotonic() + self._config.gather_s
            while not self._stopping and not self._full():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            group, self._waiting = self._waiting, []
            return group

    def _full(self) -> bool:
        # A rank waits for its answer before it sends again: one batch waiting is one rank.
        records = sum(len(waiting.records) for waiting in self._waiting)
        return len(self._waiting) >= self._expected or records >= self._config.max_records

    def _send(self, group: list[Waiting]) -> None:
        by_incarnation: dict[str | None, list[Waiting]] = {}
        for waiting in group:  # a restore switches incarnation: its batches ask for their own
            by_incarnation.setdefault(waiting.incarnation, []).append(waiting)
        for incarnation, batch in by_incarnation.items():
            if len(batch) == 1:
                answer_once(batch[0], self._post_one(batch[0]))
            else:
                self._post_together(incarnation, batch)

    def _post_together(self, incarnation: str | None, batch: list[Waiting]) -> None:
        ranks = [waiting.rank for waiting in batch if waiting.rank is not None]
        query = {"incarnation": incarnation, "ranks": ranks} if incarnation is not None and ranks else {}
        records = [record for waiting in batch for record in waiting.records]
        status, body, retry_after = self._post(records, query)
        self._counters.add("relay_posts")
        self._counters.add("relay_batches", len(batch))
        if 200 <= status < 300:
            document = json_body(body)
            by_rank = document.pop("directives_by_rank", None) or {}
            for waiting in batch:
                answer: dict[str, Any] = {**document, "relayed_with": len(batch) - 1}
                if waiting.rank is not None and str(waiting.rank) in by_rank:
                    answer["directives"] = by_rank[str(waiting.rank)]
                answer_once(waiting, (status, json.dumps(answer).encode(), None))
        elif status in (400, 409, 413, 422):  # a record refused: each rank hears its own answer
            for waiting in batch:
                answer_once(waiting, self._post_one(waiting))
        else:  # the service is down, shedding or refuses the token: the same for every rank
            for waiting in batch:
                answer_once(waiting, (status, body, retry_after))

    def _post_one(self, waiting: Waiting) -> tuple[int, bytes, str | None]:
        query: dict[str, Any] = {}
        if waiting.incarnation is not None and waiting.rank is not None:
            query = {"incarnation": waiting.incarnation, "rank": waiting.rank}
        self._counters.add("relay_posts")
        self._counters.add("relay_batches")
        return self._post(waiting.records, query)

    def _post(self, records: Sequence[Any], query: Mapping[str, Any]) -> tuple[int, bytes, str | None]:
        path = f"{self._path}?{urlencode(query, doseq=True)}" if query else self._path
        body = encode_batch(records)  # as the ranks wrote them: nonfinite values are names
        try:
            status, answer = self._upstream.post(path, body, self._headers)
        except Exception as exc:  # the service is unreachable: every rank keeps its batch
            return 503, error_body("service_unreachable", f"{type(exc).__name__}: {exc}"), None
        return status, answer, self._upstream.retry_after

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 120  # an idle kept-alive connection is closed; the rank reconnects

            def do_POST(self) -> None:
                relay.handle_post(self)

            def log_message(self, format: str, *args: Any) -> None:
                return None  # the trainer's log is not an access log

        return Handler

    def handle_post(self, request: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(request.path)
        length = request.headers.get("content-length", "")
        if not length.isdigit():
            return respond(request, 411, error_body("length_required", "a batch needs content-length"))
        raw = request.rfile.read(int(length))
        if parts.path not in (self._path, self.closed_path):
            return respond(request, 404, error_body("not_found", f"the relay takes {self._path}"))
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), self._headers["authorization"].encode()):
            return respond(request, 401, error_body("unauthorized", "not the run's token"))
        query = parse_qs(parts.query)
        rank_text = (query.get("rank") or [""])[0]
        rank = int(rank_text) if rank_text.isdigit() else None
        if parts.path == self.closed_path:
            return self._rank_closed(request, rank)
        try:
            records = json.loads(raw)["records"]
            if not isinstance(records, list):
                raise TypeError("records is not a list")
        except (ValueError, KeyError, TypeError) as exc:
            return respond(request, 400, error_body("invalid_json", str(exc)))
        incarnation = query["incarnation"][0] if query.get("incarnation") else None
        try:
            status, body, retry_after = self.relay(records, incarnation, rank)
        except RelayStopped:  # no answer at all: the rank sends directly from now on
            request.close_connection = True
            return None
        return respond(request, status, body, retry_after)

    def _rank_closed(self, request: BaseHTTPRequestHandler, rank: int | None) -> None:
        with self._changed:
            # A rank that never learnt its number still counts once (a second such close
            # cannot be told from a repeat, so the wait then ends at its bound).
            self._closed.add(rank)
            self._changed.notify_all()
        return respond(request, 200, b"{}")


def records_path(run: str) -> str:
    """The service's records route for ``run``, which the relay also serves (``/closed`` below it)."""
    return f"/v1/runs/{quote(run, safe='')}/records"


class RelayStopped(Exception):
    """The relay is stopping: a batch that arrives now is not taken."""


def answer_once(waiting: Waiting, answer: tuple[int, bytes, str | None]) -> None:
    waiting.answer = answer
    waiting.done.set()


def error_body(error: str, message: str) -> bytes:
    return json.dumps({"error": error, "message": message}).encode()


def respond(
    request: BaseHTTPRequestHandler, status: int, body: bytes, retry_after: str | None = None
) -> None:
    request.send_response(status)
    request.send_header("content-type", "application/json")
    request.send_header("content-length", str(len(body)))
    if retry_after is not None:
        request.send_header("retry-after", retry_after)
    request.end_headers()
    request.wfile.write(body)


# --- each rank's side ------------------------------------------------------------------


class RelayTransport:
    """A rank's transport through its node's relay, and directly when the relay is gone.

    The relay's answer is the service's answer to the batch that carried this rank's records;
    no answer at all (refused, reset, timed out) means the relay is gone or stuck, and the
    batch goes directly, as does every batch for ``retry_relay_s`` after. A batch that reached
    the relay and then timed out may also be stored by it: the service stores a record once.
    Until ``lookup`` knows where the relay is, batches go directly.
    """

    def __init__(
        self, lookup: RelayLookup, upstream: TransportConfig, config: RelayConfig, counters: Counters
    ) -> None:
        self._lookup = lookup
        self._upstream = upstream
        self._relay: HttpTransport | None = None
        self._direct = HttpTransport(upstream)
        self._config = config
        self._asked: tuple[str, int] | None = None
        self._relay_down_until = 0.0
        self._said = False
        self._counters = counters

    def ask_directives_with_posts(self, incarnation: str, rank: int) -> None:
        self._asked = (incarnation, rank)
        self._direct.ask_directives_with_posts(incarnation, rank)
        if self._relay is not None:
            self._relay.ask_directives_with_posts(incarnation, rank)

    def post(self, records: Sequence[Record]) -> Delivery:
        relay = self._through()
        if relay is not None and time.monotonic() >= self._relay_down_until:
            delivery = relay.post(records)
            if delivery.status is not None or delivery.outcome is not Outcome.RETRY:
                return delivery  # the service's answer, through the relay (or unencodable)
            self._relay_down_until = time.monotonic() + self._config.retry_relay_s
            self._say_gone(delivery)
        if relay is not None:
            self._counters.add("relay_bypassed")
        return self._direct.post(records)

    def _through(self) -> HttpTransport | None:
        if self._relay is None and (url := self._lookup.url()) is not None:
            # The relay answers after its own upstream try (``timeout_s``) and the gather.
            timeout_s = self._upstream.timeout_s + self._config.gather_s + 5.0
            self._relay = HttpTransport(
                TransportConfig(url, self._upstream.token, self._upstream.run, timeout_s)
            )
            if self._asked is not None:
                self._relay.ask_directives_with_posts(*self._asked)
        return self._relay

    def _say_gone(self, delivery: Delivery) -> None:
        if self._said:
            return
        self._said = True
        # Refused: local rank 0 closed its hook first (the usual end of a run) or ended;
        # anything else (a timeout, a reset) means it is stuck, worth a warning.
        gone = delivery.reason.startswith(("ConnectionRefusedError", "RemoteDisconnected"))
        log.log(
            logging.INFO if gone else logging.WARNING,
            "runhealth: the node's relay does not answer (%s); sending directly",
            delivery.reason,
        )

    def directives(self, incarnation: str, rank: int) -> list[dict[str, Any]] | None:
        return self._direct.directives(incarnation, rank)

    def close(self) -> None:
        """After the sender's last batch: tell the relay this rank is done, so local rank 0
        keeps it up for the node's ranks still closing (``NodeRelay.stop``)."""
        if self._relay is not None:
            self._relay.close()
        url = self._lookup.url()
        if url is not None:
            self._say_closed(url)
        self._direct.close()

    def _say_closed(self, url: str) -> None:
        rank = self._asked[1] if self._asked is not None else None
        path = f"{records_path(self._upstream.run or '')}/closed"
        if rank is not None:
            path += f"?rank={rank}"
        connection = Connection(url, CLOSED_TIMEOUT_S)
        headers = {"authorization": f"Bearer {self._upstream.token or ''}"}
        try:
            connection.post(path, b"", headers)
        except Exception as exc:  # local rank 0 closed first: nothing waits for this rank
            log.debug("runhealth: the node's relay did not hear this rank close (%s)", exc)
        finally:
            connection.close()
