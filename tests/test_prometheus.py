"""The deployed rules and dashboards against a real Prometheus scraping a real ``runhealth serve``.

A short real training feeds the service over HTTP: a small transformer on the CPU, trained as
four data-parallel ranks on two nodes (each rank computes its quarter of the batch; gradients add
up as an all-reduce would), with heartbeats, checkpoints, NVML device samples from the NVML reader
over a faked ``pynvml``, and InfiniBand samples from the link reader over a sysfs-shaped tree. The
faults injected: a corrupted batch, a NaN on one rank, a slow rank, an uncorrectable ECC error,
a rank stuck in its backward pass, records replayed late from a spool, a second run gone silent,
and a monitor replica that is down. Then every alert expression and every dashboard query must
return data through the Prometheus HTTP API, and the faults must be alerts.

When the collectors' ``RunHealth`` hook is the way trainers report, this training should go
through it instead of posting records itself.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from monitor.observe import dashboards
from tests.prometheus_support import RULES, PrometheusServer, ServeProcess
from tests.support import free_port, require_module

pytestmark = pytest.mark.slow

# 200 steps: the spike rule judges against the newest 100 windows, and those must be past the
# steep early descent of the loss for a corrupted batch to stand out as critical.
WORLD, NODES, STEPS = 4, 2, 200
STEP_S = 0.05
CORRUPT_STEP, NAN_STEP, ECC_STEP = 170, 185, 150
NAN_RANK, SLOW_RANK, STUCK_RANK, ECC_RANK, MARGINAL_RANK = 1, 3, 2, 2, 0
DEVICE_FORWARD_S = 0.003
CANARY_STEPS = (60, 140)  # a healthy round sets the golden fingerprints; the next finds the marginal core
HELD_BACK = (120, 0)  # (step, rank): its record waits in a spool until the end
CHECKPOINT_STEPS = (10, 100, 160)
# Each save took 2 s (the hook's timing) against a 1 s preemption warning: the budget is short.
SAVE_S, PREEMPTION_WARNING_S = 2.0, "1"
SEND_EVERY, SAMPLE_EVERY = 10, 20
ROOT = Path(__file__).resolve().parents[1]
ALERTS = {
    "RunhealthCriticalIncident",
    "RunhealthProposalAwaitingApproval",
    "RunhealthRankHung",
    "RunhealthStraggler",
    "RunhealthDeviceCriticalError",
    "RunhealthRunSilent",
    "RunhealthRecordsLate",
    "RunhealthMonitorDown",
    "RunhealthPreemptionBudgetShort",
}


# --- the faked NVML layer and InfiniBand tree -----------------------------------------------------------


def fake_nvml(node: int) -> Any:
    """The NVML fake of the collector tests (checked there against the real pynvml), with healthy
    ECC and row-remap readings, clock-event time that grows, and an ECC error that can be injected."""
    from tests.test_collectors_nvml import FakeGpu, FakeNvml, gpu

    class FleetNvml(FakeNvml):
        def __init__(self, gpus: list[FakeGpu]) -> None:
            super().__init__(gpus)
            self.uncorrected = {g.uuid: 0 for g in gpus}

        def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, error_type: int, counter_type: int) -> int:
            self._on("nvmlDeviceGetTotalEccErrors", gpu)
            return self.uncorrected[gpu.uuid] if error_type == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 2

        def nvmlDeviceGetRemappedRows(self, gpu: FakeGpu) -> tuple[int, int, int, int]:
            self._on("nvmlDeviceGetRemappedRows", gpu)
            return (0, 0, 0, 0)

    return FleetNvml([gpu(letter) for letter in ("ab", "cd")[node]])


def write_port(root: Path, symbol_errors: int) -> None:
    port = root / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True, exist_ok=True)
    (port / "state").write_text("4: ACTIVE\n")
    counters = {
        "symbol_error": symbol_errors,
        "link_downed": 0,
        "link_error_recovery": 0,
        "port_rcv_errors": 0,
    }
    for name, value in {**counters, "port_xmit_data": 1000 * symbol_errors + 7}.items():
        (port / "counters" / name).write_text(f"{value}\n")


# --- canaries: the real suite on the CPU, one rank's matmul corrupted as a marginal core does ---


class Canaries:
    def __init__(self) -> None:
        import torch

        from collectors.canary import CanaryConfig

        self.torch = torch
        self.config = CanaryConfig(
            cpu_gemm=64, cpu_reduction=1 << 14, cpu_softmax=(4, 1024), cpu_elementwise=1 << 12
        )
        self.golden: dict[str, str] | None = None
        self.flips = random.Random(1)

    def round(self, step: int, incarnation: str, fleet: Fleet) -> list[dict[str, Any]]:
        from collectors.canary import CanaryFaults, run_canary

        records = []
        for rank in range(WORLD):
            faulty = rank == MARGINAL_RANK and self.golden is not None
            faults = CanaryFaults(output=self._flip) if faulty else None
            outcome = run_canary(self.torch.device("cpu"), self.config, golden=self.golden, faults=faults)
            records.append(
                {
                    "kind": "canary_result",
                    "incarnation": incarnation,
                    "rank": rank,
                    "step": step,
                    "time": time.time(),
                    "node": f"node-{rank // (WORLD // NODES)}",
                    "device_uuid": fleet.device(rank).uuid,
                    **outcome.as_wire(),
                }
            )
        if self.golden is None:  # what the service keeps once the devices of one stack agree
            self.golden = {k: v.fingerprint for k, v in outcome.first.kernels.items()}
        return records

    def _flip(self, kernel: str, tensor: Any) -> Any:
        """One bit of the fp32 matmul's output flipped, on every run of the suite."""
        if kernel != "gemm_fp32":
            return tensor
        bits = tensor.detach().clone().contiguous().view(-1).view(self.torch.int32)
        bits[self.flips.randrange(bits.numel())] ^= 1 << 30
        return bits.view(self.torch.float32).view(tensor.shape)


# --- four data-parallel ranks of a real training ---------------------------------------------------------


@dataclass
class Fleet:
    """The nodes' NVML readers (one per rank, on its own device) and link readers."""

    root: Path
    readers: list[Any] = field(default_factory=list)
    nvml: list[Any] = field(default_factory=list)
    links: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        from collectors.links import LinkReader
        from collectors.nvml import NvmlReader

        self.nvml = [fake_nvml(node) for node in range(NODES)]
        for rank in range(WORLD):
            node, local = divmod(rank, WORLD // NODES)
            reader = NvmlReader(
                lambda _record: None,
                nvml=self.nvml[node],
                environ={},
                node=f"node-{node}",
                rank=rank,
                cuda_device=local,
            )
            self.readers.append(reader)
        for node in range(NODES):
            write_port(self.root / f"ib-{node}", 0)
            self.links.append(
                LinkReader(lambda _record: None, root=self.root / f"ib-{node}", node=f"node-{node}")
            )

    def device(self, rank: int) -> Any:
        node, local = divmod(rank, WORLD // NODES)
        return self.nvml[node].gpus[local]

    def samples(self, step: int) -> list[dict[str, Any]]:
        for rank in range(WORLD):
            fields = self.device(rank).fields
            fields[74] += 2_000_000 if rank == SLOW_RANK else 100_000  # SW power cap time, ns
        if step >= ECC_STEP:
            node = ECC_RANK // (WORLD // NODES)
            self.nvml[node].uncorrected[self.device(ECC_RANK).uuid] = 1
        for node in range(NODES):
            write_port(self.root / f"ib-{node}", step // SAMPLE_EVERY)
        records = [record for reader in self.readers for record in reader.sample()]
        return records + [record for reader in self.links for record in reader.sample()]


@dataclass
class _Trainer:
    """The demo's character-level transformer, its optimizer and warm-up schedule."""

    torch: Any
    task: Any
    model: Any = None
    optimizer: Any = None
    schedule: Any = None

    def __post_init__(self) -> None:
        self.model = self.task.model()
        self.optimizer = self.torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.schedule = self.torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / 20)
        )

    def batch(self, step: int) -> tuple[Any, Any, list[str]]:
        tokens = self.task.batch(0, step, None)["tokens"]
        return tokens[:, :-1], tokens[:, 1:], [f"s{step}-{row}" for row in range(len(tokens))]


class Training:
    """The demo's model and data as four data-parallel ranks in one process, with a gradient
    scaler as a mixed-precision run has (its scale and skips are what the ranks report)."""

    def __init__(self, root: Path) -> None:
        import torch

        from monitor.demo.tasks import TextTask

        self.task = TextTask(length=32, rows=8)
        self.trainer = _Trainer(torch, self.task)
        self.torch = torch
        # One thread: the service and Prometheus share these cores, and spinning threads that wait
        # for a core make a step take ten times as long.
        self.torch.set_num_threads(1)
        self.scaler = self.torch.amp.GradScaler("cpu")
        self.order = random.Random(0)
        self.root = root

    def step(self, step: int) -> list[dict[str, Any]]:
        torch, trainer = self.torch, self.trainer
        started = time.perf_counter()
        inputs, labels, sample_ids = trainer.batch(step)
        if step == CORRUPT_STEP:  # the shard's block reads back as zeros, as a damaged file does
            inputs, labels = torch.zeros_like(inputs), torch.zeros_like(labels)
        data_wait = (time.perf_counter() - started) / WORLD
        total = labels.numel()
        shards = list(enumerate(torch.arange(len(inputs)).chunk(WORLD)))
        self.order.shuffle(shards)  # no rank is always first after the optimizer step (cold caches)
        ranks: dict[int, dict[str, Any]] = {}
        for rank, rows in shards:
            t0 = time.perf_counter()
            logits = trainer.model(inputs[rows])
            loss_sum = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[rows].reshape(-1), reduction="sum"
            )
            # A device's forward for a real model takes milliseconds; this toy's takes a fraction
            # of one, under the straggler rule's floor (``StragglerConfig.min_phase_s``, 2 ms).
            time.sleep(DEVICE_FORWARD_S)
            if rank == SLOW_RANK:  # a throttled device: its forward takes 60% longer
                time.sleep(0.6 * (time.perf_counter() - t0))
            t1 = time.perf_counter()
            self.scaler.scale(loss_sum / total).backward()  # gradients add up, as the all-reduce does
            t2 = time.perf_counter()
            tokens = labels[rows].numel()
            ranks[rank] = {
                "tokens": tokens,
                "loss_sum": float(loss_sum.detach()),
                "reported_loss": float(loss_sum.detach()) / tokens,
                "sample_ids": [sample_ids[int(i)] for i in rows],
                "data_wait_s": data_wait,
                "forward_s": t1 - t0,
                "backward_s": t2 - t1,
            }
        t3 = time.perf_counter()
        self.scaler.unscale_(trainer.optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0))
        lr = trainer.schedule.get_last_lr()[0]
        scale = self.scaler.get_scale()
        self.scaler.step(trainer.optimizer)
        self.scaler.update()
        skipped = self.scaler.get_scale() < scale  # the scaler backs off when it skips
        if not skipped:
            trainer.schedule.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        optimizer_s = time.perf_counter() - t3
        for values in ranks.values():
            values.update(
                grad_norm=grad_norm, lr=lr, optimizer_s=optimizer_s, loss_scale=scale, skipped=skipped
            )
        return [ranks[rank] for rank in range(WORLD)]

    def checkpoint(self, step: int, incarnation: str) -> dict[str, Any]:
        folder = self.root / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        self.torch.save(self.trainer.model.state_dict(), folder / "model.pt")
        data = (folder / "model.pt").read_bytes()
        manifest = {
            "step": step,
            "consumed": 8 * step,
            "files": [{"path": "model.pt", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}],
        }
        return {
            "kind": "checkpoint",
            "incarnation": incarnation,
            "step": step,
            "consumed": 8 * step,
            "path": str(folder),
            "time": time.time(),
            "manifest": manifest,
            "metrics": {"runhealth.save_s": SAVE_S},
        }


def heartbeat(incarnation: str, rank: int, step: int, phase: str, since: float) -> dict[str, Any]:
    return {
        "kind": "heartbeat",
        "incarnation": incarnation,
        "rank": rank,
        "node": f"node-{rank // (WORLD // NODES)}",
        "phase": phase,
        "phase_since": since,
        "time": time.time(),
        "step": step,
        "attempt": step,
    }


# --- the scenario ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    run: str
    silent_run: str
    prometheus: PrometheusServer
    alerts: list[dict[str, Any]]
    seconds: float


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    environ = {**os.environ, "RUNHEALTH_PREEMPTION_WARNING_S": PREEMPTION_WARNING_S}
    process = ServeProcess(
        tmp_path_factory.mktemp("serve"), admin_token=secrets.token_urlsafe(24), environ=environ
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def scenario(
    prometheus_server: PrometheusServer, served: ServeProcess, tmp_path_factory: pytest.TempPathFactory
) -> Scenario:
    require_module("torch")
    started = time.monotonic()
    down = f"127.0.0.1:{free_port()}"  # a second monitor replica that is down
    prometheus_server.set_targets("runhealth", [served.address, down])
    admin = {"authorization": f"Bearer {served.admin_token}"}
    run, silent = f"train-{uuid.uuid4().hex[:6]}", f"silent-{uuid.uuid4().hex[:6]}"
    with httpx.Client(base_url=served.url, timeout=30) as client:
        tokens = {
            name: client.post("/v1/runs", json={"name": name}, headers=admin)
            .raise_for_status()
            .json()["token"]
            for name in (run, silent)
        }

        def send(name: str, records: list[dict[str, Any]]) -> None:
            headers = {"authorization": f"Bearer {tokens[name]}"}
            client.post(
                f"/v1/runs/{name}/records", json={"records": records}, headers=headers
            ).raise_for_status()

        held = train(send, run, tmp_path_factory.mktemp("training"))
        go_silent(send, silent)
        # The spooled record is replayed once Prometheus has seen the late counter at 0 and the
        # service gave up waiting for it (its window judged without it, by the watermark).
        wait_for_series(prometheus_server, f'runhealth_records_late_total{{run="{run}"}} == 0', timeout_s=20)
        wait_until_judged(served.root / "runhealth.db", run, HELD_BACK[0], timeout_s=30)
        send(run, held)
    print(f"trained and reported in {time.monotonic() - started:.1f} s")
    alerts = wait_for_alerts(prometheus_server, timeout_s=45)
    return Scenario(run, silent, prometheus_server, alerts, time.monotonic() - started)


def train(send: Any, run: str, root: Path) -> list[dict[str, Any]]:
    """Train and report; returns the record held back in a spool, to replay late."""
    incarnation = str(uuid.uuid4())
    training, fleet, canaries = Training(root), Fleet(root), Canaries()
    # Steps stamped 50 ms apart, ending now, whatever this machine's speed; a hook that flushes
    # every 50 ms makes the service judge a window once records 1.1 s newer arrived, so the
    # held-back record arrives after its window was judged.
    hook = {"runhealth_hook": {"flush_s": 0.05}}
    first = time.time() - STEP_S * STEPS
    pending: list[dict[str, Any]] = [
        {"kind": "run_start", "incarnation": incarnation, "time": first, "world_size": WORLD, "config": hook}
    ]
    held: list[dict[str, Any]] = []
    for step in range(1, STEPS + 1):
        step_started = time.time()
        for rank, values in enumerate(training.step(step)):
            record = {
                "kind": "step",
                "incarnation": incarnation,
                "rank": rank,
                "attempt": step,
                "step": step,
                "consumed": 8 * step,
                "time": first + STEP_S * step,
                "node": f"node-{rank // (WORLD // NODES)}",
                "device_uuid": fleet.device(rank).uuid,
                "dp_rank": rank,
                **values,
            }
            if (step, rank) == (NAN_STEP, NAN_RANK):
                record["loss_sum"] = "NaN"  # this rank's loss overflowed
            (held if (step, rank) == HELD_BACK else pending).append(record)
            pending.append(heartbeat(incarnation, rank, step, "forward", step_started))
        if step in CHECKPOINT_STEPS:
            pending.append(training.checkpoint(step, incarnation))
        if step in CANARY_STEPS:
            pending += canaries.round(step, incarnation, fleet)
        if step % SAMPLE_EVERY == 0:
            pending += fleet.samples(step)
        if step % SEND_EVERY == 0:
            send(run, pending)
            pending = []
    send(run, pending)
    now = time.time()
    beats = [
        heartbeat(incarnation, r, STEPS, "backward", now - (120 if r == STUCK_RANK else 1))
        for r in range(WORLD)
    ]
    send(run, beats)  # rank 2 has been in its backward pass for two minutes: hung
    return held


def go_silent(send: Any, run: str) -> None:
    """A run that reported for a while an hour ago, and nothing since."""
    incarnation, then = str(uuid.uuid4()), time.time() - 3600
    records: list[dict[str, Any]] = [
        {"kind": "run_start", "incarnation": incarnation, "time": then, "world_size": 1}
    ]
    records += [
        {
            "kind": "step",
            "incarnation": incarnation,
            "rank": 0,
            "attempt": a,
            "step": a,
            "time": then + a,
            "tokens": 100,
            "loss_sum": 250.0,
        }
        for a in range(1, 6)
    ]
    send(run, records)


def wait_until_judged(db: Path, run: str, attempt: int, timeout_s: float) -> None:
    query = sa.text(
        "SELECT s.judged FROM step_summaries s JOIN runs r ON r.id = s.run_id "
        "WHERE r.name = :run AND s.attempt = :attempt"
    )
    engine = sa.create_engine(f"sqlite:///{db}")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with engine.connect() as connection:
                if connection.execute(query, {"run": run, "attempt": attempt}).scalar():
                    return
            assert time.monotonic() < deadline, f"window {attempt} of {run} was never judged"
            time.sleep(0.2)
    finally:
        engine.dispose()


def wait_for_series(prometheus: PrometheusServer, expr: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not prometheus.query(expr):
        assert time.monotonic() < deadline, f"Prometheus never saw {expr}"
        time.sleep(0.2)


def wait_for_alerts(prometheus: PrometheusServer, timeout_s: float) -> list[dict[str, Any]]:
    """Every expected alert pending or firing (the hang check runs every 5 s in the service)."""
    started = time.monotonic()
    while True:
        alerts = prometheus.alerts()
        seen = {a["labels"]["alertname"] for a in alerts}
        if seen >= ALERTS or time.monotonic() > started + timeout_s:
            print(f"alerts after {time.monotonic() - started:.1f} s: missing {sorted(ALERTS - seen)}")
            return alerts
        time.sleep(0.5)


# --- the checks -----------------------------------------------------------------------------------------


def alert_expressions() -> dict[str, str]:
    yaml = require_module("yaml")
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"] if "alert" in rule}


def dashboard_queries(run: str) -> list[tuple[str, str]]:
    """(dashboard, query) with the variables as Grafana substitutes them for one run."""
    found = []
    for path in sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")):
        document = json.loads(path.read_text())
        for expr in dashboards.queries(document):
            grafana = expr.replace("$run", run).replace("$node", ".*").replace("$__rate_interval", "30s")
            found.append((path.name, grafana))
    return found


def test_every_alert_expression_parses_and_returns_data(scenario: Scenario) -> None:
    empty = [name for name, expr in alert_expressions().items() if not scenario.prometheus.query(expr)]
    assert not empty, f"no data for {empty}"


def test_every_dashboard_query_parses_and_returns_data(scenario: Scenario) -> None:
    queries = dashboard_queries(scenario.run)
    assert len(queries) > 30
    empty = [(name, expr) for name, expr in queries if not scenario.prometheus.query(expr)]
    assert not empty, f"no data for {empty}"


def test_the_injected_faults_are_alerts(scenario: Scenario) -> None:
    states: dict[str, set[str]] = {}
    for alert in scenario.alerts:
        assert alert["state"] in ("pending", "firing")
        states.setdefault(alert["labels"]["alertname"], set()).add(alert["labels"].get("run", ""))
    assert set(states) >= ALERTS, f"missing: {ALERTS - set(states)} (took {scenario.seconds:.1f} s)"
    for name in ALERTS - {"RunhealthMonitorDown", "RunhealthRunSilent"}:
        assert scenario.run in states[name], name
    assert states["RunhealthRunSilent"] == {scenario.silent_run}
    critical = [a for a in scenario.alerts if a["labels"]["alertname"] == "RunhealthCriticalIncident"]
    assert {a["labels"]["kind"] for a in critical} == {"spike", "nonfinite"}  # the corrupted batch, the NaN
    devices = [a for a in scenario.alerts if a["labels"]["alertname"] == "RunhealthDeviceCriticalError"]
    assert {a["labels"]["kind"] for a in devices} == {"device", "canary"}  # the ECC error, the marginal core


def test_the_live_monitor_is_up_and_cheap_to_scrape(scenario: Scenario, served: ServeProcess) -> None:
    (up,) = scenario.prometheus.query(f'up{{job="runhealth", instance="{served.address}"}}')
    assert up["value"][1] == "1"
    (duration,) = scenario.prometheus.query(f'scrape_duration_seconds{{instance="{served.address}"}}')
    print(f"scrape of the service: {1000 * float(duration['value'][1]):.1f} ms")
    assert float(duration["value"][1]) < 0.5
    (loss,) = scenario.prometheus.query(f'runhealth_run_loss{{run="{scenario.run}"}}')
    assert math.isfinite(float(loss["value"][1]))


def test_a_4_rank_run_costs_the_series_the_formula_says(scenario: Scenario) -> None:
    """26 per run + 13 for its goodput (the ratio, 10 badput causes, today's and the advised
    checkpoint interval) + min(8, N) stragglers + 13 per device + 5 per port + open incidents (by kind and
    severity, and one by one) + devices whose canary missed: N = 4 ranks, M = 2 nodes, D = 2
    devices and L = 1 port per node."""
    run = f'run="{scenario.run}"'

    def count(selector: str) -> int:
        (result,) = scenario.prometheus.query(f"count({{{selector}}})")
        return int(result["value"][1])

    incidents = count(
        f'__name__=~"runhealth_incidents_open|runhealth_incident_opened_timestamp_seconds", {run}'
    )
    missed = count(f'__name__="runhealth_canary_mismatch_timestamp_seconds", {run}')
    slack = count(f'__name__="runhealth_preemption_slack_seconds", {run}')  # its budget, judged
    total = count(f'__name__=~"runhealth_.+", {run}')
    print(f"series of the 4-rank run: {total} ({incidents} for its open incidents, {missed} for canaries)")
    assert missed == 1 and slack == 1
    assert total == 26 + 13 + min(8, WORLD) + 13 * WORLD + 5 * NODES + incidents + missed + slack
