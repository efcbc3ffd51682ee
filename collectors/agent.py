"""The directive agent: what the hook does with the service's directives.

Directives are polled on the sender thread (or arrive with a batch's answer) and acted on at
window boundaries on the training thread (``directives.py`` says how every rank acts at the
same one): a rollback stops the rank (``should_stop``), a canary runs the suite on this rank's
device, a hold pauses every rank at that boundary until it is released (``holds.py``), a stack
dump is answered at once on the sender thread, since that works while training is stuck. Every
directive is acknowledged (done, failed, missed) with the step it was handled at.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from collectors import records
from collectors.config import RunHealthConfig
from collectors.directives import IMMEDIATE, Armory, Consensus, Directive
from collectors.guard import EntryErrors, guarded
from collectors.holds import hold_until_released
from collectors.sender import Sender
from collectors.stacks import dump_stacks

if TYPE_CHECKING:
    import torch

    from collectors.accounting import WindowAccounting

log = logging.getLogger("runhealth.collectors")


class DirectiveAgent:
    """One per rank, made with the hook; ``attached`` with the rank's transport and device.
    ``origin``: who this rank's records come from now (a restore changes the incarnation)."""

    def __init__(
        self,
        config: RunHealthConfig,
        windows: WindowAccounting,
        faults: EntryErrors,
        clock: Callable[[], float],
        canary_faults: Any = None,
    ) -> None:
        self._config = config
        self._windows = windows
        self.faults = faults
        self._clock = clock
        self._canary_faults = canary_faults  # emulated faulty hardware, for tests and drills
        self._agree_every = config.hook.agree_every
        # Armed by the sender thread, acted on at window boundaries (``directives.py``).
        self.armory = Armory()
        self.stop: Directive | None = None
        self._boundary_attempt = -1
        self._next_poll = 0.0
        self._answered_with_post = False
        self._canary_stack: dict[str, Any] | None = None
        self._canary_at: tuple[str, int] | None = None  # (incarnation, step) of the last canary

    def attached(
        self, sender: Sender, consensus: Consensus, device: torch.device, origin: records.Origin
    ) -> None:
        self._sender = sender
        self._consensus = consensus
        self._device = device
        self.origin = origin
        self.ask_with_posts()

    def restart(self, origin: records.Origin) -> None:
        """A new incarnation in this process: boundaries count from its first attempt (the
        accounting's ``restart`` sets its ``next_boundary`` back to 0)."""
        self.origin = origin
        self._boundary_attempt = -1
        self.ask_with_posts()

    def close(self) -> None:
        self._consensus.close(self._config.directives.close_wait_s)

    # The training thread, at window boundaries.

    def boundary(self) -> None:
        """Once per window boundary, on every rank alike: local directives, then the agreement."""
        windows = self._windows
        if self._boundary_attempt == windows.attempt or self.stop is not None:
            return
        self._boundary_attempt = attempt = windows.attempt
        # When the window's start next calls here (``WindowAccounting.next_boundary``).
        windows.next_boundary = attempt - attempt % self._agree_every + self._agree_every
        # After that assignment: a local directive the sender thread arms from here on either
        # shows here or sets ``next_boundary`` to 0 after it (``apply``).
        # The agreement first, before anything this rank alone does: it is a collective on the
        # job's default group, so a rank that skipped one (an exception in a local canary) would
        # pair its next with a peer's gradient all-reduce, and gloo aborts on the mismatch.
        agreed = 0
        if attempt % self._agree_every == 0:
            # Host only: a 16-byte all-reduce launched an agreement ago (``Consensus``).
            agreed = self._consensus.exchange(self.armory.oldest_armed())
        local = self.armory.take_local()
        if self.armory.local:
            windows.next_boundary = 0
        if local is not None:
            self._act_safely(local)
        directive = self.armory.take_agreed(agreed, windows.step) if agreed else None
        if directive is not None:
            self._act_safely(directive)

    def _act_safely(self, directive: Directive) -> None:
        """``_act``, whose failure is this rank's alone: counted and logged, and the boundary's
        collectives (the agreement, a hold's) go on as on every peer."""
        try:
            self._act(directive)
        except Exception:
            self.faults.record(f"directive {directive.kind}")

    def _act(self, directive: Directive) -> None:
        step = self._windows.step
        if directive.kind == "canary":
            self.run_canary(directive)
        elif directive.kind == "rollback":
            self.stop = directive
            self.ack(directive, "done", step, {"stopped_at_attempt": self._windows.attempt})
        elif directive.kind == "hold":
            self._hold(directive)
        elif directive.kind == "release":
            self.ack(directive, "done", step, {"held": False})  # released already, or never held
        else:
            self.ack(directive, "failed", step, {"reason": f"unknown directive kind {directive.kind!r}"})

    def _hold(self, hold: Directive) -> None:
        """Every rank is at this boundary (the hold was agreed): pause here until released.
        The acknowledgement says where, at once: the service sees the ranks held."""
        windows = self._windows
        step, attempt = windows.step, windows.attempt
        self.ack(hold, "done", step, {"held_at_step": step, "held_at_attempt": attempt})
        log.warning(
            "runhealth: holding at step %d until proposal %s is decided", step, hold.payload.get("proposal")
        )
        with windows.paused():
            released = hold_until_released(
                hold, self.armory, self._consensus, self._config.directives, self._during_hold
            )
        detail = {"held_at_step": step, "held_s": round(released.held_s, 3), "released_by": released.by}
        if released.directive is None:
            log.warning("runhealth: no release from the service in time; every rank resumes at step %d", step)
        elif released.by == "rollback":
            self._act(released.directive)  # stops here, at the step every rank holds at
        else:
            self.ack(released.directive, "done", step, detail)

    def _during_hold(self, directive: Directive) -> None:
        if directive.kind == "hold":
            step = self._windows.step
            self.ack(directive, "done", step, {"held_at_step": step, "already_held": True})
        else:
            self._act_safely(directive)  # inside the hold's agreement loop: must not leave it

    def run_canary(self, directive: Directive | None) -> None:
        """The canary suite on this rank's device (a sync, at a boundary, on purpose)."""
        from collectors.canary import CanaryConfig, run_canary, stack_key

        if self._canary_stack is None:
            from collectors.canary import describe_stack

            self._canary_stack = describe_stack(self._device)
        golden_by_stack = (directive.payload.get("golden") or {}) if directive is not None else {}
        golden = golden_by_stack.get(stack_key(self._canary_stack))
        step = self._windows.step
        here = (self.origin.incarnation, step)
        if here == self._canary_at:
            # A canary ran at this step already (one at a checkpoint, one placed by the service
            # on the same step): a result is keyed by (incarnation, rank, step), and a second
            # one from a faulty device differs from the first, a conflict that dead-lettered it.
            if directive is not None:
                self.ack(
                    directive,
                    "done",
                    step,
                    {"reason": "a canary already ran at this step; its result stands"},
                )
            return
        self._canary_at = here
        try:
            outcome = run_canary(
                self._device, CanaryConfig(), golden, self._canary_faults, self._canary_stack
            )
        except Exception as exc:  # the suite must never take training down
            self.faults.record("canary")
            if directive is not None:
                self.ack(directive, "failed", step, {"reason": f"{type(exc).__name__}: {exc}"})
            return
        directive_id = directive.id if directive is not None else None
        self._sender.submit(
            records.canary_result(self.origin, self._clock(), step, directive_id, outcome.as_wire())
        )
        if directive is not None:
            self.ack(directive, "done", step, {"missed_golden": list(outcome.missed)})

    def ack(
        self, directive: Directive, status: str, step: int, detail: Mapping[str, Any] | None = None
    ) -> None:
        self._sender.submit(
            records.directive_ack(self.origin, self._clock(), directive.id, status, step, detail)
        )

    # The sender thread.

    def poll_if_due(self) -> None:
        """Each sender cycle: directives are asked for when due, unless the last cycle's batch
        brought them."""
        answered, self._answered_with_post = self._answered_with_post, False
        now = time.monotonic()
        if now >= self._next_poll and not answered:
            self._next_poll = now + self._config.directives.poll_interval_s
            self._poll()

    def ask_with_posts(self) -> None:
        """Ask the transport to bring this rank's directives with each batch's answer."""
        ask = getattr(self._sender.transport, "ask_directives_with_posts", None)
        if ask is not None:
            ask(self.origin.incarnation, self.origin.rank)

    def on_posted(self, items: list[dict[str, Any]]) -> None:
        """A batch's answer carried this rank's pending directives: as good as a poll, and the
        next cycle's own poll is spared (the sender thread sets and reads the flag)."""
        self._answered_with_post = True
        self.apply(items)

    @guarded
    def _poll(self) -> None:
        fetch = getattr(self._sender.transport, "directives", None)
        if fetch is None or not self._windows.active:
            return
        items = fetch(self.origin.incarnation, self.origin.rank)
        if items is not None:
            self.apply(items)

    @guarded
    def apply(self, items: list[dict[str, Any]]) -> None:
        """The service's pending directives for this rank: dumps answered, the rest armed."""
        if not self._windows.active:
            return
        pending = [Directive.from_wire(item) for item in items]
        for directive in pending:
            if directive.kind == IMMEDIATE and self.armory.first_time(directive.id):
                self._answer_dump(directive)
        self.armory.update(pending, self._windows.step, self.ack)
        if self.armory.local:  # acted on at the next window's start (``boundary``)
            self._windows.next_boundary = 0

    def _answer_dump(self, directive: Directive) -> None:
        """All thread stacks, taken here on the sender thread: it works while training is stuck."""
        dump = dump_stacks(nccl_trace=self._config.hook.nccl_trace)
        self._sender.submit(records.stack_dump(self.origin, directive.id, dump))
        self.ack(directive, "done", self._windows.step, {"note": dump.note} if dump.note else None)
