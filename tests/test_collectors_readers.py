"""The device and link readers the hook starts at attach (``collectors/readers.py``): which rank
runs which reader, one setting to turn each off, and a hooked training on the CPU (a hand-written
loop) against a real ``runhealth serve`` on SQLite, with ``pynvml`` faked at its narrowest point
(the module the NVML reader imports, as in ``test_collectors_nvml.py``) and a directory laid out
like ``/sys/class/infiniband``: device and link samples are stored, and an uncorrected ECC error
injected mid-run opens a critical ``device`` incident."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors import LinkReader, NvmlReader, ReadersConfig, RunHealth, RunHealthConfig
from collectors.layout import Identity, data_parallel
from collectors.readers import build_readers
from tests.adapters_support import run_rows
from tests.collectors_support import RecordingTransport, ServeProcess, serving, wait_until
from tests.support import require_module
from tests.test_collectors_nvml import FakeNvml, gpu

UUID = "GPU-0123abcd-0000-1111-2222-333333333333"


def identity(rank: int = 0, local_rank: int | None = 0, device: str = "cpu", world: int = 4) -> Identity:
    return Identity(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        node="node-a",
        device=device,
        device_uuid=UUID if device.startswith("cuda") else None,
        layout=data_parallel(rank, world),
    )


def readers_of(config: ReadersConfig, who: Identity) -> tuple[list[Any], dict[str, str]]:
    readers = build_readers(config, who, lambda record: None, {})
    return readers.samplers, readers.plan


# --- which rank reads what ---------------------------------------------------------------------


def test_a_cuda_rank_reads_its_own_device_by_uuid_and_every_node_first_rank_its_ports() -> None:
    [nvml, links] = readers_of(ReadersConfig(), identity(rank=4, local_rank=0, device="cuda:0"))[0]
    assert isinstance(nvml, NvmlReader) and isinstance(links, LinkReader)
    assert (nvml._device_uuid, nvml._rank, nvml._node) == (UUID, 4, "node-a")
    [nvml] = readers_of(ReadersConfig(), identity(rank=5, local_rank=1, device="cuda:1"))[0]
    assert isinstance(nvml, NvmlReader) and nvml._device_uuid == UUID  # no link reader: not local 0


def test_a_cpu_rank_leaves_the_node_gpus_to_the_node_first_rank() -> None:
    [nvml, _] = readers_of(ReadersConfig(), identity(rank=0, local_rank=0))[0]
    assert isinstance(nvml, NvmlReader) and nvml._rank is None and nvml._device_uuid is None
    samplers, plan = readers_of(ReadersConfig(), identity(rank=1, local_rank=1))
    assert samplers == [] and plan["nvml"].startswith("not on this rank")
    assert plan["links"].startswith("not on this rank")


def test_without_local_ranks_global_rank_0_reads_for_its_node() -> None:
    assert len(readers_of(ReadersConfig(), identity(rank=0, local_rank=None))[0]) == 2
    assert readers_of(ReadersConfig(), identity(rank=2, local_rank=None))[0] == []


def test_each_reader_is_off_with_one_variable() -> None:
    environ = {"RUNHEALTH_READERS__NVML": "0", "RUNHEALTH_READERS__LINKS": "off"}
    config = RunHealthConfig.from_environ(environ).readers
    assert (config.nvml, config.links) == (False, False)
    samplers, plan = readers_of(config, identity(device="cuda:0"))
    assert samplers == []
    assert plan == {"nvml": "off (RUNHEALTH_READERS__NVML=0)", "links": "off (RUNHEALTH_READERS__LINKS=0)"}


def test_the_intervals_and_the_sysfs_root_are_settings(tmp_path: Path) -> None:
    environ = {
        "RUNHEALTH_READERS__NVML_INTERVAL_S": "2.5",
        "RUNHEALTH_READERS__LINKS_INTERVAL_S": "30",
        "RUNHEALTH_READERS__LINKS_ROOT": str(tmp_path),
    }
    config = RunHealthConfig.from_environ(environ).readers
    [nvml, links] = readers_of(config, identity())[0]
    assert nvml.config.interval_s == 2.5 and links.config.interval_s == 30.0
    assert links._root == tmp_path
    with pytest.raises(ValueError, match="NVML_INTERVAL_S"):
        RunHealthConfig.from_environ({"RUNHEALTH_READERS__NVML_INTERVAL_S": "0"})


# --- a hooked training with the readers on by default ------------------------------------------

require_module("torch")
import torch  # noqa: E402


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory.mktemp("serve")) as process:
        yield process


def infiniband(root: Path) -> Path:
    """One HCA with one active port, its counters well below their maxima."""
    port = root / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    for name, value in {
        "symbol_error": 0,
        "link_downed": 0,
        "port_rcv_errors": 0,
        "port_xmit_data": 1234,
    }.items():
        (port / "counters" / name).write_text(f"{value}\n")
    return root


def train(rh: RunHealth, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """A hand-written loop: one window per step, opened and closed by the loop itself. One batch
    over and over, so the loss falls smoothly: the only fault here is the one the test injects."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        rh.window_start(sample_ids=[rh.progress["attempt"] or 0])
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        rh.loss(loss, tokens=16)
        loss.backward()
        rh.grad_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        rh.window_end()


@pytest.mark.slow
def test_a_hooked_training_stores_device_and_link_samples_and_an_ecc_error_opens_a_device_incident(
    serve: ServeProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    device = gpu("0123abcd", ecc_counts={}, remapped_rows=(0, 0, 0, 0))  # a healthy GPU
    nvml = FakeNvml([device])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # what ``import pynvml`` finds
    run = "readers-run"
    environ = {
        "RUNHEALTH_URL": serve.url,
        "RUNHEALTH_TOKEN": serve.create_run(run),
        "RUNHEALTH_RUN": run,
        "RUNHEALTH_SPOOL_DIR": str(tmp_path / "spool"),
        "RUNHEALTH_SENDER__FLUSH_INTERVAL_S": "0.05",
        "RUNHEALTH_READERS__NVML_INTERVAL_S": "0.1",
        "RUNHEALTH_READERS__LINKS_INTERVAL_S": "0.1",
        "RUNHEALTH_READERS__LINKS_ROOT": str(infiniband(tmp_path / "infiniband")),
    }
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def stored(table: str) -> list[dict[str, Any]]:
        return run_rows(serve.db, table, run)

    with RunHealth(model=model, optimizer=optimizer, environ=environ, hostname=lambda: "node-a") as rh:
        assert rh.readers == {
            "nvml": f"sampling {device.uuid} (every 0.1 s, the node's GPUs: this rank trains on the CPU)",
            "links": f"sampling ports under {tmp_path / 'infiniband'} every 0.1 s",
        }
        assert {t.name for t in threading.enumerate()} >= {
            "runhealth-nvml-sampler",
            "runhealth-links-sampler",
        }
        train(rh, model, optimizer, 20)
        assert wait_until(lambda: len(stored("device_samples")) >= 3 and len(stored("link_samples")) >= 3, 30)
        assert stored("incidents") == []  # a healthy device, a healthy port: nothing to say

        device.ecc_counts = {(1, 0): 1, (1, 1): 1}  # one uncorrected error, volatile and aggregate
        train(rh, model, optimizer, 20)
        assert wait_until(lambda: stored("incidents"), 30), serve.log_tail()
    assert not any(t.name.startswith(("runhealth-nvml", "runhealth-links")) for t in threading.enumerate())

    samples = stored("device_samples")
    assert {(s["node"], s["device_uuid"], s["rank"]) for s in samples} == {("node-a", device.uuid, None)}
    ports = stored("link_samples")
    assert {(p["node"], p["device"], p["port"]) for p in ports} == {("node-a", "mlx5_0", 1)}
    [incident] = stored("incidents")
    assert (incident["kind"], incident["severity"]) == ("device", "critical")
    assert device.uuid in incident["summary"] and "uncorrected ECC" in incident["summary"]
    assert wait_until(lambda: len(stored("step_records")) == 40, 30)  # the training, alongside
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("collectors")]


def test_without_nvml_or_ports_the_hook_says_so_once_and_starts_no_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes ``import pynvml`` fail
    environ = {
        "RUNHEALTH_SPOOL_DIR": str(tmp_path / "spool"),
        "RUNHEALTH_READERS__LINKS_ROOT": str(tmp_path / "no-infiniband"),
    }
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    transport = RecordingTransport()
    with RunHealth(model=model, optimizer=optimizer, transport=transport, environ=environ) as rh:
        train(rh, model, optimizer, 3)
        assert not any(
            t.name.startswith(("runhealth-nvml", "runhealth-links")) for t in threading.enumerate()
        )
        state = rh.readers
    assert state["nvml"].startswith("idle: pynvml (nvidia-ml-py) cannot be imported")
    assert state["links"].startswith(f"idle: no InfiniBand/RoCE ports under {tmp_path / 'no-infiniband'}")
    said = [r for r in caplog.records if r.name in ("collectors.nvml", "collectors.links")]
    assert len(said) == 2 and all(r.levelno == logging.INFO for r in said)
    assert rh.counters.get("hook_errors", 0) == 0 and len(transport.records("step")) == 3
    assert transport.records("device_sample") == transport.records("link_sample") == []
