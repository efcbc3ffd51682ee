"""Every record kind a hook sends, defined once: its fields in wire order, types and limits.

The ingest API's pydantic models are generated from these (``monitor.ingest.schemas``), the
store's step columns are made from ``STEP`` (``monitor.store.models.record_columns``) and every
kind's columns are checked against them (``tests/test_store_protocol.py``), and the hook builds
its records through them (``policies.protocol.build``). A new step field is added here, plus
its migration (and the code that fills it in); a field of another kind also needs its column.

The limits are the service's: a record over one is refused whole (422, naming the field).
Strings are bounded so a runaway value cannot fill the store; the bounds are generous for
what each field holds (a node name, a file path, every thread's stack).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from policies.protocol.fields import (
    EMPTY_LIST,
    Choice,
    Document,
    Either,
    Field,
    Flag,
    Integer,
    ListOf,
    MapOf,
    Nested,
    Real,
    Structure,
    Text,
)

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# A count stored in a 32-bit column (steps, attempts, ids); one stored in a 64-bit column
# (tokens, consumed examples, sequence numbers, sizes). Past them a record is refused by name
# instead of failing at insert.
COUNT = Integer(ge=0, le=INT32_MAX)
WIDE_COUNT = Integer(ge=0, le=INT64_MAX)
RANK_LIMIT = 2**20 - 1
"""Ranks and parallel coordinates below 1,048,576, 64 times the largest job runhealth is sized
for (16,384 ranks): memory the engine keeps per rank is bounded by it whatever a record says
(a rank of 2^31 once made a vector of that length)."""
RANK = Integer(ge=0, le=RANK_LIMIT)
REAL = Real()
NAME = Text(max_length=200, min_length=1)
RUN_NAME = Text(max_length=200, min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
"""A run's name: it is a path segment of the API (``/v1/runs/{run}/...``) and a file name in
the spool, so one rule for the service, the CLI and the hook: a name one accepts, all do."""
# A device as NVML or sysfs names it ("GPU-" and a UUID: 40 characters; a MIG instance or an HCA
# name is shorter than 100). The store keeps 100, so a longer one is refused here, not at insert.
DEVICE_ID = Text(max_length=100, min_length=1)
INCARNATION_ID = Text(max_length=64, min_length=1)  # a UUID, or a name the launcher gives
PATH = Text(max_length=1000, min_length=1)
SAMPLE_ID = Either((Integer(ge=-INT64_MAX - 1, le=INT64_MAX), Text(max_length=200)))
SAMPLE_ID_LIMIT = 100_000
"""Sample ids per step record: the hook keeps fewer by default (``HookConfig.max_sample_ids``)."""

STEP = Structure(
    "StepIn",
    "One rank's accumulation window.",
    (
        Field("incarnation", INCARNATION_ID, required=True),
        Field("rank", RANK, required=True),
        Field("attempt", COUNT, required=True),
        Field("step", COUNT, required=True),
        Field("time", REAL, required=True),
        Field("consumed", WIDE_COUNT),
        Field("node", NAME),
        Field("device_uuid", DEVICE_ID),
        Field("dp_rank", RANK),
        Field("tp_rank", RANK),
        Field("pp_rank", RANK),
        Field("cp_rank", RANK),
        Field("microbatches", COUNT),
        Field("sample_ids", ListOf(SAMPLE_ID, max_length=SAMPLE_ID_LIMIT)),
        Field("tokens", WIDE_COUNT),
        Field("loss_sum", REAL),
        Field("reported_loss", REAL),
        Field("grad_norm", REAL),
        Field("lr", REAL),
        Field("loss_scale", REAL),
        Field("skipped", Flag()),
        Field("data_wait_s", REAL),
        Field("forward_s", REAL),
        Field("backward_s", REAL),
        Field("optimizer_s", REAL),
        Field("forward_wall_s", REAL),
        Field("backward_wall_s", REAL),
        Field("optimizer_wall_s", REAL),
    ),
    kind="step",
    key=("incarnation", "rank", "attempt"),
)

HEARTBEAT = Structure(
    "HeartbeatIn",
    "A rank's phase and progress, from the hook's sender thread (it runs while training is stuck).",
    (
        Field("incarnation", INCARNATION_ID, required=True),
        Field("rank", RANK, required=True),
        Field("phase", Text(max_length=32, min_length=1), required=True),
        Field("phase_since", REAL, required=True),
        Field("time", REAL, required=True),
        Field("node", NAME),
        Field("step", COUNT),
        Field("attempt", COUNT),
        # While compiling: when the rank's process tree last used CPU at a compiler's rate.
        Field("cpu_busy_at", REAL),
    ),
    kind="heartbeat",
    key=("incarnation", "rank"),
)

RUN_START = Structure(
    "RunStartIn",
    "A start of the job (one incarnation), sent by rank 0.",
    (
        Field("incarnation", INCARNATION_ID, required=True),
        Field("time", REAL, required=True),
        Field("world_size", Integer(ge=1, le=RANK_LIMIT + 1), required=True),
        Field("layout", Document()),
        Field("config", Document()),
    ),
    kind="run_start",
    key=("incarnation",),
)

RUN_FINISH = Structure(
    "RunFinishIn",
    "The end of an incarnation, and how it ended.",
    (
        Field("incarnation", INCARNATION_ID, required=True),
        Field("time", REAL, required=True),
        Field("status", Choice(("completed", "failed", "stopped")), default="completed"),
    ),
    kind="run_finish",
    key=("incarnation",),
)

DEVICE_SAMPLE = Structure(
    "DeviceSampleIn",
    "One NVML reading of one device: clocks, power, temperature, cumulative counters, XIDs.",
    (
        Field("node", NAME, required=True),
        Field("device_uuid", DEVICE_ID, required=True),
        Field("seq", WIDE_COUNT, required=True),
        Field("time", REAL, required=True),
        Field("rank", RANK),
        Field("clock_event_reasons", WIDE_COUNT),
        Field("sm_clock_mhz", REAL),
        Field("mem_clock_mhz", REAL),
        Field("power_w", REAL),
        Field("power_limit_w", REAL),
        Field("temperature_c", REAL),
        Field("counters", Document()),
        Field("xids", ListOf(Document())),
    ),
    kind="device_sample",
    key=("node", "device_uuid", "seq"),
)

LINK_SAMPLE = Structure(
    "LinkSampleIn",
    "One reading of one InfiniBand/RoCE port's counters.",
    (
        Field("node", NAME, required=True),
        Field("device", DEVICE_ID, required=True),
        Field("port", COUNT, required=True),
        Field("seq", WIDE_COUNT, required=True),
        Field("time", REAL, required=True),
        Field("state", Text(max_length=32)),
        Field("counters", Document()),
        Field("saturated", ListOf(Text())),
    ),
    kind="link_sample",
    key=("node", "device", "port", "seq"),
)

MANIFEST_FILE = Structure(
    "ManifestFile",
    "One file of a checkpoint: its path, size and content hash.",
    (
        Field("path", PATH, required=True),
        Field("size", WIDE_COUNT, required=True),
        Field("sha256", Text(pattern=r"^[0-9a-f]{64}$"), required=True),
    ),
)

MANIFEST = Structure(
    "Manifest",
    "What a checkpoint holds, as written beside it (``collectors.checkpoints.build_manifest``).",
    (
        Field("step", COUNT, required=True),
        Field("consumed", WIDE_COUNT),
        Field("files", ListOf(Nested(MANIFEST_FILE)), required=True),
    ),
)

# ``policies.checkpoints.manifest_digest``: a sha256, or empty for a checkpoint with no manifest.
MANIFEST_DIGEST = Text(max_length=64, pattern=r"^([0-9a-f]{64})?$")

CHECKPOINT = Structure(
    "CheckpointIn",
    "A committed checkpoint, as the trainer reports it.",
    (
        Field("incarnation", INCARNATION_ID, required=True),
        Field("rank", RANK, default=0),
        Field("step", COUNT, required=True),
        Field("path", PATH, required=True),
        Field("time", REAL, required=True),
        Field("consumed", WIDE_COUNT),
        Field("manifest", Nested(MANIFEST)),
        Field("tags", ListOf(Text(max_length=64))),
        Field("metrics", MapOf(REAL)),
        # The node whose disk holds the files (the service reads only what it can see).
        Field("node", NAME),
        # Its content's identity; the service derives it from the manifest when it is empty
        # and refuses one that does not match it.
        Field("manifest_digest", MANIFEST_DIGEST, default=""),
    ),
    kind="checkpoint",
    # One checkpoint is one content at one path and step: the same path saved again with other
    # content is a new version (``monitor.recovery.checkpoints``), not a conflict.
    key=("path", "step", "manifest_digest"),
)

RESUME = Structure(
    "ResumeIn",
    "What a restart restored on one rank (``collectors.restore``).",
    (
        Field("incarnation", INCARNATION_ID, required=True),
        Field("rank", RANK, required=True),
        Field("time", REAL, required=True),
        Field("restored", Document(), required=True),
        Field("checkpoint_path", Text(max_length=1000)),
        Field("checkpoint_step", COUNT),
    ),
    kind="resume",
    key=("incarnation", "rank"),
)

STACK_DUMP = Structure(
    "StackDumpIn",
    "All Python thread stacks of one rank, sent on a ``dump_stacks`` directive.",
    (
        Field("incarnation", INCARNATION_ID, required=True),
        Field("rank", RANK, required=True),
        Field("time", REAL, required=True),
        Field("stacks", Text(max_length=4_000_000), required=True),
        Field("directive_id", COUNT),
        Field("flight_recorder", Text(max_length=16_000_000)),
    ),
    kind="stack_dump",
    key=("incarnation", "rank", "time"),
)

DIRECTIVE_ACK = Structure(
    "DirectiveAckIn",
    "A rank's answer to a directive: done, missed (already past its step) or failed.",
    (
        Field("directive_id", COUNT, required=True),
        Field("incarnation", INCARNATION_ID, required=True),
        Field("rank", RANK, required=True),
        Field("time", REAL, required=True),
        Field("status", Choice(("done", "missed", "failed")), required=True),
        Field("step", COUNT),
        Field("detail", Document()),
    ),
    kind="directive_ack",
    key=("directive_id", "incarnation", "rank"),
)

KERNEL = Structure(
    "KernelIn",
    "One canary kernel's result: the fingerprint of its output bytes and a few summary values.",
    (
        Field("fingerprint", Text(max_length=128, min_length=1), required=True),
        Field("summary", ListOf(REAL, max_length=16), default=EMPTY_LIST),
        Field("deterministic", Flag(), default=True),
    ),
)

KERNEL_NAME = Text(max_length=64)

CANARY_RESULT = Structure(
    "CanaryResultIn",
    "One device's canary suite run at one step (and its immediate re-run, if it missed).",
    (
        Field("incarnation", INCARNATION_ID, required=True),
        Field("rank", RANK, required=True),
        Field("step", COUNT, required=True),
        Field("time", REAL, required=True),
        Field("stack", Document(), required=True),
        Field("stack_key", Text(max_length=64, min_length=1), required=True),
        Field("kernels", MapOf(Nested(KERNEL), key=KERNEL_NAME), required=True),
        Field("seconds", REAL, required=True),
        Field("rerun", MapOf(Nested(KERNEL), key=KERNEL_NAME)),
        Field("over_budget", Flag(), default=False),
        Field("directive_id", COUNT),
        Field("node", NAME),
        Field("device_uuid", DEVICE_ID),
    ),
    kind="canary_result",
    key=("incarnation", "rank", "step"),
)

RECORD_KINDS: tuple[Structure, ...] = (
    STEP,
    HEARTBEAT,
    RUN_START,
    RUN_FINISH,
    DEVICE_SAMPLE,
    LINK_SAMPLE,
    CHECKPOINT,
    RESUME,
    STACK_DUMP,
    DIRECTIVE_ACK,
    CANARY_RESULT,
)

BY_KIND: Mapping[str, Structure] = MappingProxyType({kind.kind or "": kind for kind in RECORD_KINDS})
