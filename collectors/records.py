"""The hook's records, built through the record protocol: one function per kind.

The protocol (``policies.protocol``) defines each kind once: its fields, types and limits, and
the NaN-by-name codec. Records are built with ``protocol.build``, which orders the fields, drops
absent ones, writes nonfinite floats by name and raises ``ProtocolError`` for a value the
service would refuse, here where the record is made (the entry point that made it counts and
logs the error, ``guard.py``). Step records are the exception: one per window, rendered on the
sender thread by ``window.py``, field by field, with their names checked against the protocol
at import; their identity fields are checked here, once, at attach (``step_identity``).
Samplers (``nvml.py``, ``links.py``) build their own sample records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from collectors.config import RunHealthConfig
from collectors.layout import Identity
from collectors.stacks import StackDump
from collectors.wire import Record
from policies import protocol
from policies.checkpoints import manifest_digest


@dataclass(frozen=True)
class Origin:
    """Who a record comes from: this rank in this incarnation (a new one after a restore)."""

    incarnation: str
    rank: int
    node: str
    device_uuid: str | None

    @classmethod
    def of(cls, identity: Identity, incarnation: str) -> Origin:
        return cls(incarnation, identity.rank, identity.node, identity.device_uuid)


@dataclass(frozen=True)
class Event:
    """A checkpoint or resume event, which may be made before attach: checked when made, built
    once its origin is known (``with_origin``)."""

    kind: protocol.Structure
    fields: dict[str, Any]

    @property
    def is_checkpoint(self) -> bool:
        return self.kind is protocol.CHECKPOINT


def step_identity(identity: Identity, incarnation: str) -> dict[str, Any]:
    """The identity fields every step record of this rank carries, checked once."""
    fields = identity.record_fields(incarnation)
    protocol.check_fields(protocol.STEP, fields)
    return fields


def run_start(
    incarnation: str,
    time: float,
    identity: Identity,
    run_config: Mapping[str, Any],
    config: RunHealthConfig,
) -> Record:
    """Rank 0's, at attach and at each new incarnation."""
    hook_settings = {
        # The service places directive steps from how often this hook polls and agrees.
        "directive_poll_s": config.directives.poll_interval_s,
        "agree_every": config.hook.agree_every,
        "heartbeat_s": config.sender.heartbeat_interval_s,
        "flush_s": config.sender.flush_interval_s,
        # Recorded in a nonfinite incident's story when the trainer skips such updates itself.
        "nonfinite_response": config.hook.nonfinite_response,
    }
    return protocol.build(
        protocol.RUN_START,
        incarnation=incarnation,
        time=time,
        world_size=identity.world_size,
        layout=identity.layout.sizes(),
        config={**run_config, "runhealth_hook": hook_settings},
    )


def run_finish(incarnation: str, time: float, status: str) -> Record:
    """Rank 0's, at close."""
    return protocol.build(protocol.RUN_FINISH, incarnation=incarnation, time=time, status=status)


def heartbeat(
    origin: Origin,
    time: float,
    phase: str,
    phase_since: float,
    step: int | None,
    attempt: int,
    cpu_busy_at: float | None = None,
) -> Record:
    """The rank's phase and progress, from the sender thread on its own clock; while it
    compiles, when its processes last used CPU at a compiler's rate (``cpu_use.py``)."""
    return protocol.build(
        protocol.HEARTBEAT,
        incarnation=origin.incarnation,
        rank=origin.rank,
        node=origin.node,
        phase=phase,
        phase_since=phase_since,
        time=time,
        step=step,
        attempt=attempt,
        cpu_busy_at=cpu_busy_at,
    )


def checkpoint(
    step: int,
    path: str,
    time: float,
    *,
    manifest: Mapping[str, Any] | None = None,
    consumed: int | None = None,
    tags: Sequence[str] | None = None,
    metrics: Mapping[str, float] | None = None,
) -> Event:
    """A committed checkpoint; its consumed count defaults to the manifest's. It carries its
    identity (``manifest_digest``: the store keys a checkpoint by path, step and content)."""
    if manifest is not None and consumed is None:
        consumed = manifest.get("consumed")
    fields = {"step": step, "path": str(path), "time": time, "consumed": consumed,
              "manifest": manifest, "tags": list(tags) if tags else None, "metrics": metrics,
              "manifest_digest": manifest_digest(manifest)}  # fmt: skip
    return _event(protocol.CHECKPOINT, fields)


def resume(
    restored: Mapping[str, Any],
    checkpoint_path: str | None,
    checkpoint_step: int | None,
    time: float,
    first_sample_ids: list[Any] | None,
) -> Event:
    """What a restart restored, with the first batch's sample ids unless ``restored`` has them."""
    restored = dict(restored)
    restored.setdefault("first_sample_ids", first_sample_ids)
    fields = {"restored": restored, "time": time, "checkpoint_path": checkpoint_path,
              "checkpoint_step": checkpoint_step}  # fmt: skip
    return _event(protocol.RESUME, fields)


def _event(kind: protocol.Structure, fields: dict[str, Any]) -> Event:
    protocol.check_fields(kind, fields)  # raised where the event is made, not at attach
    return Event(kind, fields)


def with_origin(event: Event, origin: Origin) -> Record:
    """An event as sent: events made before attach learn their origin then (a checkpoint also
    its node, whose disk holds the files)."""
    where = {"node": origin.node} if event.is_checkpoint else {}
    return protocol.build(
        event.kind, **event.fields, **where, incarnation=origin.incarnation, rank=origin.rank
    )


def directive_ack(
    origin: Origin,
    time: float,
    directive_id: int,
    status: str,
    step: int,
    detail: Mapping[str, Any] | None = None,
) -> Record:
    return protocol.build(
        protocol.DIRECTIVE_ACK,
        directive_id=directive_id,
        incarnation=origin.incarnation,
        rank=origin.rank,
        time=time,
        status=status,
        step=step,
        detail=dict(detail or {}),
    )


def canary_result(
    origin: Origin, time: float, step: int, directive_id: int | None, outcome: Mapping[str, Any]
) -> Record:
    """``outcome``: ``CanaryOutcome.as_wire()``. A directive's run names it; a checkpoint's has none."""
    return protocol.build(
        protocol.CANARY_RESULT,
        incarnation=origin.incarnation,
        rank=origin.rank,
        step=step,
        time=time,
        node=origin.node,
        directive_id=directive_id,
        device_uuid=origin.device_uuid,
        **outcome,
    )


def stack_dump(origin: Origin, directive_id: int, dump: StackDump) -> Record:
    """Every thread's stack, cut to the protocol's limit (the flight recorder as it came)."""
    return protocol.build(
        protocol.STACK_DUMP,
        incarnation=origin.incarnation,
        rank=origin.rank,
        time=dump.time,
        stacks=dump.threads[:STACKS_LIMIT],
        directive_id=directive_id,
        flight_recorder=dump.flight_recorder,
    )


# The protocol's bound on a dump's stacks: a longer dump is cut rather than refused.
_STACKS = protocol.STACK_DUMP["stacks"].type
STACKS_LIMIT = _STACKS.max_length if isinstance(_STACKS, protocol.Text) and _STACKS.max_length else None
