"""The ingest wire format: one batch, records of every kind, validated strictly.

Strict means a string is not a number and a float is not an int: a collector bug shows up
as a 422 naming the field, not as a silently coerced value. Nonfinite floats are written as
``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (see ``monitor.store.floats``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from monitor.store.floats import float_from_wire

# A float that may be nonfinite, sent as a number or as one of the three names.
Real = Annotated[float, BeforeValidator(float_from_wire)]
Count = Annotated[int, Field(ge=0)]
Name = Annotated[str, Field(min_length=1, max_length=200)]
IncarnationId = Annotated[str, Field(min_length=1, max_length=64)]
SampleId = int | Annotated[str, Field(max_length=200)]


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class StepIn(_Record):
    """One rank's accumulation window."""

    kind: Literal["step"]
    incarnation: IncarnationId
    rank: Count
    attempt: Count
    step: Count
    time: Real
    consumed: Count | None = None
    node: Name | None = None
    device_uuid: Name | None = None
    dp_rank: Count | None = None
    tp_rank: Count | None = None
    pp_rank: Count | None = None
    cp_rank: Count | None = None
    microbatches: Count | None = None
    sample_ids: list[SampleId] | None = Field(default=None, max_length=100_000)
    tokens: Count | None = None
    loss_sum: Real | None = None
    reported_loss: Real | None = None
    grad_norm: Real | None = None
    lr: Real | None = None
    loss_scale: Real | None = None
    skipped: bool | None = None
    data_wait_s: Real | None = None
    forward_s: Real | None = None
    backward_s: Real | None = None
    optimizer_s: Real | None = None


class HeartbeatIn(_Record):
    kind: Literal["heartbeat"]
    incarnation: IncarnationId
    rank: Count
    phase: Annotated[str, Field(min_length=1, max_length=32)]
    phase_since: Real
    time: Real
    node: Name | None = None
    step: Count | None = None
    attempt: Count | None = None


class RunStartIn(_Record):
    kind: Literal["run_start"]
    incarnation: IncarnationId
    time: Real
    world_size: Annotated[int, Field(ge=1)]
    layout: dict[str, Any] | None = None
    config: dict[str, Any] | None = None


class RunFinishIn(_Record):
    kind: Literal["run_finish"]
    incarnation: IncarnationId
    time: Real
    status: Literal["completed", "failed", "stopped"] = "completed"


class DeviceSampleIn(_Record):
    kind: Literal["device_sample"]
    node: Name
    device_uuid: Name
    seq: Count
    time: Real
    rank: Count | None = None
    clock_event_reasons: Count | None = None
    sm_clock_mhz: Real | None = None
    mem_clock_mhz: Real | None = None
    power_w: Real | None = None
    power_limit_w: Real | None = None
    temperature_c: Real | None = None
    counters: dict[str, Any] | None = None
    xids: list[dict[str, Any]] | None = None


class LinkSampleIn(_Record):
    kind: Literal["link_sample"]
    node: Name
    device: Name
    port: Count
    seq: Count
    time: Real
    state: Annotated[str, Field(max_length=32)] | None = None
    counters: dict[str, Any] | None = None
    saturated: list[str] | None = None


class ManifestFile(_Record):
    path: Annotated[str, Field(min_length=1, max_length=1000)]
    size: Count
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class Manifest(_Record):
    step: Count
    consumed: Count | None = None
    files: list[ManifestFile]


class CheckpointIn(_Record):
    kind: Literal["checkpoint"]
    incarnation: IncarnationId
    rank: Count = 0
    step: Count
    path: Annotated[str, Field(min_length=1, max_length=1000)]
    time: Real
    consumed: Count | None = None
    manifest: Manifest | None = None
    tags: list[Annotated[str, Field(max_length=64)]] | None = None
    metrics: dict[str, Real] | None = None


class ResumeIn(_Record):
    kind: Literal["resume"]
    incarnation: IncarnationId
    rank: Count
    time: Real
    restored: dict[str, Any]
    checkpoint_path: Annotated[str, Field(max_length=1000)] | None = None
    checkpoint_step: Count | None = None


class StackDumpIn(_Record):
    """All Python thread stacks of one rank, sent on a ``dump_stacks`` directive."""

    kind: Literal["stack_dump"]
    incarnation: IncarnationId
    rank: Count
    time: Real
    stacks: Annotated[str, Field(max_length=4_000_000)]
    directive_id: Count | None = None
    flight_recorder: Annotated[str, Field(max_length=16_000_000)] | None = None


class DirectiveAckIn(_Record):
    """A rank's answer to a directive: done, missed (already past its step) or failed."""

    kind: Literal["directive_ack"]
    directive_id: Count
    incarnation: IncarnationId
    rank: Count
    time: Real
    status: Literal["done", "missed", "failed"]
    step: Count | None = None
    detail: dict[str, Any] | None = None


class KernelIn(_Record):
    fingerprint: Annotated[str, Field(min_length=1, max_length=128)]
    summary: list[Real] = Field(default_factory=list, max_length=16)
    deterministic: bool = True


class CanaryResultIn(_Record):
    """One device's canary suite run at one step (and its immediate re-run, if it missed)."""

    kind: Literal["canary_result"]
    incarnation: IncarnationId
    rank: Count
    step: Count
    time: Real
    stack: dict[str, Any]
    stack_key: Annotated[str, Field(min_length=1, max_length=64)]
    kernels: dict[Annotated[str, Field(max_length=64)], KernelIn]
    seconds: Real
    rerun: dict[Annotated[str, Field(max_length=64)], KernelIn] | None = None
    over_budget: bool = False
    directive_id: Count | None = None
    node: Name | None = None
    device_uuid: Name | None = None


RecordIn = Annotated[
    StepIn
    | HeartbeatIn
    | RunStartIn
    | RunFinishIn
    | DeviceSampleIn
    | LinkSampleIn
    | CheckpointIn
    | ResumeIn
    | StackDumpIn
    | DirectiveAckIn
    | CanaryResultIn,
    Field(discriminator="kind"),
]

RECORD_KINDS = (
    "step",
    "heartbeat",
    "run_start",
    "run_finish",
    "device_sample",
    "link_sample",
    "checkpoint",
    "resume",
    "stack_dump",
    "directive_ack",
    "canary_result",
)


class BatchIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    records: list[RecordIn]


class RunCreateIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")]


class DirectiveCreateIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    kind: Literal["dump_stacks", "canary"]
    incarnation: IncarnationId | None = None
    ranks: list[Count] | None = None


class DecisionIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    reason: Annotated[str, Field(max_length=4000)] | None = None
