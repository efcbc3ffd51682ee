"""Attaching a rank: who it is, which incarnation and run, where its records go.

Collectives happen here and nowhere else: one broadcast (rank 0's incarnation id and run
name), and with the embedded service one all-gather (each node's service endpoint).
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from collectors.collectives import Collectives
from collectors.config import RunHealthConfig, default_run_name
from collectors.counters import Counters
from collectors.embedded import EmbeddedService, Endpoint
from collectors.layout import Identity
from collectors.sender import Sender, Transport
from collectors.spool import Spool
from collectors.transport import Delivery, HttpTransport, Outcome
from collectors.window import prepare_batch
from collectors.wire import Record

log = logging.getLogger("runhealth.collectors")


@dataclass(frozen=True)
class RunId:
    incarnation: str
    run: str


def agree_on_run(collectives: Collectives, run: str | None, environ: Mapping[str, str]) -> RunId:
    """Every rank proposes; rank 0's proposal wins, in one broadcast."""
    proposal = RunId(str(uuid.uuid4()), run or default_run_name(environ, time.time()))
    agreed: RunId = collectives.broadcast(proposal)
    return agreed


@dataclass
class Destination:
    """Where this rank sends, and the embedded service if this rank runs the node's."""

    url: str | None
    token: str | None
    endpoint: Endpoint | None = None
    service: EmbeddedService | None = None
    node_ranks: int = 1


def configured(config: RunHealthConfig) -> Destination:
    return Destination(config.transport.url, config.transport.token)


def embedded(
    config: RunHealthConfig,
    identity: Identity,
    run: str,
    collectives: Collectives,
    environ: Mapping[str, str],
) -> Destination:
    """The node's local rank 0 starts the service; one all-gather tells the node's ranks."""
    service, endpoint = None, None
    if identity.local_rank == 0:
        service = EmbeddedService(config.embedded, environ)
        try:
            endpoint = service.start(run)
        except Exception as exc:  # whatever went wrong, every rank must reach the all-gather
            log.error("runhealth: the embedded service did not start (%s); spooling to disk", exc)
            service.stop(None, 0)
            service = None
    gathered = collectives.all_gather((identity.node, endpoint))
    mine = next((e for node, e in gathered if node == identity.node and e is not None), None)
    if mine is None and identity.local_rank is None:
        log.warning("runhealth: LOCAL_RANK is unset, so no rank could start this node's service")
    return Destination(
        url=mine.url if mine else None,
        token=mine.token if mine else None,
        endpoint=mine,
        service=service,
        node_ranks=sum(1 for node, _ in gathered if node == identity.node),
    )


class Unreachable:
    """The transport when there is no service at all: every batch waits in the spool."""

    def post(self, records: Any) -> Delivery:
        return Delivery(Outcome.RETRY, None, "no service URL and no embedded service")

    def close(self) -> None:
        return None


def build_sender(
    config: RunHealthConfig,
    identity: Identity,
    ids: RunId,
    destination: Destination,
    counters: Counters,
    *,
    transport: Transport | None,
    heartbeat: Callable[[], Record | None],
    poll: Callable[[], None],
    directives: Callable[[list[dict[str, Any]]], None],
) -> Sender:
    """The sender over ``transport`` if one was given, else HTTP to the destination."""
    if transport is None and destination.url is None:
        transport = Unreachable()
    elif transport is None:
        transport = HttpTransport(
            replace(config.transport, url=destination.url, token=destination.token, run=ids.run)
        )
    spool = Spool(config.spool, ids.run, spool_name(identity, ids.incarnation), counters)
    return Sender(
        config.sender,
        transport,
        spool,
        counters,
        heartbeat=heartbeat,
        poll=poll,
        directives=directives,
        prepare=prepare_batch,
    )


def spool_name(identity: Identity, incarnation: str) -> str:
    return f"{identity.node}.rank{identity.rank}.{incarnation}"


def hostname() -> str:
    return socket.gethostname()
