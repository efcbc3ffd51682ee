"""Stored records as the typed readings the policies take.

The policies never see a wire dict: this module is where a record's field names (the
protocol's, ``policies.protocol``; the store keeps them as its column names) and the shapes of
its free-form parts (NVML's counter tree, a restored optimizer's state) are known. Each function
takes a record or a row mapping and tolerates missing keys: a reading is what was sent, no more.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from policies.continuity import ResumeFacts
from policies.devices import DeviceReading, LinkReading, XidEvent
from policies.peers import PHASES, WALL_PHASES, RankWindow
from policies.types import StepPoint

Record = Mapping[str, Any]

# The step fields the engine selects for a window's per-rank policies (``rank_window``).
RANK_FIELDS = (
    "incarnation", "rank", "attempt", "step", "node", "device_uuid", "tp_rank", "pp_rank", "cp_rank",
    "loss_sum", "tokens", "grad_norm", "loss_scale", "skipped", "sample_ids",
    "data_wait_s", "forward_s", "backward_s", "optimizer_s",
    "forward_wall_s", "backward_wall_s", "optimizer_wall_s",
)  # fmt: skip

# Keys of a device sample's counters that are reader bookkeeping, not device counters.
NOT_COUNTERS = ("read_errors", "xids_dropped")


def device_reading(record: Record) -> DeviceReading:
    """A ``device_sample`` record (or its stored row) as the device rules read it."""
    raw = record.get("counters")
    tree: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    remap = tree.get("remapped_rows")
    remap = remap if isinstance(remap, Mapping) else {}
    errors = tree.get("read_errors")
    events = record.get("xids")
    xids = (xid_event(x) for x in events if isinstance(x, Mapping)) if isinstance(events, list) else ()
    return DeviceReading(
        node=str(record.get("node", "")),
        device=str(record.get("device_uuid", "")),
        seq=_count(record.get("seq")) or 0,
        time=_time(record.get("time")),
        rank=_count(record.get("rank")),
        counters=_flatten({k: v for k, v in tree.items() if k not in NOT_COUNTERS}),
        remap_pending=_flag(remap.get("pending")),
        remap_failure=_flag(remap.get("failure")),
        xids=tuple(x for x in xids if x is not None),
        xids_dropped=_count(tree.get("xids_dropped")) or 0,
        read_errors={str(k): str(v) for k, v in errors.items()} if isinstance(errors, Mapping) else {},
        clock_event_reasons=_count(record.get("clock_event_reasons")),
        sm_clock_mhz=_real(record.get("sm_clock_mhz")),
        power_w=_real(record.get("power_w")),
        power_limit_w=_real(record.get("power_limit_w")),
        temperature_c=_real(record.get("temperature_c")),
    )


def xid_event(record: Record) -> XidEvent | None:
    """One entry of a device sample's ``xids``; None without a usable code."""
    code = _count(record.get("code"))
    if code is None:
        return None
    gpu_instance, compute_instance = record.get("gpu_instance_id"), record.get("compute_instance_id")
    return XidEvent(code, _real(record.get("time")), _count(gpu_instance), _count(compute_instance))


def link_reading(record: Record) -> LinkReading:
    """A ``link_sample`` record (or its stored row) as the link rules read it."""
    raw = record.get("counters")
    saturated = record.get("saturated")
    state = record.get("state")
    return LinkReading(
        node=str(record.get("node", "")),
        device=str(record.get("device", "")),
        port=_count(record.get("port")) or 0,
        seq=_count(record.get("seq")) or 0,
        time=_time(record.get("time")),
        state=state.strip().upper() if isinstance(state, str) and state.strip() else None,
        counters=_flatten(raw) if isinstance(raw, Mapping) else {},
        saturated=frozenset(str(s) for s in saturated) if isinstance(saturated, list) else frozenset(),
    )


# A window's fields, read from each record at once; the float columns last.
_FLOAT_COLUMNS = ("loss_sum", "tokens", *(f"{phase}_s" for phase in (*PHASES, *WALL_PHASES)))
_WINDOW_FIELDS = ("rank", "step", "tp_rank", "pp_rank", "cp_rank", "node", "device_uuid", "sample_ids")
_window_fields = operator.itemgetter(*_WINDOW_FIELDS, *_FLOAT_COLUMNS)
_rank = operator.itemgetter("rank")


def _window_values(records: Sequence[Record]) -> list[tuple[Any, ...]]:
    """Each record's window fields in order, None for one it lacks (a rank and a step it must
    have): one lookup per record (rows as stored have every field), where a lookup per field
    per record was most of the cost."""
    try:
        return [_window_fields(record) for record in records]
    except KeyError:
        optional = (*_WINDOW_FIELDS[2:], *_FLOAT_COLUMNS)
        return [(r["rank"], r["step"], *(r.get(name) for name in optional)) for r in records]


def rank_window(records: Sequence[Record]) -> RankWindow:
    """The step records (or rows) of one window, every rank's values side by side."""
    ordered = sorted(records, key=_rank)
    first = ordered[0]
    ranks, steps, tp, pp, cp, nodes, devices, sample_ids, *floats = zip(*_window_values(ordered), strict=True)
    coordinates = [(t or 0, p or 0, c or 0) for t, p, c in zip(tp, pp, cp, strict=True)]
    group_ids = {coordinate: index for index, coordinate in enumerate(sorted(set(coordinates)))}
    # A row per float field (None, not sent, is NaN): each column is a contiguous row of it.
    loss_sum, tokens, *phases = np.array(floats, dtype=np.float64)
    unlogged = [index for index, value in enumerate(floats[0]) if value is None]
    return RankWindow(
        step=max(steps),
        attempt=first.get("attempt"),
        incarnation=first.get("incarnation", ""),
        ranks=np.array(ranks, dtype=np.int64),
        groups=np.array([group_ids[c] for c in coordinates], dtype=np.int64),
        loss_sum=loss_sum,
        tokens=tokens,
        phases=dict(zip((*PHASES, *WALL_PHASES), phases, strict=True)),
        nodes=nodes,
        devices=devices,
        sample_ids=sample_ids,
        loss_unlogged=np.array(unlogged, dtype=np.int64) if unlogged else None,
    )


def resume_facts(
    incarnation: str, rank: int, checkpoint_step: int | None, restored: Mapping[str, Any]
) -> ResumeFacts:
    """A resume record's ``restored``: the hook's nested form (``optimizer``, ``scheduler``,
    ``data``, ...: collectors.restore) or flat keys of the same names."""
    optimizer = _section(restored, "optimizer")
    scheduler = _section(restored, "scheduler")
    data = _section(restored, "data")
    ids = restored.get("first_sample_ids")
    digest = _first(data.get("state_digest"), restored.get("data_state_digest"))
    return ResumeFacts(
        incarnation=incarnation,
        rank=rank,
        checkpoint_step=checkpoint_step,
        optimizer_step=_first(optimizer.get("optimizer_step_max"), restored.get("optimizer_step")),
        exp_avg_norm=_first(optimizer.get("exp_avg_norm"), restored.get("exp_avg_norm")),
        exp_avg_sq_norm=_first(optimizer.get("exp_avg_sq_norm"), restored.get("exp_avg_sq_norm")),
        # The first window's rate when the hook saw it (``CheckpointEvents.flush_resume``): what
        # the run trains with, where the optimizer's rate at the resume may not be yet.
        lr=_first(
            restored.get("first_window_lr"),
            _head(optimizer.get("lr")),
            _head(scheduler.get("last_lr")),
            restored.get("lr"),
        ),
        scheduler_last_epoch=_first(scheduler.get("last_epoch"), restored.get("scheduler_last_epoch")),
        consumed=restored.get("consumed"),
        first_sample_ids=tuple(ids) if ids is not None else None,
        param_states=_count(_first(optimizer.get("param_states"), restored.get("param_states"))),
        trainable_params=_count(_first(optimizer.get("trainable_params"), restored.get("trainable_params"))),
        deterministic_data=_first(data.get("deterministic"), restored.get("deterministic_data")) is True,
        data_state_digest=digest if isinstance(digest, str) and digest else None,
    )


def _count(value: Any) -> int | None:
    """A cumulative counter's value, or None for anything that is not one (bools included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return int(value)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, int]:
    """Nested counters as dotted names -> values: ``{"nvlink": {"0": {"replay": 3}}}`` gives
    ``{"nvlink.0.replay": 3}``. What is not a non-negative number is left out."""
    flat: dict[str, int] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        elif (number := _count(value)) is not None:
            flat[name] = number
    return flat


def _real(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _time(value: Any) -> float:
    real = _real(value)
    return math.nan if real is None else real  # nan: no interval can be measured from it


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _section(restored: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = restored.get(name)
    return value if isinstance(value, Mapping) else {}


def _head(value: Any) -> Any:
    return value[0] if isinstance(value, list | tuple) and value else value


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def point_from_summary(summary: dict[str, Any], restart: bool) -> StepPoint:
    tokens = summary["tokens"]
    loss_sum = summary["loss_sum"]
    reported = (
        summary["reported_loss_sum"] / summary["reported_loss_count"]
        if summary["reported_loss_count"]
        else None
    )
    if tokens and loss_sum is not None:
        loss: float | None = loss_sum / tokens  # the token-weighted mean over all ranks
    else:
        loss = reported
    rank_means = summary.get("rank_mean_count") or 0
    skipped_ranks, ranks = summary["skipped_ranks"], summary["ranks_reported"]
    return StepPoint(
        step=summary["step"],
        loss=loss,
        grad_norm=summary["grad_norm"],
        lr=summary["lr"],
        tokens=tokens,
        loss_scale=summary["loss_scale"],
        # Some ranks updated and some did not: no verdict of the run's. Under data parallelism
        # every rank takes the same verdict from the same reduced gradients, so the rank that
        # made none died before its step (its window closed at exit by the crash). Read as a
        # skip, every crash of one rank of the DDP tutorial's trainer between its backward and
        # its step was a step that advanced on a skipped window (counter_mismatch).
        skipped=None if 0 < skipped_ranks < ranks else skipped_ranks > 0,
        incarnation=summary["incarnation"],
        attempt=summary["attempt"],
        restart=restart,
        consumed=summary["consumed"],
        ranks=summary["ranks_reported"],
        reported_loss=reported,
        naive_loss=summary["rank_mean_sum"] / rank_means if rank_means else None,
        min_rank_tokens=summary.get("min_rank_tokens"),
        max_rank_tokens=summary.get("max_rank_tokens"),
    )
