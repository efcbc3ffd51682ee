"""A faulty device emulated on the CPU: how many scheduled canary rounds until it is flagged,
and whether a healthy rank is ever flagged (a benchmark, not a test).

Four ranks are real processes on gloo (127.0.0.1, one thread each, so all four share one
stack). On one of them the canary's GEMMs (``gemm_fp32`` and ``gemm_bf16``) behave like a
marginal core: each output, with probability p per call, gets one random bit of one random
element flipped (``collectors.canary.CanaryFaults`` output hook, seeded). Everything else is the
real path:

- rank 0 also hosts a real ``Service`` over a fresh SQLite store (migrated); the ranks' step
  windows and canary results go in as the hook would send them (wire encoding, the API's
  batch validation, ``Service.ingest``);
- each round is issued by the service's own schedule (``CanaryWatch.schedule_due`` on a clock
  advanced by the budgeted interval): a ``canary`` directive naming the step and carrying
  the golden fingerprints;
- every rank runs ``run_canary`` at that step with the directive's golden (so a miss is
  re-run at once on the same device, as the hook does), the results are gathered over gloo
  and ingested; the service judges the round (quorum golden, persistent/transient);
- when the service asks a rank to re-run (a round before any golden existed), that rank
  answers the directive at the next step, as the hook would.

Per fault rate and seed (the faulty rank rotates with the seed): rounds to the first
finding on the faulty rank and whether it was persistent or transient, findings on healthy
ranks (false flags, must be 0), rounds whose first run was corrupted but not flagged (must
be 0), and rounds to the node quarantine proposal (the service proposes one on a persistent
mismatch, or on a second transient one on the same device). Each run lasts until both the
first flag plus ``--extra-rounds`` and the proposal, at least ``--min-rounds``, at most
``--max-rounds``.

    python benchmarks/canary_faulty_device.py [--rates 0.5 0.2 0.05 0.01] [--seeds 8]

Prints JSON. Expected rounds to the first flag: every corrupted output changes the
fingerprint (SHA-256 of the bytes), so it is 1/q with q = 1 - (1 - p)^2 (two GEMMs a run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from canary_sensitivity import flip_bit

from collectors.canary import CanaryConfig, CanaryFaults, describe_stack, run_canary, stack_key
from collectors.wire import encode_batch
from monitor.api.routes import validate_batch
from monitor.config import ServiceConfig
from monitor.recovery.decisions import list_proposals
from monitor.service import Service
from monitor.store import migrate, models, queries
from monitor.store.db import create_store_engine, resolve_url
from policies.protocol import to_wire

WORLD = 4
CPU = torch.device("cpu")
GEMMS = ("gemm_fp32", "gemm_bf16")
FIRST_KERNEL = "gemm_fp32"  # the suite runs it first: its call marks the start of a suite run
RUN_NAME = "faulty-device"


@dataclass
class MarginalCore:
    """A ``CanaryFaults.output`` hook: each GEMM output, with probability ``rate`` per call, gets one
    random bit of one random element flipped; the flips of the current canary are kept."""

    rate: float
    rng: random.Random
    calls: int = 0
    injected: list[dict[str, Any]] = field(default_factory=list)
    _run: int = -1

    def begin(self) -> None:
        """A new canary (first run plus any immediate re-run) starts."""
        self.injected, self._run = [], -1

    def __call__(self, kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        self._run += kernel == FIRST_KERNEL
        if kernel not in GEMMS:
            return tensor
        self.calls += 1
        if self.rng.random() >= self.rate:
            return tensor
        element, bit = self.rng.randrange(tensor.numel()), self.rng.randrange(tensor.element_size() * 8)
        self.injected.append({"run": self._run, "kernel": kernel, "element": element, "bit": bit})
        return flip_bit(tensor, element, bit)


@dataclass(frozen=True)
class Order:
    """What rank 0 tells every rank before a canary: run it (at ``step``, for ``directive``)."""

    stop: bool
    directive: int = 0
    step: int = 0
    time: float = 0.0
    golden: dict[str, dict[str, str]] = field(default_factory=dict)
    ranks: tuple[int, ...] = tuple(range(WORLD))
    incarnation: str = ""


class Coordinator:
    """The service side, on rank 0: a real Service over a fresh SQLite store, on a clock of its
    own (the schedule is minutes apart; the benchmark moves the clock, not the wall)."""

    def __init__(self, path: Path, steps_per_round: int) -> None:
        self.now = 1_000_000.0
        self.engine = create_store_engine(resolve_url(str(path), {}))
        migrate.upgrade(self.engine)
        self.service = Service(self.engine, ServiceConfig(), clock=lambda: self.now)
        with self.engine.begin() as connection:
            queries.create_run(connection, RUN_NAME)
            self.run_id = int(queries.run_row(connection, RUN_NAME).id)
        self.incarnation = str(uuid.uuid4())
        self.step = 0
        self.steps_per_round = steps_per_round
        self._seen_directive = 0
        self._seen_finding = 0
        self.post(
            [{"kind": "run_start", "incarnation": self.incarnation, "time": self.now, "world_size": WORLD}]
        )

    def post(self, records: Sequence[dict[str, Any]]) -> None:
        """Through the API's own decoding and validation, then the service's ingest."""
        batch = validate_batch(encode_batch(to_wire(list(records))), 50_000)
        self.service.ingest(RUN_NAME, self.run_id, batch.records)

    def _train(self, last_step: int, step_seconds: float) -> None:
        """Step windows of every rank up to ``last_step``, one ``step_seconds`` apart."""
        records = []
        for step in range(self.step + 1, last_step + 1):
            self.now += step_seconds
            records += [
                {
                    "kind": "step",
                    "incarnation": self.incarnation,
                    "rank": rank,
                    "attempt": step,
                    "step": step,
                    "time": self.now,
                    "tokens": 1000,
                    "loss_sum": 2000.0,
                    "node": f"node-{rank}",
                    "device_uuid": f"CPU-{rank}",
                }
                for rank in range(WORLD)
            ]
        self.step = max(self.step, last_step)
        if records:
            self.post(records)

    def open_round(self) -> Order:
        """Train one schedule interval, let the schedule issue its directive, train to its step."""
        with self.engine.connect() as connection:
            schedule = connection.execute(sa.select(models.CanarySchedule)).mappings().one()
            interval = self.service.canaries.interval_s(connection, schedule)
        step_seconds = (interval + 1.0) / self.steps_per_round
        self._train(self.step + self.steps_per_round, step_seconds)
        issued = self.service.canaries.schedule_due()
        if len(issued) != 1:
            raise RuntimeError(f"the schedule issued {issued} after {interval:.0f} s")
        directive = self._directive(issued[0])
        self._train(int(directive["act_at_step"]), step_seconds)
        return Order(
            stop=False,
            directive=directive["id"],
            step=int(directive["act_at_step"]),
            time=self.now,
            golden=directive["payload"].get("golden") or {},
            incarnation=self.incarnation,
        )

    def _directive(self, directive_id: int) -> dict[str, Any]:
        with self.engine.connect() as connection:
            row = connection.execute(
                sa.select(models.Directive).where(models.Directive.id == directive_id)
            ).mappings()
            return dict(row.one())

    def rerun_orders(self, step: int) -> list[Order]:
        """Re-run directives the service created since last asked, answered at ``step``."""
        with self.engine.connect() as connection:
            rows = (
                connection.execute(
                    sa.select(models.Directive)
                    .where(models.Directive.kind == "canary", models.Directive.id > self._seen_directive)
                    .order_by(models.Directive.id)
                )
                .mappings()
                .all()
            )
        self._seen_directive = max([self._seen_directive, *(r["id"] for r in rows)])
        return [
            Order(
                stop=False,
                directive=r["id"],
                step=step,
                time=self.now,
                golden=r["payload"].get("golden") or {},
                ranks=tuple(r["ranks"] or ()),
                incarnation=self.incarnation,
            )
            for r in rows
            if (r["payload"] or {}).get("rerun_of")
        ]

    def new_findings(self) -> list[dict[str, Any]]:
        with self.engine.connect() as connection:
            rows = (
                connection.execute(
                    sa.select(models.FindingRow)
                    .where(
                        models.FindingRow.kind == "canary_mismatch", models.FindingRow.id > self._seen_finding
                    )
                    .order_by(models.FindingRow.id)
                )
                .mappings()
                .all()
            )
        self._seen_finding = max([self._seen_finding, *(r["id"] for r in rows)])
        return [
            {
                "rank": r["rank"],
                "severity": r["severity"],
                "persistent": bool(r["evidence"]["persistent"]),
                "canary_step": r["evidence"]["canary_step"],
                "kernels": r["evidence"]["kernels"],
            }
            for r in rows
        ]

    def quarantined(self) -> list[str]:
        """Devices a pending node quarantine proposal names (a persistent mismatch, or a second
        transient one on the same device: ``monitor.recovery.evidence``)."""
        with self.engine.connect() as connection:
            rows = connection.execute(
                sa.select(models.Proposal.quarantine_device).where(
                    models.Proposal.quarantine_node.is_not(None)
                )
            ).scalars()
            return sorted({str(device) for device in rows})

    def outcome(self) -> dict[str, Any]:
        """Incidents and quarantine proposals the run ended with."""
        with self.engine.connect() as connection:
            incidents = queries.list_incidents(connection, queries.IncidentFilter(run=RUN_NAME))
            proposals = list_proposals(connection, RUN_NAME)
            golden = connection.execute(sa.select(sa.func.count()).select_from(models.CanaryGolden)).scalar()
        self.engine.dispose()
        return {
            "incidents": [
                {"kind": i["kind"], "severity": i["severity"], "devices": i["devices"]} for i in incidents
            ],
            "quarantine_proposals": [p["quarantine"] for p in proposals if p.get("quarantine")],
            "golden_kernels": golden,
        }


@dataclass
class Tally:
    """Rank 0's account of one (rate, seed) run."""

    rate: float
    seed: int
    faulty: int
    rounds: int = 0
    first_flag: dict[str, Any] | None = None
    flags_on_faulty: int = 0
    persistent: int = 0
    transient: int = 0
    false_flags: list[dict[str, Any]] = field(default_factory=list)
    healthy_results: int = 0
    corrupted_rounds: int = 0
    corrupted_unflagged: list[int] = field(default_factory=list)
    flagged_uncorrupted: list[int] = field(default_factory=list)
    rerun_directives: int = 0
    proposal_round: int | None = None
    proposal_devices: list[str] = field(default_factory=list)

    def proposed(self, round_index: int, devices: list[str]) -> None:
        if devices and self.proposal_round is None:
            self.proposal_round, self.proposal_devices = round_index, devices

    def judge(self, round_index: int, step: int, corrupted: bool, findings: list[dict[str, Any]]) -> None:
        self.rounds = round_index
        self.healthy_results += WORLD - 1
        self.corrupted_rounds += corrupted
        on_faulty = [f for f in findings if f["rank"] == self.faulty and f["canary_step"] == step]
        self.false_flags += [{**f, "round": round_index} for f in findings if f["rank"] != self.faulty]
        self.flags_on_faulty += len(on_faulty)
        self.persistent += sum(f["persistent"] for f in on_faulty)
        self.transient += sum(not f["persistent"] for f in on_faulty)
        if corrupted and not on_faulty:
            self.corrupted_unflagged.append(round_index)
        if on_faulty and not corrupted:
            self.flagged_uncorrupted.append(round_index)
        if on_faulty and self.first_flag is None:
            first = on_faulty[0]
            self.first_flag = {
                "round": round_index,
                "persistent": first["persistent"],
                "kernels": first["kernels"],
            }

    def done(self, min_rounds: int, extra_rounds: int, max_rounds: int) -> bool:
        if self.rounds >= max_rounds:
            return True
        if self.first_flag is None or self.proposal_round is None:
            return False
        return self.rounds >= max(
            min_rounds, int(self.first_flag["round"]) + extra_rounds, self.proposal_round
        )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value: Any) -> list[Any] | None:
    boxes: list[Any] | None = [None] * WORLD if dist.get_rank() == 0 else None
    dist.gather_object(value, boxes, dst=0)
    return boxes


def canary_record(
    rank: int, order: Order, stack: dict[str, Any], core: MarginalCore | None
) -> dict[str, Any] | None:
    """What the hook sends for a canary directive (plus the injected flips, for the tally)."""
    if rank not in order.ranks:
        return None
    if core is not None:
        core.begin()
    golden = order.golden.get(stack_key(stack))
    faults = CanaryFaults(output=core) if core is not None else None
    outcome = run_canary(CPU, CanaryConfig(), golden, faults, stack)
    return {
        "kind": "canary_result",
        "incarnation": order.incarnation,
        "rank": rank,
        "step": order.step,
        "time": order.time,
        "node": f"node-{rank}",
        "device_uuid": f"CPU-{rank}",
        "directive_id": order.directive,
        **outcome.as_wire(),
        "injected": list(core.injected) if core is not None else [],
    }


def canary_round(
    rank: int,
    order: Order,
    stack: dict[str, Any],
    core: MarginalCore | None,
    post: Callable[..., None] | None,
) -> list[dict[str, Any]]:
    """Every named rank runs the canary; rank 0 ingests the results. Returns the flips made."""
    records = gather(canary_record(rank, order, stack, core))
    if records is None or post is None:
        return []
    sent = [r for r in records if r is not None]
    post([{k: v for k, v in r.items() if k != "injected"} for r in sent])
    return [flip for r in sent for flip in r["injected"]]


def one_run(
    rank: int, rate: float, seed: int, stack: dict[str, Any], workdir: Path, args: argparse.Namespace
) -> dict[str, Any] | None:
    """Scheduled rounds until the run is decided; every rank calls this in lockstep."""
    faulty = seed % WORLD
    # A string seed: each (rate, seed) draws its own faults, so rates are not correlated.
    core = MarginalCore(rate, random.Random(f"marginal-core-{rate}-{seed}")) if rank == faulty else None
    coordinator = Coordinator(workdir / f"p{rate}-s{seed}.db", args.steps_per_round) if rank == 0 else None
    tally = Tally(rate, seed, faulty)
    started = time.perf_counter()
    round_index = 0
    while True:
        done = coordinator is None or tally.done(args.min_rounds, args.extra_rounds, args.max_rounds)
        order: Order = broadcast(
            Order(stop=True) if done or coordinator is None else coordinator.open_round()
        )
        if order.stop:
            break
        round_index += 1
        post = coordinator.post if coordinator else None
        flips = canary_round(rank, order, stack, core, post)
        corrupted = any(f["run"] == 0 for f in flips)
        # A round judged before any golden existed asks the odd rank to re-run: it answers at
        # the next step, as the hook answers an immediate directive.
        reruns: list[Order] = broadcast(coordinator.rerun_orders(order.step + 1) if coordinator else None)
        for rerun in reruns:
            canary_round(rank, rerun, stack, core, post)
        if coordinator is not None:
            tally.rerun_directives += len(reruns)
            tally.judge(round_index, order.step, corrupted, coordinator.new_findings())
            tally.proposed(round_index, coordinator.quarantined())
    if coordinator is None:
        return None
    return {**summary_of(tally), **coordinator.outcome(), "seconds": round(time.perf_counter() - started, 1)}


def summary_of(tally: Tally) -> dict[str, Any]:
    return {
        "rate": tally.rate,
        "seed": tally.seed,
        "faulty_rank": tally.faulty,
        "rounds": tally.rounds,
        "first_flag": tally.first_flag,
        "flags_on_faulty": tally.flags_on_faulty,
        "persistent": tally.persistent,
        "transient": tally.transient,
        "corrupted_rounds": tally.corrupted_rounds,
        "corrupted_rounds_unflagged": tally.corrupted_unflagged,
        "flagged_rounds_uncorrupted": tally.flagged_uncorrupted,
        "healthy_results_judged": tally.healthy_results,
        "false_flags": tally.false_flags,
        "rerun_directives": tally.rerun_directives,
        "quarantine_proposal_round": tally.proposal_round,
        "quarantine_proposal_devices": tally.proposal_devices,
    }


def worker(rank: int, port: int, workdir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the stack names the thread count: four equal ranks, one stack
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        stack = describe_stack(CPU)
        keys = gather(stack_key(stack))
        if keys is not None and len(set(keys)) != 1:
            raise RuntimeError(f"the ranks are not on one stack: {keys}")
        runs = [
            one_run(rank, rate, seed, stack, Path(workdir), args)
            for rate in args.rates
            for seed in range(args.seeds)
        ]
        if rank == 0:
            (Path(workdir) / "runs.json").write_text(json.dumps({"stack": stack, "runs": runs}))
    finally:
        dist.destroy_process_group()


def expected_rounds(rate: float) -> float:
    """Rounds to the first corrupted run: two GEMM outputs per run, each corrupted with ``rate``."""
    return 1.0 / (1.0 - (1.0 - rate) ** len(GEMMS))


def persistent_share(rate: float) -> float:
    """P(the immediate re-run misses a kernel the first run missed | the first run missed)."""
    q = 1.0 - (1.0 - rate) ** 2
    one, both = 2 * rate * (1 - rate), rate * rate
    return (one * rate + both * q) / q


def by_rate(runs: list[dict[str, Any]], rate: float) -> dict[str, Any]:
    chosen = [r for r in runs if r["rate"] == rate]
    caught = [r["first_flag"]["round"] for r in chosen if r["first_flag"]]
    first_persistent = sum(bool(r["first_flag"] and r["first_flag"]["persistent"]) for r in chosen)
    flags = sum(r["flags_on_faulty"] for r in chosen)
    proposed = [r["quarantine_proposal_round"] for r in chosen if r["quarantine_proposal_round"]]
    return {
        "rate": rate,
        "seeds": len(chosen),
        "caught": len(caught),
        "rounds_to_first_flag": caught,
        "median_rounds_to_first_flag": statistics.median(caught) if caught else None,
        "max_rounds_to_first_flag": max(caught) if caught else None,
        "expected_rounds_to_first_flag": round(expected_rounds(rate), 2),
        "first_flag_persistent": first_persistent,
        "first_flag_transient": len(caught) - first_persistent,
        "flags_on_faulty": flags,
        "persistent_share_of_flags": round(sum(r["persistent"] for r in chosen) / flags, 3)
        if flags
        else None,
        "expected_persistent_share": round(persistent_share(rate), 3),
        "corrupted_rounds_unflagged": sum(len(r["corrupted_rounds_unflagged"]) for r in chosen),
        "flagged_rounds_uncorrupted": sum(len(r["flagged_rounds_uncorrupted"]) for r in chosen),
        "healthy_results_judged": sum(r["healthy_results_judged"] for r in chosen),
        "false_flags": sum(len(r["false_flags"]) for r in chosen),
        "runs_with_quarantine_proposal": sum(bool(r["quarantine_proposals"]) for r in chosen),
        "quarantine_of_faulty_device_only": all(
            r["quarantine_proposal_devices"] in ([], [f"CPU-{r['faulty_rank']}"]) for r in chosen
        ),
        "rounds_to_quarantine_proposal": proposed,
        "median_rounds_to_quarantine_proposal": statistics.median(proposed) if proposed else None,
        "max_rounds_to_quarantine_proposal": max(proposed) if proposed else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.2, 0.05, 0.01])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--min-rounds", type=int, default=40, help="rounds per run at least")
    parser.add_argument("--extra-rounds", type=int, default=10, help="rounds after the first flag")
    parser.add_argument("--max-rounds", type=int, default=1500, help="give up after this many rounds")
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--runs", action="store_true", help="also print every run")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rh-canary-faulty-", dir=os.environ.get("TMPDIR")))
    started = time.perf_counter()
    mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
        worker, args=(free_port(), str(workdir), args), nprocs=WORLD, join=True
    )
    result = json.loads((workdir / "runs.json").read_text())
    runs = result["runs"]
    report = {
        "world": WORLD,
        "faulty_kernels": list(GEMMS),
        "stack": result["stack"],
        "by_rate": [by_rate(runs, rate) for rate in args.rates],
        "false_flags_total": sum(len(r["false_flags"]) for r in runs),
        "healthy_results_judged_total": sum(r["healthy_results_judged"] for r in runs),
        "rounds_total": sum(r["rounds"] for r in runs),
        "seconds": round(time.perf_counter() - started, 1),
    }
    if args.runs:
        report["runs"] = runs
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
