"""One HTTP POST of one batch to the ingest API, and what the answer means for the batch.

Three outcomes. Delivered (2xx). Retry later (the service is down or slow: a connection error,
a timeout, 408, 429 or 5xx): the batch is kept and sent again, and the service's per-key
deduplication makes the resend harmless even if the first attempt was stored. A 429 (the service
is shedding load) or a 503 may say when to ask again (``Retry-After``, in seconds or as an HTTP
date): the delivery carries it, and the sender waits at least that long. Rejected (any
other status): the batch itself is at fault and resending cannot help; the service names the
offending records for 409 and 422, so the sender can set those aside and send the rest.

A minimal HTTP/1.1 client over one keep-alive connection (``http11.py``): the sender's CPU is
the trainer's CPU, and it costs about 100 us a request where ``http.client`` costs 350 and httpx
more (measured on the reference CPU).
"""

from __future__ import annotations

import email.utils
import enum
import http.client
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from collectors.http11 import HttpConnection
from collectors.wire import Record, encode_batch, encoding_problems
from policies.protocol import RUN_NAME, value_problem

RETRY_STATUSES = frozenset({408, 429})
# The service refuses the sender (a wrong token, a run it does not know), not the batch: every
# batch would be refused alike, so they are kept (spooled) until that is fixed, rather than
# each one dead-lettered as invalid. A trainer restarted with the right token replays them.
REFUSED_STATUSES = frozenset({401, 403, 404})
# How a kept-alive connection the server closed while idle fails when it is next used.
STALE_CONNECTION = (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)


@dataclass(frozen=True)
class TransportConfig:
    """Where records go.

    ``url``, ``token``, ``run``: ``RUNHEALTH_URL``, ``RUNHEALTH_TOKEN``, ``RUNHEALTH_RUN``. With no
    URL the hook starts the embedded service and fills in its URL and admin token.
    ``timeout_s``: 10 s per request. A healthy service answers a batch in milliseconds; a slower
    answer means it is overloaded, and the batch is better spooled than waited on.
    """

    url: str | None = None
    token: str | None = None
    run: str | None = None
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"TransportConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"RUNHEALTH_URL must be an http(s) URL, got {self.url!r}")
        problem = None if self.run is None else value_problem(RUN_NAME, self.run)
        if problem is not None:  # the service would refuse every batch of it
            raise ValueError(f"RUNHEALTH_RUN {self.run!r} is not a run name the service takes: {problem}")


class Outcome(enum.Enum):
    DELIVERED = "delivered"
    RETRY = "retry"
    REJECTED = "rejected"


@dataclass(frozen=True)
class Delivery:
    outcome: Outcome
    status: int | None = None
    reason: str = ""
    bad_indexes: tuple[int, ...] = ()  # the records the service named as the problem
    # The rank's pending directives, when the service answered them with the batch.
    directives: list[dict[str, Any]] | None = None
    # Seconds the service asked the sender to wait before the next try (its Retry-After).
    retry_after_s: float | None = None


class Connection:
    """A keep-alive connection to one service; reconnects after any failure."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        self._prefix = parts.path.rstrip("/")
        self._connection = HttpConnection(
            parts.hostname or "127.0.0.1", parts.port, https=parts.scheme == "https", timeout_s=timeout_s
        )

    def get(self, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        reused = self._connection.is_open
        try:
            return self._exchange(path, None, headers, "GET")
        except STALE_CONNECTION:
            if not reused:
                raise
        return self._exchange(path, None, headers, "GET")

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """The status and body; raises ``OSError`` or ``http.client.HTTPException`` on failure.

        A kept-alive connection the server has since closed (uvicorn closes idle ones after
        5 s) fails on first use; that one failure is retried at once on a new connection, which
        is safe because the service stores a record once per key."""
        reused = self._connection.is_open
        try:
            return self._exchange(path, body, headers)
        except STALE_CONNECTION:
            if not reused:
                raise
        return self._exchange(path, body, headers)

    def _exchange(
        self, path: str, body: bytes | None, headers: dict[str, str], method: str = "POST"
    ) -> tuple[int, bytes]:
        try:
            return self._connection.request(method, self._prefix + path, body, headers)
        except (OSError, http.client.HTTPException):
            self.close()  # a half-used connection is never reused
            raise

    @property
    def retry_after(self) -> str | None:
        """The ``Retry-After`` of the last answer on this connection."""
        return self._connection.retry_after

    def close(self) -> None:
        self._connection.close()


class HttpTransport:
    """Posts batches for one run with one bearer token."""

    def __init__(self, config: TransportConfig) -> None:
        if config.url is None or config.run is None:
            raise ValueError("HttpTransport needs a URL and a run")
        self._connection = Connection(config.url, config.timeout_s)
        self._poll_connection = Connection(config.url, config.timeout_s)
        self._path = f"/v1/runs/{quote(str(config.run), safe='')}/records"
        self._post_path = self._path  # with the rank's question once asked to carry it
        self._headers = {
            "authorization": f"Bearer {config.token or ''}",
            "content-type": "application/json",
        }

    def ask_directives_with_posts(self, incarnation: str, rank: int) -> None:
        """From now on each POST asks for this rank's pending directives too: the answer that
        comes back with a batch spares the sender that cycle's separate poll (one request
        instead of two per rank every few seconds, at the service as at the trainer)."""
        self._post_path = f"{self._path}?{urlencode({'incarnation': incarnation, 'rank': rank})}"

    def post(self, records: Sequence[Record]) -> Delivery:
        try:
            body = encode_batch(records)
        except TypeError as exc:  # the batch is at fault: those records are named, the rest sent
            return unencodable(records, exc)
        try:
            status, body = self._connection.post(self._post_path, body, self._headers)
        except (OSError, http.client.HTTPException) as exc:  # the service, not the batch
            return Delivery(Outcome.RETRY, None, f"{type(exc).__name__}: {exc}")
        delivery = classify(status, body, self._connection.retry_after)
        if delivery.outcome is Outcome.DELIVERED and self._post_path != self._path:
            items = json_body(body).get("directives")
            if isinstance(items, list):
                return Delivery(Outcome.DELIVERED, status, directives=items)
        return delivery

    def directives(self, incarnation: str, rank: int) -> list[dict[str, Any]] | None:
        """The service's pending directives for this rank (``None``: not reachable now). On a
        connection of its own: the sender's may be mid-batch."""
        path = f"{self._path.rsplit('/', 1)[0]}/directives?incarnation={incarnation}&rank={rank}"
        try:
            status, body = self._poll_connection.get(path, {"authorization": self._headers["authorization"]})
        except (OSError, http.client.HTTPException):
            return None
        if status != 200:
            return None
        items = json_body(body).get("directives")
        return items if isinstance(items, list) else None

    def close(self) -> None:
        self._connection.close()
        self._poll_connection.close()


def unencodable(records: Sequence[Record], error: Exception) -> Delivery:
    """A batch JSON cannot carry (an integer past 64 bits, text with a lone surrogate): rejected
    here as the service would reject an invalid record, naming those records and why."""
    problems = encoding_problems(records)
    reason = "; ".join(f"record {index}: {problem}" for index, problem in problems.items()) or str(error)
    return Delivery(Outcome.REJECTED, None, f"not encodable as JSON: {reason}"[:2000], tuple(problems))


def classify(status: int, body: bytes, retry_after: str | None = None) -> Delivery:
    if 200 <= status < 300:
        return Delivery(Outcome.DELIVERED, status)
    document = json_body(body)
    message = document.get("message") or body[:500].decode(errors="replace")
    reason = f"{status} {document.get('error', '')}: {message}"
    if status in RETRY_STATUSES or status in REFUSED_STATUSES or status >= 500:
        return Delivery(Outcome.RETRY, status, reason, retry_after_s=retry_after_s(retry_after, time.time()))
    return Delivery(Outcome.REJECTED, status, reason, named_records(document))


def retry_after_s(value: str | None, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (RFC 9110, 10.2.3): delay-seconds, or an
    HTTP date, from ``now`` (Unix time; a date already past is 0). None when absent or not
    either form: the sender's own backoff decides then."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():  # more than 12 digits: longer than anyone waits
        return float(int(text)) if len(text) <= 12 else float("inf")
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000": the HTTP date is always UTC
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now)


def named_records(document: dict[str, Any]) -> tuple[int, ...]:
    """The indexes a 422 (``problems``) or a 409 (``index``) names, without repeats."""
    indexes = [problem.get("index") for problem in document.get("problems") or []]
    indexes.append(document.get("index"))
    return tuple(sorted({i for i in indexes if isinstance(i, int) and i >= 0}))


def json_body(body: bytes) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}


def post_json(url: str, path: str, document: Any, token: str, timeout_s: float) -> tuple[int, bytes]:
    """One JSON POST (creating the embedded service's run). Raises ``OSError`` on failure."""
    connection = Connection(url, timeout_s)
    try:
        headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
        return connection.post(path, json.dumps(document).encode(), headers)
    except http.client.HTTPException as exc:
        raise OSError(str(exc)) from exc
    finally:
        connection.close()
