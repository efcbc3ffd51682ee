"""Where the job's embedded service listens (``collectors/embedded.py``), and how its endpoint
reaches every rank through the job's c10d store (``collectors/rendezvous.py``, on a real
``HashStore``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collectors.embedded import EmbeddedConfig, EmbeddedService, Endpoint, listen_host, store_path
from collectors.rendezvous import Rendezvous
from monitor.__main__ import shadowing_packages
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


def shadowing_workdir(path: Path) -> Path:
    """A trainer's working directory with its own ``monitor``, ``policies`` and ``migrations``
    packages, each failing on import."""
    for name in ("monitor", "policies", "migrations"):
        (path / name).mkdir(parents=True)
        (path / name / "__init__.py").write_text(
            f"raise ImportError('the trainer own {name} was imported')\n"
        )
    return path


def test_the_embedded_service_starts_in_a_directory_with_its_own_monitor_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child runs with ``python -P``: the trainer's working directory is not on its path."""
    workdir = shadowing_workdir(tmp_path / "trainer")
    monkeypatch.chdir(workdir)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("RUNHEALTH_", "PYTHONPATH"))}
    service = EmbeddedService(
        EmbeddedConfig(db=str(tmp_path / "store" / "r.db"), start_timeout_s=60.0), environ
    )
    try:
        endpoint = service.start("shadowed")
        log = service.log_path.read_text()
    finally:
        service.stop(None)  # by its PID
    assert endpoint.token.startswith("rh_run") and "trainer own" not in log


def test_python_m_monitor_warns_of_packages_the_working_directory_shadows(tmp_path: Path) -> None:
    (tmp_path / "policies").mkdir()  # a folder, not a package: runhealth's own still wins
    done = subprocess.run(
        [sys.executable, "-m", "monitor", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    (warning,) = [line for line in done.stderr.splitlines() if "warning" in line]
    assert (
        warning.startswith("runhealth: warning: policies/ in the working directory")
        and "python -P" in warning
    )
    assert shadowing_packages(
        [str(tmp_path), *sys.path[1:]], tmp_path, Path(__file__).resolve().parent.parent
    ) == ["policies"]
    own_root = Path(__file__).resolve().parent.parent
    assert shadowing_packages([str(own_root)], own_root, own_root) == []  # runhealth's own checkout
    assert shadowing_packages(["/usr/bin"], tmp_path, own_root) == []  # the ``runhealth`` script
