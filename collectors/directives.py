"""Directives from the service, and acting on them at one step on every rank.

The sender thread polls ``GET /v1/runs/{run}/directives`` off the training step. A
``dump_stacks`` directive is answered on that thread at once (it works while the training
thread is stuck, which is when it is wanted). A directive that names a step (``rollback``,
``canary``) is *armed*; it is acted on at the first window boundary at or after its step
where every rank is known to have armed it.

Knowing that needs agreement: a rank that stopped at the step while another, which had not
yet seen the directive, went on into the next window's collectives would leave both waiting
forever. So each rank contributes the id of its oldest armed directive to a small all-reduce
(minimum and maximum together) on the job's default process group, launched asynchronously at
every ``agree_every``-th window boundary and read at the next one: then every rank reads the
same answer and acts, or not, together (``Consensus``). The training thread never waits on the
network or the device for it. A rank that first sees a directive after its step has passed answers ``missed``
and does not arm it; the service then replaces it with a later one. A ``hold`` and its
``release`` name no step to reach: they act at the first boundary every rank agrees on them, so
they are never missed (``AGREED_WHENEVER``).
"""

from __future__ import annotations

import logging
import threading
import time
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
    ``hold_agree_s`` 0.1: while held, how often the ranks agree (a blocking 16-byte
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
    """Which directive every rank has armed, agreed one agreement late (see the module doc).

    The agreement is one 16-byte all-reduce (minimum of each rank's oldest armed id, and of
    its negation) on the job's default process group, launched asynchronously at every
    ``HookConfig.agree_every``-th window boundary and read at the next such boundary. No group
    of its own: gloo connects a new group as a full mesh (every rank to every other), which at
    16,384 ranks is 134 million connections, and NCCL would build a second communicator. The
    default group is safe to share because every rank launches the agreement at the same
    boundary, between two windows, so it takes the same place in every rank's sequence of
    collectives on that group. Under NCCL the values travel on the device: copied in from a
    pinned buffer, all-reduced on the group's stream, copied back into pinned memory behind a
    CUDA event, and read when that event completed (it has, a few windows later), so the step
    never waits on the device for it."""

    def __init__(self, torch: Any, group: Any, world_size: int, device: Any = None) -> None:
        self._torch = torch
        self._group = group  # None: the default group
        self._solo = world_size <= 1
        self._on_device = device is not None and getattr(device, "type", "cpu") != "cpu"
        self._device = device
        self._work: Any = None
        self._result: Any = None  # where the agreement's answer lands (pinned host memory)
        self._done: Any = None  # a CUDA event after the copy back, when on the device

    @classmethod
    def create(cls, torch: Any, device: Any = None) -> Consensus:
        """At attach: the default group; on the device when that group's backend for this
        device is NCCL (a CPU tensor where the group also has gloo, as ``cpu:gloo,cuda:nccl``)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
            return cls(torch, None, 1)
        backend = str(dist.get_backend()).lower()
        on_device = device is not None and device.type == "cuda" and "gloo" not in backend
        return cls(torch, None, dist.get_world_size(), device if on_device else None)

    def exchange(self, oldest_armed: int) -> int:
        """Read the agreement launched at the previous call (0: none) and launch the next."""
        if self._solo:
            return oldest_armed
        agreed = self._read() if self._work is not None else 0
        self._launch(oldest_armed)
        return agreed

    def _launch(self, value: int) -> None:
        torch, dist = self._torch, self._torch.distributed
        values = torch.tensor([value, -value], dtype=torch.int64)
        if not self._on_device:
            self._result = values
            self._work = dist.all_reduce(values, op=dist.ReduceOp.MIN, group=self._group, async_op=True)
            return
        on_device = values.pin_memory().to(self._device, non_blocking=True)
        self._work = dist.all_reduce(on_device, op=dist.ReduceOp.MIN, group=self._group, async_op=True)
        self._work.wait()  # NCCL: the current stream waits for the all-reduce; the host does not
        self._result = torch.empty(2, dtype=torch.int64, pin_memory=True)
        self._result.copy_(on_device, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def _read(self) -> int:
        if self._done is not None:
            self._done.synchronize()  # recorded a whole agreement period ago: complete
        else:
            self._work.wait()  # a 16-byte gloo all-reduce launched a whole period ago
        self._work = self._done = None
        low, negated_high = (int(v) for v in self._result.tolist())
        return low if low > 0 and low == -negated_high else 0

    def agree_now(self, value: int) -> int:
        """A whole agreement, waited for: the one launched at the last boundary is dropped
        (every rank drops its own at the same boundary), then ``value`` is agreed on. Only
        where the training thread has nothing else to do (a hold): each call waits for every
        peer's matching call, so the ranks move through it in lockstep."""
        if self._solo:
            return value
        if self._work is not None:
            self._read()  # launched before the hold began; what it says is asked again
        self._launch(value)
        return self._read()

    def close(self, wait_s: float) -> None:
        """Wait at most ``wait_s`` for the agreement in flight (``DirectiveConfig.close_wait_s``)."""
        work, done = self._work, self._done
        self._work = self._done = None
        if work is None:
            return
        try:
            if done is not None:
                self._wait_for_event(done, wait_s)
            else:
                work.wait(timeout=timedelta(seconds=wait_s))
        except RuntimeError as exc:  # gloo: "Operation timed out!", or a peer gone
            log.warning(
                "runhealth: a peer never joined the last directive agreement (%s); closing anyway", exc
            )

    @staticmethod
    def _wait_for_event(done: Any, wait_s: float) -> None:
        """An NCCL collective cannot be waited for with a timeout from the host: poll its event."""
        deadline = time.monotonic() + wait_s
        while not done.query():
            if time.monotonic() > deadline:
                raise RuntimeError(f"not complete after {wait_s} s")
            time.sleep(0.01)
