"""Where the job's embedded service listens (``collectors/embedded.py``), and how its endpoint
reaches every rank through the job's c10d store (``collectors/rendezvous.py``, on a real
``HashStore``)."""

from __future__ import annotations

import socket
import time

import pytest

from collectors.embedded import EmbeddedConfig, Endpoint, listen_host, store_path
from collectors.rendezvous import Rendezvous
from tests.support import require_module


def this_hosts_address() -> str | None:
    """A non-loopback address of this machine, if it has one (the route toward a public one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") else address


def test_the_service_listens_toward_the_rendezvous_address_and_on_loopback_when_it_is_local() -> None:
    config = EmbeddedConfig()
    assert listen_host(config, {}) == "127.0.0.1"  # a single process: no rendezvous
    assert listen_host(config, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}) == "127.0.0.1"
    assert listen_host(config, {"MASTER_ADDR": "localhost"}) == "127.0.0.1"
    assert listen_host(EmbeddedConfig(host="0.0.0.0"), {"MASTER_ADDR": "127.0.0.1"}) == "0.0.0.0"
    own = this_hosts_address()
    if own is not None:
        assert listen_host(config, {"MASTER_ADDR": own, "MASTER_PORT": "29500"}) == own


def test_an_unresolvable_rendezvous_address_falls_back_to_loopback_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert listen_host(EmbeddedConfig(), {"MASTER_ADDR": "no-such-host.invalid"}) == "127.0.0.1"
    assert "cannot route to MASTER_ADDR 'no-such-host.invalid'" in caplog.text


def test_the_store_path_is_absolute_for_a_file_and_none_for_a_database_url() -> None:
    path = store_path("runhealth.db")
    assert path is not None and path.is_absolute() and path.name == "runhealth.db"
    assert store_path("postgresql+psycopg2://u@h/db") is None


def test_every_rank_reads_the_endpoint_rank_0_published() -> None:
    torch = require_module("torch")
    store = torch.distributed.HashStore()
    rank0, other = Rendezvous(store, "inc-1"), Rendezvous(store, "inc-1")
    rank0.publish(Endpoint("http://10.0.0.1:4000", "rh_run_x"), "")
    assert other.endpoint(timeout_s=1.0) == Endpoint("http://10.0.0.1:4000", "rh_run_x")
    assert Rendezvous(store, "inc-2").endpoint(timeout_s=0.2) is None  # another start's keys


def test_a_service_that_did_not_start_stops_the_ranks_waiting_and_they_spool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch = require_module("torch")
    store = torch.distributed.HashStore()
    Rendezvous(store, "inc").publish(None, "runhealth serve exited at start")
    started = time.monotonic()
    assert Rendezvous(store, "inc").endpoint(timeout_s=30.0) is None
    assert time.monotonic() - started < 1.0
    assert "rank 0 could not start the service (runhealth serve exited at start)" in caplog.text


def test_ranks_done_are_counted_until_the_world_size() -> None:
    torch = require_module("torch")
    rendezvous = Rendezvous(torch.distributed.HashStore(), "inc")
    for _ in range(3):
        rendezvous.done()
    assert not rendezvous.finished(4)
    rendezvous.done()
    assert rendezvous.finished(4)
