"""The fleet benchmark's simulated ranks (``benchmarks/fleet_senders.py``) send what the ingest
API accepts: its pre-encoded templates stay valid records as the protocol changes, and the
planted fault is where it is said to be."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

from monitor.api.routes import validate_batch

ROOT = Path(__file__).resolve().parent.parent
INCARNATION = "00000000-0000-4000-8000-0000000000aa"


def senders() -> ModuleType:
    name = "fleet_senders"
    if name not in sys.modules:  # a script beside the benchmarks, not a package
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "fleet_senders.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def plan(fleet: ModuleType, fault: object) -> object:
    return fleet.Plan(
        incarnations=(INCARNATION,),
        ranks=4,
        flush_s=2.0,
        heartbeat_s=5.0,
        device_s=10.0,
        started_at=1000.0,
        seconds=60.0,
        fault=fault,
        threads=1,
    )


def test_a_poster_body_is_a_valid_batch_with_every_kind_and_the_fault_on_its_rank() -> None:
    fleet = senders()
    shared = plan(fleet, fleet.Fault(run_index=0, rank=2, first_step=2, every=0))
    poster = fleet.Poster("run", 0, "token", "127.0.0.1", 1, first_rank=0, last_rank=4, offset_s=0.0)
    state = fleet._PosterState(poster, shared)

    body, first, last, count, faulty = state.body(shared, now=1002.5)

    records = validate_batch(body, 50_000).records
    assert (first, last, count, faulty) == (1, 2, 16, [2])
    assert [r.kind for r in records].count("step") == 8
    assert [r.kind for r in records].count("heartbeat") == 4
    assert [r.kind for r in records].count("device_sample") == 4
    steps = {(r.rank, r.attempt): r for r in records if r.kind == "step"}
    assert math.isnan(steps[(2, 2)].loss_sum)
    assert all(math.isfinite(r.loss_sum) for key, r in steps.items() if key != (2, 2))
    assert steps[(1, 2)].incarnation == INCARNATION and steps[(1, 2)].consumed == 2 * 4 * 8
    # The next post carries only what is new: no heartbeat or device sample before they are due.
    body, first, last, count, _ = state.body(shared, now=1004.5)
    assert (first, last, count) == (3, 4, 8)
    assert {json.loads(body)["records"][0]["kind"]} == {"step"}


def test_a_repeated_fault_hits_its_rank_every_interval_and_nothing_else() -> None:
    fault = senders().Fault(run_index=1, rank=5, first_step=20, every=60)
    assert [a for a in range(0, 200) if fault.hits(1, 5, a)] == [20, 80, 140]
    assert not fault.hits(0, 5, 20) and not fault.hits(1, 4, 20)
    once = senders().Fault(run_index=0, rank=0, first_step=3, every=0)
    assert [a for a in range(10) if once.hits(0, 0, a)] == [3]
