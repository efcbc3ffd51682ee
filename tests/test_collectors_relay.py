"""The node relay (``collectors.relay``) against a real ``runhealth serve``: a node's batches go
upstream together, each rank hears the service's answer to its own records (its directives, a
conflict of its own), a service that is down is down for every rank, and a relay that is gone
is bypassed. The four-rank runs through it are in ``test_collectors_multirank.py``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from collectors.attach import Destination, node_relay
from collectors.config import ConfigError, RunHealthConfig
from collectors.counters import Counters
from collectors.layout import Identity, data_parallel
from collectors.relay import NodeRelay, RelayConfig, RelayLookup, RelayTransport, node_key
from collectors.rendezvous import Rendezvous
from collectors.sender import Sender, SenderConfig
from collectors.spool import MemorySpool, SpoolConfig
from collectors.transport import Delivery, Outcome, TransportConfig
from tests.collectors_support import ADMIN, ServeProcess, serving, step_rows
from tests.support import free_port, require_module

RANKS = 4


def step(attempt: int, rank: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "step", "incarnation": "inc-1", "rank": rank, "attempt": attempt, "step": attempt,
            "time": 1_700_000_000.0 + attempt, **extra}  # fmt: skip


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory.mktemp("serve")) as process:
        yield process


class Node:
    """A relay and one transport per rank through it, as attach makes them."""

    def __init__(self, url: str, token: str, run: str, gather_s: float = 2.0) -> None:
        self.counters = Counters()
        self.config = RelayConfig(gather_s=gather_s, retry_relay_s=60.0)
        self.upstream = TransportConfig(url=url, token=token, run=run, timeout_s=5.0)
        self.relay = NodeRelay(self.config, self.upstream, RANKS, self.counters)
        relay_url = self.relay.start()
        self.transports = [
            RelayTransport(RelayLookup.known(relay_url), self.upstream, self.config, self.counters)
            for _ in range(RANKS)
        ]
        for rank, transport in enumerate(self.transports):
            transport.ask_directives_with_posts("inc-1", rank)

    def post_together(self, batches: Sequence[list[dict[str, Any]]]) -> list[Delivery]:
        """Every rank posts at once (each on its own thread, as each rank's sender would)."""
        deliveries: list[Delivery | None] = [None] * len(batches)

        def post(rank: int) -> None:
            deliveries[rank] = self.transports[rank].post(batches[rank])

        threads = [threading.Thread(target=post, args=(rank,)) for rank in range(len(batches))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert all(delivery is not None for delivery in deliveries)
        return [delivery for delivery in deliveries if delivery is not None]

    def close(self) -> None:
        self.relay.stop()
        for transport in self.transports:
            transport.close()


@pytest.fixture
def node(serve: ServeProcess, request: pytest.FixtureRequest) -> Iterator[Node]:
    run = request.node.name.replace("_", "-")[:60].strip("-")
    made = Node(serve.url, serve.create_run(run), run)
    yield made
    made.close()


def run_of(node: Node) -> str:
    assert node.upstream.run is not None
    return node.upstream.run


def test_a_nodes_batches_go_upstream_as_one_and_each_rank_gets_its_own_directives(
    serve: ServeProcess, node: Node
) -> None:
    run = run_of(node)
    created = httpx.post(
        f"{serve.url}/v1/runs/{run}/directives",
        json={"kind": "dump_stacks", "ranks": [2]},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert created.status_code == 201, created.text
    # gather_s is 2 s: one upstream post means the relay sent when all four were there.
    deliveries = node.post_together([[step(1, rank), step(2, rank)] for rank in range(RANKS)])
    assert [d.outcome for d in deliveries] == [Outcome.DELIVERED] * RANKS
    assert [len(d.directives or []) for d in deliveries] == [0, 0, 1, 0]
    assert node.counters.snapshot()["relay_posts"] == 1
    assert node.counters.snapshot()["relay_batches"] == RANKS
    rows = step_rows(serve.db, run)
    assert sorted((row["rank"], row["attempt"]) for row in rows) == [
        (r, a) for r in range(RANKS) for a in (1, 2)
    ]


def test_a_conflict_in_one_ranks_batch_is_that_ranks_alone(serve: ServeProcess, node: Node) -> None:
    run = run_of(node)
    assert node.post_together([[step(1, rank, loss_sum=1.0)] for rank in range(RANKS)])[0].status == 200
    # Rank 1 re-sends attempt 1 with other content: all or nothing would refuse every rank's
    # records with it, so the relay sends each rank's batch again on its own.
    batches = [[step(2, rank)] for rank in range(RANKS)]
    batches[1] = [step(2, 1), step(1, 1, loss_sum=2.0)]
    deliveries = node.post_together(batches)
    assert [d.outcome for d in deliveries] == [
        Outcome.DELIVERED,
        Outcome.REJECTED,
        Outcome.DELIVERED,
        Outcome.DELIVERED,
    ]
    assert deliveries[1].status == 409 and deliveries[1].bad_indexes == (1,)  # its own index
    stored = {(row["rank"], row["attempt"]) for row in step_rows(serve.db, run)}
    assert stored == {(r, a) for r in range(RANKS) for a in (1, 2)} - {(1, 2)}
    assert node.counters.snapshot()["relay_posts"] == 1 + 1 + RANKS


def test_a_service_that_is_down_is_down_for_every_rank_and_a_wrong_token_is_refused(tmp_path: Path) -> None:
    node = Node(f"http://127.0.0.1:{free_port()}", "rh_run_x", "down", gather_s=0.5)
    try:
        deliveries = node.post_together([[step(1, rank)] for rank in range(RANKS)])
        assert [(d.outcome, d.status) for d in deliveries] == [(Outcome.RETRY, 503)] * RANKS
        assert "service_unreachable" in deliveries[0].reason
        assert node.counters.snapshot()["relay_bypassed"] == 0  # the relay answered: no bypass
        stranger = httpx.post(
            f"{node.relay.url}/v1/runs/down/records",
            json={"records": []},
            headers={"authorization": "Bearer other"},
        )
        assert stranger.status_code == 401
    finally:
        node.close()


def test_a_rank_whose_relay_stopped_sends_directly(serve: ServeProcess, node: Node) -> None:
    run = run_of(node)
    node.relay.stop()
    delivery = node.transports[3].post([step(1, 3)])
    assert delivery.outcome is Outcome.DELIVERED and delivery.directives == []
    assert node.counters.snapshot()["relay_bypassed"] == 1
    assert [(row["rank"], row["attempt"]) for row in step_rows(serve.db, run)] == [(3, 1)]


def test_local_rank_0_closing_first_keeps_the_relay_up_until_the_nodes_ranks_closed(
    serve: ServeProcess, node: Node
) -> None:
    run = run_of(node)
    stopper = threading.Thread(target=node.relay.stop, kwargs={"wait_for_ranks_s": 60.0})
    for rank in range(3):
        node.transports[rank].close()  # local rank 0 among them: its hook stops the relay next
    stopper.start()
    time.sleep(0.3)
    assert stopper.is_alive()  # rank 3 has not closed yet
    delivery = node.transports[3].post([step(1, 3)])  # its last batch, after local rank 0 closed
    assert delivery.outcome is Outcome.DELIVERED
    assert node.counters.snapshot()["relay_bypassed"] == 0
    assert node.counters.snapshot()["relay_batches"] == 1
    node.transports[3].close()
    stopper.join(10)
    assert not stopper.is_alive()
    assert [(row["rank"], row["attempt"]) for row in step_rows(serve.db, run)] == [(3, 1)]


def test_the_relay_waits_for_a_rank_that_never_closes_only_as_long_as_its_bound(node: Node) -> None:
    node.transports[0].close()
    started = time.monotonic()
    node.relay.stop(wait_for_ranks_s=0.5)
    assert 0.5 <= time.monotonic() - started < 5.0
    assert node.transports[1].post([step(1, 1)]).outcome is Outcome.DELIVERED  # directly
    assert node.counters.snapshot()["relay_bypassed"] == 1


def test_ranks_of_a_node_flush_and_beat_on_one_grid() -> None:
    """Each rank's cycles fall on the node's grid (its phase, every flush interval) and its
    heartbeats on grid points never more than the heartbeat interval apart."""
    clock = {"now": 100.37}
    config = SenderConfig(flush_interval_s=2.0, heartbeat_interval_s=5.0)
    counters = Counters()
    sender = Sender(
        config,
        RecordingTransport(),
        MemorySpool(SpoolConfig(), "r", "n", counters),
        counters,
        heartbeat=lambda: {"kind": "heartbeat"},
        clock=lambda: clock["now"],
        grid_phase_s=0.25,
    )
    assert sender._next_flush(100.37) == pytest.approx(100.25 + 2.0)
    assert sender._next_flush(102.25) == pytest.approx(104.25)  # on a point: the next one
    beats = []
    for now in (102.26, 104.26, 106.26, 108.26, 110.26, 112.26):
        clock["now"] = now
        before = counters.snapshot()["heartbeats_sent"]
        sender._maybe_heartbeat()
        if counters.snapshot()["heartbeats_sent"] > before:
            beats.append(now)
    assert beats == [102.26, 106.26, 110.26]  # every 4 s: the grid point before 5 s is due


def test_the_relays_node_is_torchruns_node_rank_else_the_host() -> None:
    assert node_key({"GROUP_RANK": "3", "SLURM_NODEID": "1"}, "host-a") == "group3"
    assert node_key({"SLURM_NODEID": "1"}, "host-a") == "slurm1"
    assert node_key({}, "host-a") == "host-host-a"


class RecordingTransport:
    def post(self, records: Any) -> Delivery:
        return Delivery(Outcome.DELIVERED, 200)

    def close(self) -> None:
        return None


def identity(local_rank: int) -> Identity:
    # Each rank names its own node (RUNHEALTH_NODE, as the recovery tests set it): the relay's
    # node is the machine's, so they still share one.
    return Identity(
        local_rank, 2, local_rank, f"node-{local_rank}", "cpu", None, data_parallel(local_rank, 2)
    )


def test_local_rank_0_publishes_its_relay_in_the_jobs_store_and_the_others_send_through_it(
    serve: ServeProcess,
) -> None:
    torch = require_module("torch")
    store = Rendezvous(torch.distributed.HashStore(), "inc-1")  # the c10d store attach uses
    environ = {"LOCAL_WORLD_SIZE": "2"}
    config = RunHealthConfig()
    direct = Destination(url=serve.url, token="rh_run_x")
    counters = Counters()
    # The other rank attaches first: it does not wait for the relay, and finds it later.
    other = node_relay(config, identity(1), "relay-found", direct, environ, store, Counters(), "host-a")
    assert other.relay is None and other.relay_lookup is not None
    assert other.relay_lookup.url() is None  # not published yet: sent directly meanwhile
    leader = node_relay(config, identity(0), "relay-found", direct, environ, store, counters, "host-a")
    try:
        assert leader.relay is not None and leader.relay_lookup is not None
        assert other.relay_lookup.url() == leader.relay_lookup.url() == leader.relay.url
        assert other.grid_phase_s == leader.grid_phase_s  # one grid for the node
    finally:
        if leader.relay is not None:
            leader.relay.stop()
    # Off, or where the launcher does not say the node has several ranks: sent directly.
    off = RunHealthConfig.from_environ({"RUNHEALTH_RELAY__ENABLED": "0"})
    assert node_relay(off, identity(0), "r", direct, environ, store, counters, "host-a") is direct
    assert node_relay(config, identity(0), "r", direct, {}, store, counters, "host-a") is direct
    assert node_relay(config, identity(0), "r", direct, environ, None, counters, "host-a") is direct
    with pytest.raises(ConfigError, match="RUNHEALTH_RELAY__GATHER_S"):
        RunHealthConfig.from_environ({"RUNHEALTH_RELAY__GATHER_S": "0"})


def test_a_relay_never_published_costs_a_rank_nothing_and_it_stops_asking(serve: ServeProcess) -> None:
    """A rank whose node's relay never appears (local rank 0 attached without it) sends every
    batch directly from the first, and asks the store only until ``for_s`` has passed. Before,
    it waited 90 s at attach for the key while its peers waited for it in a collective."""
    run = "relay-never"
    token = serve.create_run(run)
    asked, clock = [], {"now": 0.0}

    def read() -> tuple[bool, str | None]:
        asked.append(clock["now"])
        return False, None

    lookup = RelayLookup(read, for_s=120.0, clock=lambda: clock["now"])
    counters = Counters()
    transport = RelayTransport(lookup, TransportConfig(serve.url, token, run, 5.0), RelayConfig(), counters)
    try:
        for attempt, now in enumerate((0.0, 60.0, 121.0, 200.0), start=1):
            clock["now"] = now
            assert transport.post([step(attempt, 1)]).outcome is Outcome.DELIVERED
    finally:
        transport.close()
    assert asked == [0.0, 60.0, 121.0]  # not after for_s
    assert counters.snapshot()["relay_bypassed"] == 0  # no relay to bypass
    assert len(step_rows(serve.db, run)) == 4
