"""Attaching a rank: who it is, which incarnation and run, where its records go.

Collectives happen here and nowhere else: one broadcast (rank 0's incarnation id and run
name). With the embedded service, global rank 0 starts it and the other ranks learn its
endpoint through the job's c10d store (``collectors.rendezvous``), not a collective.
"""

from __future__ import annotations

import functools
import logging
import socket
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from collectors.backoff import rank_seed
from collectors.collectives import Collectives
from collectors.config import RunHealthConfig, default_run_name, launcher_run_name
from collectors.counters import Counters
from collectors.embedded import EmbeddedService, Endpoint, store_path
from collectors.layout import Identity
from collectors.relay import NodeRelay, RelayLookup, RelayTransport, local_world_size, node_key
from collectors.rendezvous import Rendezvous
from collectors.sender import Sender, Transport
from collectors.spool import MemorySpool, Spool
from collectors.transport import Delivery, HttpTransport, Outcome
from collectors.window import prepare_batch
from collectors.wire import Record

log = logging.getLogger("runhealth.collectors")


@dataclass(frozen=True)
class RunId:
    incarnation: str
    run: str
    by_start_time: bool = False
    """Named from this start's time: neither the user nor the launcher named the job, so a
    later start (a resume) will be another run."""


def agree_on_run(collectives: Collectives, run: str | None, environ: Mapping[str, str]) -> RunId:
    """Every rank proposes; rank 0's proposal wins, in one broadcast."""
    named = run or launcher_run_name(environ)
    proposal = RunId(str(uuid.uuid4()), named or default_run_name(environ, time.time()), named is None)
    agreed: RunId = collectives.broadcast(proposal)
    return agreed


@dataclass
class Destination:
    """Where this rank sends, and the embedded service if this rank runs the job's."""

    url: str | None
    token: str | None
    endpoint: Endpoint | None = None
    service: EmbeddedService | None = None
    ranks: int = 1
    rendezvous: Rendezvous | None = None
    relay: NodeRelay | None = None
    """The node's relay, when this rank (local rank 0) runs it."""
    relay_lookup: RelayLookup | None = None
    """Where this rank sends: its node's relay, once found (every rank of the node, local rank
    0 too)."""
    grid_phase_s: float | None = None
    """The phase of the node's flush grid, when it sends through a relay."""


def configured(config: RunHealthConfig) -> Destination:
    return Destination(config.transport.url, config.transport.token)


def embedded(
    config: RunHealthConfig,
    identity: Identity,
    run: str,
    collectives: Collectives,
    environ: Mapping[str, str],
    rendezvous: Rendezvous | None,
) -> Destination:
    """Global rank 0 starts the job's one service; every other rank, on every node, reads its
    endpoint from the job's store (or, where the job has none that can be reached, from one
    broadcast at attach)."""
    service, endpoint, reason = None, None, ""
    if identity.rank == 0:
        service, endpoint, reason = start_service(config, run, environ)
    if collectives.world_size > 1:
        if rendezvous is None:
            endpoint = collectives.broadcast(endpoint)
        elif identity.rank == 0:
            rendezvous.publish(endpoint, reason)
        else:
            endpoint = rendezvous.endpoint(config.embedded.start_timeout_s + 30.0)
    return Destination(
        url=endpoint.url if endpoint else None,
        token=endpoint.token if endpoint else None,
        endpoint=endpoint,
        service=service,
        ranks=collectives.world_size,
        rendezvous=rendezvous,
    )


def node_relay(
    config: RunHealthConfig,
    identity: Identity,
    run: str,
    destination: Destination,
    environ: Mapping[str, str],
    rendezvous: Rendezvous | None,
    counters: Counters,
    host: str,
) -> Destination:
    """Local rank 0 starts its node's relay and publishes it in the job's c10d store; every
    rank of the node sends through it once it finds it there (``collectors.relay``), and
    directly until then. Only where the launcher says the node has several ranks and the job
    has a store."""
    ranks_here = local_world_size(environ)
    if (
        not config.relay.enabled
        or destination.url is None
        or rendezvous is None
        or identity.local_rank is None
        or ranks_here is None
        or ranks_here < 2
    ):
        return destination
    key = node_key(environ, host)
    relay, lookup = None, None
    if identity.local_rank == 0:
        upstream = replace(config.transport, url=destination.url, token=destination.token, run=run)
        url, reason = None, ""
        try:
            relay = NodeRelay(config.relay, upstream, ranks_here, counters)
            url = relay.start()
        except Exception as exc:  # the node's ranks must learn of it and send directly
            log.error("runhealth: the node relay did not start (%s); each rank sends directly", exc)
            relay, reason = None, str(exc)
        rendezvous.publish_relay(key, url, reason)
        if url is None:
            return destination
        lookup = RelayLookup.known(url)
    else:
        lookup = RelayLookup(functools.partial(rendezvous.relay, key))
    # Nodes flush at different phases, so the service is not asked by every node at once.
    phase = zlib.crc32(key.encode()) % 1000 / 1000 * config.sender.flush_interval_s
    return replace(destination, relay=relay, relay_lookup=lookup, grid_phase_s=phase)


def start_service(
    config: RunHealthConfig, run: str, environ: Mapping[str, str]
) -> tuple[EmbeddedService | None, Endpoint | None, str]:
    """Rank 0: the service and its endpoint, or why it did not start."""
    service = EmbeddedService(config.embedded, environ)
    try:
        endpoint = service.start(run)
    except Exception as exc:  # whatever went wrong, every rank must learn of it and go on
        log.error("runhealth: the embedded service did not start (%s); spooling to disk", exc)
        service.stop(None)
        return None, None, str(exc)
    announce(config.embedded.db, run, service)
    return service, endpoint, ""


def announce(db: str, run: str, service: EmbeddedService) -> None:
    """The one line an operator needs: where the records are and how to look at them."""
    path = store_path(db)
    where = str(path) if path is not None else db
    print(
        f"runhealth: run {run} is recorded in {where} (service {service.url}, pid {service.pid}); "
        f"incidents: runhealth incidents --db {where} --run {run}",
        file=sys.stderr,
        flush=True,
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
        upstream = replace(config.transport, url=destination.url, token=destination.token, run=ids.run)
        if destination.relay_lookup is not None:
            transport = RelayTransport(destination.relay_lookup, upstream, config.relay, counters)
        else:
            transport = HttpTransport(upstream)
    spool = open_spool(config, ids.run, spool_name(identity, ids.incarnation), counters)
    return Sender(
        config.sender,
        transport,
        spool,
        counters,
        heartbeat=heartbeat,
        poll=poll,
        directives=directives,
        prepare=prepare_batch,
        seed=rank_seed(ids.run, ids.incarnation, identity.rank),  # ranks back off apart
        grid_phase_s=destination.grid_phase_s,
    )


def open_spool(config: RunHealthConfig, run: str, name: str, counters: Counters) -> Spool | MemorySpool:
    """The spool on disk, or, when its directory cannot be written, one in memory (said once:
    the records are sent directly, and what the service cannot take waits in memory)."""
    try:
        return Spool(config.spool, run, name, counters)
    except OSError as exc:
        log.error(
            "runhealth: the spool directory %s cannot be written (%s); sending directly, keeping "
            "at most %d MiB of undelivered records in memory (lost if this process dies)",
            config.spool.directory,
            exc,
            config.spool.max_bytes // (1024 * 1024),
        )
        return MemorySpool(config.spool, run, name, counters)


def spool_name(identity: Identity, incarnation: str) -> str:
    return f"{identity.node}.rank{identity.rank}.{incarnation}"


def hostname() -> str:
    return socket.gethostname()
