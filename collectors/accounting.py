"""The window accounting: the hook's hot path, from ``window_start`` to ``window_end``.

A window is one optimizer-step attempt (all its microbatches). Three counters stay apart:
``attempt`` counts windows tried, skipped ones included; ``step`` counts successful updates,
judged by the watched optimizer actually stepping (its step post-hook fires, and for optimizers
that take a GradScaler's found-inf flag into their own kernel, that flag is clear); ``consumed``
counts examples globally (this rank's times the data-parallel size), skipped windows included.

No host-device synchronization from ``window_start`` to ``window_end``: during a window only
references are kept. At its end a CPU rank's window goes to the sender as it is (host values are
read there, ``window.py``); an accelerator's device values are summed on the device and copied
without blocking into pinned host memory (``ring.py``), read a window or so later once the copy
is known to be complete. Each sync decision is commented where it is made.

The step-path entry points catch their own exceptions inline instead of through ``@guarded``:
its extra frame and argument packing cost microseconds per call once a training step has evicted
the caches, and they run several times a step. For the same reason the facade hands the
trainer these bound methods themselves, not methods of its own that forward here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from collectors.accumulation import MAX_PARTS, held_gradient, merged_examples, still_accumulating
from collectors.counters import Counters
from collectors.guard import EntryErrors, guarded
from collectors.phases import Phase, PhaseClock
from collectors.ring import PinnedRing
from collectors.sender import Sender
from collectors.skip_update import NonfiniteSkip
from collectors.values import learning_rate, local_value, on_device, scale_reader
from collectors.window import (
    Counting,
    Microbatch,
    PendingWindow,
    RenderContext,
    Totals,
    UnfinishedWindow,
    WindowValues,
    label_rows,
    render_ids,
    settle_on_host,
)
from collectors.wrappers import inner_optimizer

if TYPE_CHECKING:
    import torch

    from collectors.agent import DirectiveAgent
    from collectors.checkpoint_events import CheckpointEvents, PendingResume

log = logging.getLogger("runhealth.collectors")

# The phases the step-path entry points mark, as module constants: an enum member looked up on
# its class costs a microsecond or two right after a training step.
FORWARD, BACKWARD, OPTIMIZER, DATA = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.DATA

Reduction = Literal["mean", "sum"]

# Per-microbatch values are kept in lists and summed at the window's end (one stack instead of
# a device add per microbatch); past this many they are folded, so memory stays bounded.
FOLD_MICROBATCHES = 64
# Windows without an update (none a scaler's skip) before the hook says how to attach a loop that
# accumulates: three in twenty windows are the skip-storm rule's count (``policies/numerics.py``).
WITHOUT_UPDATE_NOTE = 3


class WindowAccounting:
    """One per rank, made with the hook (cheap, no side effects); ``attached`` once the rank
    knows who it is. ``attach``: the hook's ``start``, called on first use. ``agent`` and
    ``events`` (set by the hook): a window's start hands over to them when a directive
    boundary is due (``next_boundary``) or a resume event waits for the window
    (``pending_resume``). Those two are kept here, written by the agent and the events, so
    that a window's start reads no other object's state: after a training step each object
    touched costs cache misses."""

    agent: DirectiveAgent
    events: CheckpointEvents

    def __init__(
        self,
        counters: Counters,
        faults: EntryErrors,
        counting: Counting,
        max_sample_ids: int,
        attach: Callable[[], object],
        skip_nonfinite: bool = False,
    ) -> None:
        self._counters = counters
        self.faults = faults
        self._counting = counting
        self._max_sample_ids = max_sample_ids
        self._attach = attach
        self.active = False
        self.model: Any = None
        self.optimizers: list[Any] = []
        self.scaler: Any = None
        self._read_scale: Callable[[], Any] | None = None  # ``scale_reader`` of the scaler
        self._windows_without_update = 0
        self.handles: list[Any] = []  # hooks registered on the watched objects
        self._forward_hooked = False
        self.window: WindowValues | None = None
        # A window closed without an update while its gradients accumulate: the next window's
        # microbatches join it (``accumulation.py``). ``_flushing``: a close that must not hold.
        self.carried: WindowValues | None = None
        self._flushing = False
        self._last_end: float | None = None
        self.attempt = self.step = 0
        self.consumed: int | None = 0
        self._totals: Totals | None = None  # made only when a window has device parts or folds
        # The attempt at which ``window_start`` next calls ``agent.boundary``: every
        # ``agree_every`` attempts, or at once (0) when a local directive is armed.
        self.next_boundary = 0
        self.pending_resume: PendingResume | None = None  # ``CheckpointEvents.resumed``
        self._lock = threading.Lock()  # the ring's: the sender thread drains it too
        self._logged: set[str] = set()
        # ``HookConfig.nonfinite_response="skip_update"``: hooks of its own on each optimizer,
        # so a hook without it runs exactly the code it ran before.
        self._skip = NonfiniteSkip(self._window_grad_norm) if skip_nonfinite else None

    def attached(
        self,
        torch: Any,
        device: torch.device,
        sender: Sender,
        ring: PinnedRing[PendingWindow],
        phases: PhaseClock,
        identity_fields: dict[str, Any],
        dp_size: int,
    ) -> None:
        """``identity_fields``: what every step record of this rank carries
        (``records.step_identity``)."""
        self._torch = torch
        self._device = device
        self._sender = sender
        self._ring = ring
        self.phases = phases
        self.context = RenderContext(identity_fields, self._counting, self._max_sample_ids, phases)
        self._dp_size = dp_size
        # True until a window goes through the ring: while it is, and phases are stamped on the
        # host, a window with nothing on the device is complete at its end and goes straight
        # to the sender, without the ring or its lock. On a GPU its phase events still need the
        # ring's marker.
        self._ring_idle = phases.host_timed
        # A CPU rank: every value is on the host, so a window is handed to the sender as the
        # trainer gave it, and settled there (``window_end``).
        self._host_rank = device.type == "cpu"

    @guarded
    def watch(self, *, model: Any = None, optimizer: Any = None, scaler: Any = None) -> None:
        """Objects created after the hook (framework adapters make the optimizer later)."""
        if model is not None and self.model is None:
            self.model = model
        optimizers = optimizer if isinstance(optimizer, list | tuple) else [optimizer]
        for wrapped in optimizers:
            # A wrapper's GradScaler (accelerate's under fp16) unless one was given.
            scaler = scaler if scaler is not None else getattr(wrapped, "scaler", None)
            item = inner_optimizer(wrapped)
            if item is not None and all(item is not known for known in self.optimizers):
                self.optimizers.append(item)
                self.handles.append(item.register_step_pre_hook(self._before_optimizer_step))
                self.handles.append(item.register_step_post_hook(self._after_optimizer_step))
                if self._skip is not None:
                    self.handles.extend(self._skip.install(item))
        if scaler is not None and scaler is not self.scaler:
            self._read_scale = scale_reader(scaler)  # a scaler it cannot read is refused here
            self.scaler = scaler

    def _window_grad_norm(self) -> Any:
        window = self.window
        return window.grad_norm if window is not None else None

    # The step path.

    def window_start(
        self,
        *,
        sample_ids: Any = None,
        examples: int | None = None,
        data_wait_s: float | None = None,
    ) -> None:
        """Open a window. ``sample_ids``: host ints or strings (a list, or a CPU tensor or
        array; a CUDA tensor is ignored, since reading it would sync). ``examples``: this rank's
        example count when it is not the number of ids or label rows."""
        if self.window is not None or self.carried is not None or not self.active:
            self._ready_for_window()  # a window left open may be held here
            if not self.active:
                return
            if self.carried is not None and self._continued(sample_ids, examples, data_wait_s):
                return
        try:
            if self.attempt >= self.next_boundary:
                self._boundary()
            now = time.perf_counter()
            if data_wait_s is None and self._last_end is not None:
                data_wait_s = now - self._last_end
            self.attempt += 1
            ids = list(sample_ids) if type(sample_ids) is list else self._sample_ids(sample_ids)
            # Open before the values below are read: one that fails leaves the window without it.
            self.window = window = WindowValues(self.attempt, data_wait_s, ids, examples)
            if self._read_scale is not None:
                # Sync: none. A device scale is cloned on the device, not read (``scale_value``).
                window.loss_scale = self._read_scale()
                window.scaler_round = getattr(self.scaler, "_per_optimizer_states", None)
            if self.optimizers:
                # Sync: none for a float rate; a tensor rate is cloned on its device.
                lr = self.optimizers[0].param_groups[0]["lr"]
                window.lr = lr if type(lr) is float else learning_rate(self.optimizers[0])
            # Sync: none. On a GPU a phase stamp is a CUDA event recorded on the stream, read
            # for the window's timings only once its ring slot completed (``phases.py``).
            phases = self.phases  # ``PhaseClock.enter``, inlined (see ``PhaseClock.marks``)
            phases.current = mark = (FORWARD, now, phases.stamp())
            phases.marks.append(mark)
            if self.pending_resume is not None:
                self.events.flush_resume()  # it waited for this window's first sample ids
        except Exception as exc:
            self.faults.record("window_start")
            if self.window is None:  # the attempt was counted, its window never opened
                self._unfinished(self.attempt, "window_start", exc)

    def _boundary(self) -> None:
        """Directives; the agreement is a gloo all-reduce, no device. Its failure must not
        stop the attempt count below: every rank agrees at the same attempts."""
        try:
            self.agent.boundary()
        except Exception:
            self.faults.record("directive boundary")

    def _ready_for_window(self) -> None:
        """Attach on first use; close a window the trainer left open (no ``window_end``). A
        failure here must not keep the attempt below from being counted: every rank agrees on
        directives at the same attempts."""
        try:
            if not self.active:
                self._attach()
            elif self.window is not None:
                self.window_end()
        except Exception:
            self.faults.record("window_start")
            self.window = None

    def loss(
        self,
        loss: Any,
        *,
        labels: Any = None,
        tokens: Any = None,
        reduction: Reduction = "mean",
    ) -> None:
        """One microbatch's loss, as the trainer computed it (unscaled).

        ``reduction="mean"``: ``loss`` is a mean over supervised tokens, so the window's loss
        sum adds ``loss * tokens``. ``"sum"``: ``loss`` is already a sum. ``tokens`` (a count)
        or ``labels`` (counted as ``tokens.py`` says) give the supervised tokens. Only kept
        here; settled at the window's end.
        """
        try:
            window = self.window
            if window is None:
                self._note_once("loss", "loss() outside a window is ignored (call window_start)")
                return
            window.sum_reduction = reduction == "sum"
            window.count = count = window.count + 1
            # Sync: none. The loss, labels and count are kept as references: reading a device
            # loss here would wait for the forward to finish.
            window.microbatches.append((loss, labels, tokens))
            if count > 1:
                self._accumulating(window)
            phases = self.phases  # ``PhaseClock.enter``, inlined (see ``PhaseClock.marks``)
            phases.current = mark = (BACKWARD, time.perf_counter(), phases.stamp())
            phases.marks.append(mark)
        except Exception:
            self.faults.record("loss")

    def _accumulating(self, window: WindowValues) -> None:
        """A window's second microbatch or later: mark forwards from now on, fold past 64."""
        if not self._forward_hooked:
            self._hook_forward()
        if len(window.microbatches) >= FOLD_MICROBATCHES:
            self._settle(window)

    def grad_norm(self, norm: Any) -> None:
        """The total gradient norm before clipping (what ``clip_grad_norm_`` returns). Under
        tensor or sharded parallelism pass what this rank has: the record marks it partial."""
        try:
            window = self.window
            if window is not None:
                # Sync: none. ``clip_grad_norm_`` returns a device tensor; it is kept, and
                # reaches the host through the ring at the window's end.
                window.grad_norm = norm
                phases = self.phases  # ``PhaseClock.enter``, inlined (see ``PhaseClock.marks``)
                phases.current = mark = (OPTIMIZER, time.perf_counter(), phases.stamp())
                phases.marks.append(mark)
        except Exception:
            self.faults.record("grad_norm")

    @guarded
    def optimizer_step_observed(self) -> None:
        """An update happened in this window (called by the optimizer's step post-hook, or by an
        adapter that sees the step another way)."""
        if self.window is not None:
            self.window.updates += 1

    def window_end(self) -> None:
        """Close the window and start its device values' trip to the host; hand the windows
        whose values have arrived to the sender. Never waits for the device, except when the
        ring is full (``PinnedRing.pop_oldest``).

        A CPU rank's window (unfolded, with no device flag) is handed to the sender as the
        trainer gave it: the counters advance here and the loss is read (to free its graph
        here); counting labels and reading the other values wait for the sender's batch. That
        path is written out in this one function, the rules of ``_advance`` and
        ``PhaseClock.take_window`` included: right after a training step each call layer costs
        about a microsecond, and calling those two instead measured 13 us more a step
        (``benchmarks/hook_overhead.py``, direct measure). The copies are marked below; a change
        to either rule changes them too."""
        window = self.window
        try:
            if window is None or not self.active:
                return
            self.window = None
            self._last_end = end = time.perf_counter()
            phases = self.phases  # ``PhaseClock.enter``, inlined (see ``PhaseClock.marks``)
            phases.current = mark = (DATA, end, phases.stamp())
            marks = phases.marks
            marks.append(mark)
            if not window.updates and self.optimizers and self._holds(window):
                self.carried = window
                return
            if not self._host_rank or self._totals is not None or window.verdicts:
                self._close_window(window, end)
                return
            microbatches = window.microbatches
            examples = window.examples  # ``WindowValues.local_examples``
            if examples is None:
                ids = window.sample_ids
                examples = len(ids) if ids is not None else label_rows(microbatches) or None
            updated = window.updates > 0
            if updated or not self.optimizers:  # ``_advance``, written out
                self.step += 1
            if examples is None:
                self.consumed = None
            elif self.consumed is not None:
                self.consumed += examples * self._dp_size
            for index, (loss, labels, tokens) in enumerate(microbatches):
                if getattr(loss, "is_cpu", False):
                    # Sync: none, the loss is in host memory. Read now: the tensor would hold
                    # its autograd graph until the render, and the graph freed on the sender
                    # thread costs that thread several times what it costs here.
                    microbatches[index] = (loss.item(), labels, tokens)
            phases.marks = []  # ``PhaseClock.take_window``, written out
            complete = not phases.overflow and len(marks) <= phases.max_marks
            phases.overflow = False
            skipped = (not updated) if self.optimizers else None
            if skipped:
                self._without_update(window)
            window.handed = (self.context, self.step, self.consumed, skipped, end, (marks, complete))
            self._sender.submit(window)
        except Exception as exc:
            self.faults.record("window_end")
            if window is not None and window.handed is None:  # taken above, never handed over
                self._unfinished(window.attempt, "window_end", exc)

    def _holds(self, window: WindowValues) -> bool:
        """Whether a window closing without an update is held for the next one to join
        (``accumulation.py`` says when); host facts only."""
        # ``stepped`` covers a fused optimizer's found-inf verdicts too: its post-hook, which
        # records them, runs only after the pre-hook that sets it.
        if self._flushing or window.stepped or window.grad_norm is not None:
            return False
        if window.parts >= MAX_PARTS or not self._scaler_idle(window):
            return False
        window.held = held_gradient(self.optimizers)
        if window.held is None:
            return False
        if "merging" not in self._logged:
            self._logged.add("merging")
            log.info(
                "runhealth: a window that ends with no optimizer step while its gradients "
                "accumulate is merged into the next one (one window per optimizer step)"
            )
        return True

    def _continued(self, sample_ids: Any, examples: int | None, data_wait_s: float | None) -> bool:
        """A window opens while one is held: it joins that one (no new attempt, no directive
        boundary: those fall between updates), unless the held gradient was zeroed meanwhile,
        in which case the held window is closed as the skipped update it was."""
        window, self.carried = self.carried, None
        if window is None:
            return False
        try:
            held, window.held = window.held, None
            if (
                window.stepped
                or held is None
                or not self._scaler_idle(window)
                or not still_accumulating(held)
            ):
                self._close_held(window)  # a step, or a GradScaler's skip, after its end
                return False
            self.window = window
            window.parts += 1
            if data_wait_s is None and self._last_end is not None:
                data_wait_s = time.perf_counter() - self._last_end
            window.examples = merged_examples(window.examples, examples)
            self._join(window, data_wait_s or 0.0, sample_ids)
            return True
        except Exception:
            self.faults.record("window_start")
            if self.window is window:
                return True  # joined: the rest of the join is what failed
            self._close_held(window)  # recorded as it stands rather than lost
            return False

    def _close_held(self, window: WindowValues) -> None:
        self.window = window
        self._flushing = True
        try:
            self.window_end()
        finally:
            self._flushing = False

    def flush(self) -> None:
        """Close the open window and a held one, without holding either: at the hook's close,
        before a rollback's restore, at a new incarnation."""
        window, self.carried = self.carried, None
        if window is not None:
            window.held = None
            self._close_held(window)
        if self.window is not None:
            self._close_held(self.window)

    def _unfinished(self, attempt: int, where: str, error: Exception) -> None:
        """An attempt counted without a record (the failure is counted already): the sender
        dead-letters what names it, with the error, so the window is not lost unrecorded."""
        try:
            self._sender.submit(UnfinishedWindow(self.context.identity, attempt, where, error))
        except Exception:
            self.faults.record("window accounting")

    def _close_window(self, window: WindowValues, end: float) -> None:
        """An accelerator's window (or a folded one): settled here, its device values sent
        through the ring."""
        pending, tensors = self._finish(window, end)
        if not tensors and self._ring_idle:
            self._sender.submit(pending)  # complete already (see ``_ring_idle``)
            return
        self._ring_idle = False
        with self._lock:
            ring = self._ring
            # Sync: none. Slots whose copy the device finished (their marker says so) are read.
            ready = ring.pop_ready()
            if ring.full:
                # The one wait on the device: the host is a whole ring of windows ahead of it.
                ready.append(ring.pop_oldest())
                self._counters.add("ring_waits")
            # Sync: none. The device values are copied non-blocking into a pinned host slot,
            # read a window or so later, once its marker completed.
            ring.push(tensors, pending)
            self._emit(ready)

    def _settle(self, window: WindowValues) -> None:
        """Microbatches taken as given become settled totals; a window of very many folds."""
        totals = self._totals
        if totals is None:
            totals = self._totals = Totals()
        totals.settle(window.microbatches, window.sum_reduction, self._counting, window.counts_rows())
        window.microbatches = []
        if len(totals.host) + len(totals.device_losses) >= FOLD_MICROBATCHES:
            totals.fold(self._torch, window.sum_reduction, self._counting)  # device sums: no sync
        self.phases.bound()

    def _finish(self, window: WindowValues, end: float) -> tuple[PendingWindow, list[torch.Tensor]]:
        """Settle the window, advance the three counters, split host facts from device values."""
        totals, host, rows = self._settle_window(window)
        if window.grad_norm is not None:
            # Moved to the hook's device with the window's other values (``device_values``).
            window.grad_norm = local_value(window.grad_norm)
        # A device found-inf flag counts as an update now; the render corrects it, a window
        # later, once its value arrived (``PendingWindow._verdict``): no sync to know now.
        updated = window.updates > 0 or bool(window.verdicts)
        self._advance(updated, window.local_examples(rows), window)
        names: tuple[str, ...] = ()
        tensors: list[torch.Tensor] = []
        if totals is not None or not window.scalars_on_host():
            names, tensors = (totals or Totals()).device_values(window, self._torch, self._device)
        skipped = (not updated) if self.optimizers else None
        marks = self.phases.take_window()
        pending = PendingWindow(
            self.context, window, totals, host, self.step, self.consumed, skipped, end, names, marks
        )
        return pending, tensors

    def _settle_window(self, window: WindowValues) -> tuple[Totals | None, list[Microbatch], int]:
        """The window's settled totals (None in the common case: every value on the host and
        nothing folded), its host microbatches outside them, and its label rows."""
        host = settle_on_host(window.microbatches) if self._totals is None else None
        if host is None:
            self._settle(window)
        totals, self._totals = self._totals, None
        rows = totals.rows if totals is not None else 0
        if host is not None and window.counts_rows():
            rows = label_rows(window.microbatches)  # host shapes: no sync
        window.microbatches = []  # the window keeps no loss that still holds its graph
        return totals, host or [], rows

    def _advance(self, updated: bool, examples: int | None, window: WindowValues) -> None:
        """Count the attempt's update (as far as the host knows) and its examples. Written out
        in ``window_end`` for a CPU rank's window."""
        if updated or not self.optimizers:
            self.step += 1
        else:
            self._without_update(window)
        if examples is None:
            self.consumed = None  # unknown from here on, rather than wrong
        elif self.consumed is not None:
            self.consumed += examples * self._dp_size

    def _without_update(self, window: WindowValues) -> None:
        """A window closed without an optimizer update and not merged into the next
        (``accumulation.py``). When a GradScaler stepped in it (or a scaler that cannot say so is
        watched) that is its skip. When nothing skipped it, it may be a loop that opens a window
        per microbatch whose gradients accumulate where the hook cannot see them (each such
        window is recorded as a skipped update, and three in twenty windows are the skip-storm
        rule's incident): said once, at the third."""
        if not self._scaler_idle(window):
            return
        self._windows_without_update += 1
        if self._windows_without_update == WITHOUT_UPDATE_NOTE:
            self._note_once(
                "without_update",
                f"{WITHOUT_UPDATE_NOTE} windows closed without an optimizer update, and nothing "
                "skipped one (no GradScaler watched, or it neither stepped nor updated in them). "
                "If this loop accumulates gradients, open one "
                "window per optimizer step: rh.windows(loader, microbatches=K), or rh.window_start() "
                "before the first microbatch and rh.window_end() after optimizer.step(). Each "
                "window without an update is recorded as a skipped one, and three in twenty open a "
                "skip-storm incident.",
            )

    def _scaler_idle(self, window: WindowValues) -> bool:
        """No scaler watched, or a GradScaler that neither stepped nor updated in the window
        (``update()`` replaces its per-optimizer state); a scaler that cannot say is not idle."""
        if self._read_scale is None:
            return True
        return window.scaler_round is not None and (
            getattr(self.scaler, "_per_optimizer_states", None) is window.scaler_round
        )

    def _emit(self, ready: list[tuple[PendingWindow, list[float]]]) -> None:
        """Hand completed windows to the sender (the caller holds the lock, so the order is
        kept); the sender renders them into records."""
        for pending, values in ready:
            pending.device_values = values
            self._sender.submit(pending)

    def drain_ready(self) -> None:
        """From the sender thread: records reach the store while the trainer is stuck."""
        if self.active:
            with self._lock:
                self._emit(self._ring.pop_ready())

    def drain(self) -> None:
        """Every window still in the ring. Waits for the device: only at close or a restore."""
        with self._lock:
            self._emit(self._ring.drain())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A hold between windows (``holds.py``): heartbeats say ``held`` (the hang rule
        leaves such a rank alone), and the pause is not counted as the next window's data
        wait. No mark is taken: the pause belongs to no window."""
        phases = self.phases
        before = phases.current
        phases.current = (Phase.HELD, time.perf_counter(), None)
        try:
            yield
        finally:
            phases.current = (before[0], time.perf_counter(), before[2])  # since now: not hung
            if self._last_end is not None:
                self._last_end = time.perf_counter()

    def restart(self, identity_fields: dict[str, Any]) -> None:
        """A restore inside this process: attempts count again from 0, records carry the new
        incarnation (in ``identity_fields``), and device-only skips count afresh."""
        self.attempt = self.next_boundary = 0
        self.context = RenderContext(identity_fields, self._counting, self._max_sample_ids, self.phases)

    @property
    def progress(self) -> dict[str, int | None]:
        """The three counters; the step less the skips only the device knew of, so far."""
        context = getattr(self, "context", None)
        step = self.step - (context.device_skips.count if context is not None else 0)
        return {"attempt": self.attempt, "step": step, "consumed": self.consumed}

    @property
    def unfinished(self) -> WindowValues | None:
        """The open window, else a held one: the window whose update a save taken now follows."""
        return self.window if self.window is not None else self.carried

    def boundary_consumed(self) -> int | None:
        """The consumed count a save taken now captures: the ended windows' examples, and the
        open window's once its update ran. A loop that saves right after ``optimizer.step()``
        inside ``rh.windows()`` (as Accelerate's examples do, inside the batch loop) still has
        that window open: it ends only when the loop asks for the next batch. Host facts only."""
        window = self.unfinished
        if self.consumed is None or window is None or not (window.updates or window.verdicts):
            return self.consumed
        folded = self._totals.rows if self._totals is not None else 0
        examples = window.local_examples(folded + label_rows(window.microbatches))
        return None if examples is None else self.consumed + examples * self._dp_size

    # Values without a sync.

    def _sample_ids(self, ids: Any) -> Any:
        """The ids as given (rendered on the sender thread); a list is copied, since trainers
        reuse lists more often than tensors."""
        if ids is None or type(ids) is list:
            return None if ids is None else list(ids)
        if on_device(ids):
            self._note_once("cuda_ids", "sample ids on a CUDA device are ignored (reading = sync)")
            return None
        return list(ids) if isinstance(ids, list | tuple) else ids

    # Framework callbacks: guarded like every entry point, since they run inside training.

    def _hook_forward(self) -> None:
        """Mark each microbatch's forward with a pre-hook on the model, once a window turns out
        to have several: a single-microbatch window's forward starts at ``window_start``, and
        any hook on a module sends every call through the module's slower hook path."""
        self._forward_hooked = True
        if self.model is not None:
            self.handles.append(self.model.register_forward_pre_hook(self._before_forward))

    @guarded
    def _before_forward(self, _module: Any, _args: Any) -> None:
        if self.window is not None:
            self.phases.enter(Phase.FORWARD)

    def _before_optimizer_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The optimizer phase begins, if ``grad_norm`` did not begin it; the learning rate the
        update uses is read again. The window's start read one already (the only one a
        skipped update has), but loops that set the rate by hand at the top of an iteration
        (nanoGPT, for one) may do so after ``window_start``."""
        try:
            window = self.window
            if window is None:
                window = self.carried  # a loop that ends its window before the optimizer step
                if window is None:
                    return
            window.stepped = True
            phases = self.phases
            if phases.current[0] is not OPTIMIZER:
                phases.enter(OPTIMIZER)
            lr = optimizer.param_groups[0]["lr"]
            window.lr = lr if type(lr) is float else learning_rate(optimizer)  # cloned: no sync
        except Exception:
            self.faults.record("_before_optimizer_step")

    def _after_optimizer_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The step ran. With a GradScaler, an optimizer that handles AMP scaling itself (fused
        Adam, AdamW, SGD) is stepped even when the gradients overflowed, and skips the update
        inside its kernel: the scaler's found-inf flag (set on the optimizer for the step) says
        which. On the CPU it is read at once; on a device it travels through the ring.

        From here heartbeats say ``data``, between updates: what a loop does after its update
        and before its next window (the scheduler, logging, an evaluation, a checkpoint written
        inside ``rh.windows()``, as Hugging Face's examples save) is not a training phase, whose
        hang timeout is 10 learned steps (a 15 s ``save_state`` was a critical hang). Only the
        heartbeat's phase changes: the window's timings still end at ``window_end``."""
        try:
            window = self.window
            if window is None:
                window = self.carried  # its step is the held window's update
                if window is None:
                    return
            # The GradScaler's flag, set on such an optimizer for the duration of its step.
            flag = getattr(optimizer, "found_inf", None)
            if flag is None:  # the common case, kept inline (the step path)
                window.updates += 1
            else:
                self._count_flagged_update(window, flag)
            self.phases.current = (DATA, time.perf_counter(), None)
        except Exception:
            self.faults.record("_after_optimizer_step")

    def _count_flagged_update(self, window: WindowValues, flag: Any) -> None:
        if flag.is_cpu:
            window.updates += int(flag.item() == 0)  # host memory: no sync
        else:
            # Sync: none. Reading a device flag would wait for the optimizer's kernel; it is
            # summed on the device and read when the window's ring slot completes.
            window.verdicts = [*(window.verdicts or []), flag]

    @guarded
    def microbatch_arrived(
        self, index: int, waited: float, sample_ids: Callable[[Any], Any] | None, batch: Any
    ) -> None:
        """``RunHealth.windows``: batch ``index`` of a window arrived after ``waited`` seconds."""
        try:
            ids = sample_ids(batch) if sample_ids is not None else None
        except Exception:  # the trainer's function: the window is still opened, without ids
            self.faults.record("sample_ids")
            ids = None
        if index == 0:
            self.window_start(sample_ids=ids, data_wait_s=waited)
            return
        window = self.window
        if window is not None:
            self._join(window, waited, ids)

    def _join(self, window: WindowValues, waited: float, ids: Any) -> None:
        """A later microbatch joins the open window: its wait, its ids, its forward."""
        window.data_wait_s = (window.data_wait_s or 0.0) + waited
        extra = self._sample_ids(ids)
        if extra is not None:  # accumulation: the window's ids are its microbatches' ids
            limit = self._max_sample_ids
            window.sample_ids = [
                *(render_ids(window.sample_ids, limit) or []),
                *(render_ids(extra, limit) or []),
            ]
        self.phases.enter(Phase.FORWARD)

    @guarded
    def enter(self, phase: Phase) -> None:
        if self.active:
            self.phases.enter(phase)

    def _note_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning("runhealth: %s", message)
