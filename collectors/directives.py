"""Directives from the service, and acting on them at one step on every rank.

The sender thread polls ``GET /v1/runs/{run}/directives`` off the training step. A
``dump_stacks`` directive is answered on that thread at once (it works while the training
thread is stuck, which is when it is wanted). A directive that names a step (``rollback``,
``canary``) is *armed*; it is acted on at the first window boundary at or after its step
where every rank is known to have armed it.

Knowing that needs agreement: a rank that stopped at the step while another, which had not
yet seen the directive, went on into the next window's collectives would leave both waiting
forever. So each rank contributes the id of its oldest armed directive to a small all-reduce
(minimum and maximum together) on a gloo group of its own, launched asynchronously at each
window boundary and read at the next one: a boundary later every rank reads the same answer
and acts, or not, together. No device is involved and the training thread never waits on the
network. A rank that first sees a directive after its step has passed answers ``missed``
and does not arm it; the service then replaces it with a later one. A ``hold`` and its
``release`` name no step to reach: they act at the first boundary every rank agrees on them, so
they are never missed (``AGREED_WHENEVER``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

log = logging.getLogger("runhealth.collectors.directives")

IMMEDIATE = "dump_stacks"
STEP_ALIGNED = ("rollback", "canary", "hold", "release")
# Acted on at the first boundary every rank agrees on, whatever the step: a hold pauses as soon
# as it can, and a release resumes ranks that hold at one step already.
AGREED_WHENEVER = ("hold", "release")


@dataclass(frozen=True)
class DirectiveConfig:
    """``poll_interval_s`` 2: the service places a directive's step at least twice this (and
    the sender's delay) ahead of the newest step it saw, so every rank has polled in time.
    ``close_wait_s`` 10: at close, how long to wait for the agreement still in flight. Every
    rank launched it a window ago, so with healthy peers it has completed; a peer that never
    reached that boundary (hung, or dead) would hold this process at its exit for the group's
    timeout (30 minutes for gloo by default), hiding the failure from the launcher.
    ``hold_agree_s`` 0.1: while held, how often the ranks agree (a blocking 16-byte gloo
    all-reduce; nothing else runs then): a release armed by the poll is acted on within it.
    ``hold_grace_s`` 30: how long past the hold's own timeout a held rank waits for the
    service's release (sent on the service's clock within its 5 s check period, then polled)
    before the ranks release themselves, the service taken to be unreachable."""

    poll_interval_s: float = 2.0
    close_wait_s: float = 10.0
    hold_agree_s: float = 0.1
    hold_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if self.poll_interval_s <= 0 or self.close_wait_s <= 0:
            raise ValueError("DirectiveConfig.poll_interval_s and close_wait_s must be > 0")
        if self.hold_agree_s <= 0 or self.hold_grace_s < 0:
            raise ValueError("DirectiveConfig.hold_agree_s must be > 0 and hold_grace_s >= 0")


@dataclass(frozen=True)
class Directive:
    id: int
    kind: str
    act_at_step: int | None
    payload: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, item: dict[str, Any]) -> Directive:
        return cls(
            int(item["id"]), str(item["kind"]), item.get("act_at_step"), dict(item.get("payload") or {})
        )


class Armory:
    """Directives this rank knows of. The sender thread writes, the training thread reads:
    each side replaces whole values under a lock held for a few assignments."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, Directive] = {}
        self._known: dict[int, Directive] = {}
        self.local: list[Directive] = []
        self._handled: set[int] = set()

    def update(
        self, pending: list[Directive], step: int, answer: Callable[[Directive, str, int], None]
    ) -> None:
        """The service's pending list, polled: arm what is new and still ahead, answer
        ``missed`` for what is new and already behind, disarm what the service withdrew. A
        directive armed in time stays armed once its step has passed: the agreement acts on it
        one boundary late, and a poll in between that answered ``missed`` (while this rank then
        acted on it with the others) made the service replace a directive that was carried
        out, and never record the rollback as executed."""
        with self._lock:
            handled = set(self._handled)
            already = set(self._armed)
        armed: dict[int, Directive] = {}
        local: list[Directive] = []
        for directive in pending:
            if directive.id in handled or directive.kind == IMMEDIATE:
                continue
            if directive.act_at_step is None:
                local.append(directive)  # this rank alone, at its next boundary (a re-run)
            elif (
                directive.act_at_step < step
                and directive.id not in already
                and directive.kind not in AGREED_WHENEVER
            ):
                self.handled(directive.id)
                answer(directive, "missed", step)
            else:
                armed[directive.id] = directive
        with self._lock:
            self._armed = armed
            self._known.update(armed)
            self.local = local

    def handled(self, directive_id: int) -> None:
        with self._lock:
            self._handled.add(directive_id)
            # Replaced, not changed in place: ``oldest_armed`` reads it without the lock.
            self._armed = {key: armed for key, armed in self._armed.items() if key != directive_id}
            self.local = [d for d in self.local if d.id != directive_id]

    def oldest_armed(self) -> int:
        # Without the lock (window boundaries run it): ``_armed`` is only ever replaced whole.
        return min(self._armed, default=0)

    def known(self, directive_id: int) -> Directive | None:
        """A directive this rank armed at some point, even if since withdrawn: once every rank
        agreed on it, each acts on it, whatever a later poll said."""
        with self._lock:
            return self._known.get(directive_id)

    def take_agreed(self, directive_id: int, step: int) -> Directive | None:
        """The directive every rank agreed on, once its step is reached, unless this rank has
        handled it already; it is handled from then on. The agreement launched at the boundary
        that acts on a directive still carries its id (every rank contributed it before
        acting), so the next agreement names it again: a canary ran twice on every rank, four
        steps apart, and its second acknowledgement was refused as a conflict."""
        with self._lock:
            directive = self._known.get(directive_id)
            if directive is None or directive.act_at_step is None or step < directive.act_at_step:
                return None
            if directive_id in self._handled:
                return None
        self.handled(directive_id)
        return directive

    def first_time(self, directive_id: int) -> bool:
        """True the first time an immediate directive is seen (then it counts as handled)."""
        with self._lock:
            if directive_id in self._handled:
                return False
            self._handled.add(directive_id)
            return True

    def take_local(self) -> Directive | None:
        # Checked before taking the lock: called at every window boundary, and a lock taken
        # right after a training step costs microseconds. ``local`` is only ever replaced or
        # popped whole, so the read is safe; one missed a moment ago is taken next boundary.
        if not self.local:
            return None
        with self._lock:
            if not self.local:
                return None
            directive = self.local.pop(0)
            self._handled.add(directive.id)
            return directive


class Consensus:
    """Which directive every rank has armed, agreed one boundary late (see the module doc)."""

    def __init__(self, torch: Any, group: Any, world_size: int) -> None:
        self._torch = torch
        self._group = group
        self._solo = world_size <= 1 or group is None
        self._work: Any = None
        self._buffer: Any = None

    @classmethod
    def create(cls, torch: Any) -> Consensus:
        """At attach (every rank calls it): a gloo group of its own, so the agreement never
        touches the trainer's device or its NCCL communicators."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
            return cls(torch, None, 1)
        return cls(torch, dist.new_group(backend="gloo"), dist.get_world_size())

    def exchange(self, oldest_armed: int) -> int:
        """Read the agreement launched at the previous boundary (0: none) and launch the next."""
        if self._solo:
            return oldest_armed
        agreed = 0
        if self._work is not None:
            self._work.wait()  # a 16-byte gloo all-reduce launched a whole window ago
            low, negated_high = (int(v) for v in self._buffer.tolist())
            agreed = low if low > 0 and low == -negated_high else 0
        dist = self._torch.distributed
        self._buffer = self._torch.tensor([oldest_armed, -oldest_armed], dtype=self._torch.int64)
        self._work = dist.all_reduce(self._buffer, op=dist.ReduceOp.MIN, group=self._group, async_op=True)
        return agreed

    def agree_now(self, value: int) -> int:
        """A whole agreement, waited for: the one launched at the last boundary is dropped
        (every rank drops its own at the same boundary), then ``value`` is agreed on. Only
        where the training thread has nothing else to do (a hold): each call waits for every
        peer's matching call, so the ranks move through it in lockstep."""
        if self._solo:
            return value
        if self._work is not None:
            self._work.wait()  # launched before the hold began; what it says is asked again
            self._work = None
        dist = self._torch.distributed
        buffer = self._torch.tensor([value, -value], dtype=self._torch.int64)
        dist.all_reduce(buffer, op=dist.ReduceOp.MIN, group=self._group)
        low, negated_high = (int(v) for v in buffer.tolist())
        return low if low > 0 and low == -negated_high else 0

    def close(self, wait_s: float) -> None:
        """Wait at most ``wait_s`` for the agreement in flight (``DirectiveConfig.close_wait_s``)."""
        work, self._work = self._work, None
        if work is None:
            return
        try:
            work.wait(timeout=timedelta(seconds=wait_s))
        except RuntimeError as exc:  # gloo: "Operation timed out!", or a peer gone
            log.warning(
                "runhealth: a peer never joined the last directive agreement (%s); closing anyway", exc
            )
