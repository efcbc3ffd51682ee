"""Records and stored rows as the policies' typed readings (``monitor.judge.readings``)."""

from __future__ import annotations

import math

import numpy as np

from monitor.judge.readings import (
    RANK_FIELDS,
    device_reading,
    link_reading,
    point_from_summary,
    rank_window,
    resume_facts,
    xid_event,
)
from policies import protocol
from policies.devices import XidEvent
from policies.peers import PHASES


def step_row(rank: int, **fields: object) -> dict[str, object]:
    return {"incarnation": "inc", "rank": rank, "attempt": 7, "step": 6, **fields}


def test_a_window_orders_ranks_and_groups_them_by_model_shard() -> None:
    rows = [
        step_row(2, tp_rank=1, loss_sum=3.0, tokens=10, forward_s=0.5, node="n1"),
        step_row(0, tp_rank=0, loss_sum=1.0, tokens=10, node="n0", sample_ids=[1, 2]),
        step_row(1, tp_rank=None, loss_sum=None, tokens=10, step=5),
    ]
    window = rank_window(rows)
    assert window.ranks.tolist() == [0, 1, 2]
    assert window.groups.tolist() == [0, 0, 1]  # a missing coordinate is coordinate 0
    assert window.step == 6 and window.attempt == 7 and window.incarnation == "inc"
    assert np.isnan(window.loss_sum[1]) and window.loss_sum[2] == 3.0
    assert np.isnan(window.phases["forward"][0]) and window.phases["forward"][2] == 0.5
    assert window.nodes == ("n0", None, "n1")
    assert window.sample_ids == ([1, 2], None, None)


def test_a_device_reading_flattens_counters_and_keeps_only_usable_values() -> None:
    record = {
        "node": "n0",
        "device_uuid": "GPU-1",
        "seq": 4,
        "time": "NaN",  # as sent: not a number here, so no interval can be measured from it
        "counters": {
            "ecc": {"volatile": {"uncorrected": 2}},
            "pcie_replay": -1,
            "remapped_rows": {"pending": True, "failure": 0},
            "read_errors": {"ecc": "not supported"},
            "xids_dropped": 3,
        },
        "xids": [{"code": 79, "time": 5.0}, {"code": "79"}, "bad"],
        "power_w": math.inf,
    }
    reading = device_reading(record)
    # A flag is no counter; a negative value is none either.
    assert reading.counters == {"ecc.volatile.uncorrected": 2, "remapped_rows.failure": 0}
    assert reading.remap_pending is True and reading.remap_failure is None
    assert reading.read_errors == {"ecc": "not supported"} and reading.xids_dropped == 3
    assert reading.xids == (XidEvent(79, 5.0),)
    assert math.isnan(reading.time) and reading.power_w is None


def test_an_xid_without_a_code_is_no_event() -> None:
    assert xid_event({"time": 1.0}) is None
    assert xid_event({"code": 48, "gpu_instance_id": 1, "compute_instance_id": True}) == XidEvent(
        48, None, 1, None
    )


def test_a_link_reading_normalizes_its_state() -> None:
    reading = link_reading(
        {"node": "n", "device": "mlx5_0", "port": 1, "seq": 2, "state": " active ", "saturated": ["x"]}
    )
    assert (reading.name, reading.state, reading.saturated) == ("mlx5_0/1", "ACTIVE", frozenset({"x"}))
    assert link_reading({"state": "  "}).state is None


def test_resume_facts_read_the_hooks_nested_form_before_flat_keys() -> None:
    nested = {
        "optimizer": {"optimizer_step_max": 40, "lr": [3e-4, 1e-4], "exp_avg_norm": 1.5},
        "scheduler": {"last_epoch": 40, "last_lr": [9.9]},
        "lr": 1.0,
        "consumed": 640,
        "first_sample_ids": [5, 6],
    }
    facts = resume_facts("inc", 3, 40, nested)
    assert (facts.optimizer_step, facts.lr, facts.scheduler_last_epoch) == (40, 3e-4, 40)
    assert facts.exp_avg_norm == 1.5 and facts.exp_avg_sq_norm is None
    assert facts.first_sample_ids == (5, 6) and facts.consumed == 640
    flat = resume_facts("inc", 0, None, {"optimizer_step": 0, "lr": 1e-3, "scheduler_last_epoch": 0})
    assert (flat.optimizer_step, flat.lr, flat.scheduler_last_epoch, flat.checkpoint_step) == (
        0,
        1e-3,
        0,
        None,
    )


def test_resume_facts_take_the_first_windows_rate_over_the_optimizers() -> None:
    restored = {"optimizer": {"lr": [6e-4]}, "scheduler": {"last_lr": [9.9]}, "first_window_lr": 2.5e-4}
    assert resume_facts("inc", 0, 40, restored).lr == 2.5e-4


def test_the_engines_selected_columns_are_all_a_window_reads() -> None:
    full = [
        step_row(
            rank, tp_rank=rank % 2, loss_sum=1.0 + rank, tokens=10, forward_s=0.1 * rank, node=f"n{rank}"
        )
        for rank in range(4)
    ]
    full = [
        {**row, **{f"{p}_s": 0.5 for p in PHASES}, "device_uuid": "GPU", "sample_ids": [1]} for row in full
    ]
    selected = [{name: row.get(name) for name in RANK_FIELDS} for row in full]
    for mine, theirs in zip(
        vars(rank_window(selected)).values(), vars(rank_window(full)).values(), strict=True
    ):
        if isinstance(mine, dict):
            assert all(np.array_equal(mine[k], theirs[k], equal_nan=True) for k in mine)
        elif isinstance(mine, np.ndarray):
            assert np.array_equal(mine, theirs, equal_nan=True)
        else:
            assert mine == theirs
    assert set(RANK_FIELDS) <= protocol.STEP.names


def test_a_window_some_ranks_updated_and_some_did_not_is_no_skip() -> None:
    """One rank crashed between its backward and its step (its window closed at exit, no
    update) while its peers stepped: the window has no verdict, so the counters are not judged
    on it; all ranks skipping is a skip."""
    summary = {
        "step": 40, "tokens": 124, "loss_sum": 140.0, "reported_loss_count": 0, "grad_norm": 0.4,
        "lr": 0.05, "loss_scale": None, "incarnation": "inc", "attempt": 40, "consumed": 5120,
        "skipped_ranks": 1, "ranks_reported": 4,
    }  # fmt: skip
    assert point_from_summary(summary, restart=False).skipped is None
    assert point_from_summary({**summary, "skipped_ranks": 4}, restart=False).skipped is True
    assert point_from_summary({**summary, "skipped_ranks": 0}, restart=False).skipped is False
