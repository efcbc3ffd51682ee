"""``RunHealth``: the per-rank hook a trainer attaches with a few lines.

    from collectors import RunHealth

    with RunHealth(model=model, optimizer=optimizer) as rh:
        for batch in rh.windows(loader, sample_ids=lambda b: b["ids"]):
            loss = model(**batch).loss
            rh.loss(loss, labels=batch["labels"])
            loss.backward()
            rh.grad_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            optimizer.step()
            optimizer.zero_grad()

A window is one optimizer-step attempt (all its microbatches). Three counters stay apart:
``attempt`` counts windows tried, skipped ones included; ``step`` counts successful updates,
judged by the watched optimizer actually stepping: its step post-hook fires (a GradScaler that
finds an inf skips ``optimizer.step`` altogether) and, for optimizers that take the scaler's
found-inf flag into their own kernel (fused Adam/AdamW/SGD), that flag is clear. A drop in the
scale alone is not proof: some trainers skip without lowering it. ``consumed`` counts examples
globally (this rank's examples times the data-parallel size), skipped windows included, since
their data was consumed.

No host-device synchronization on the hot path, and little work: during a window the hook keeps
references; at its end device values are summed on the device and copied without blocking into
pinned host memory (``ring.py``), host values are left for the sender thread to read
(``window.py``), and the record is rendered there once the copy is known to be complete. Every
public method catches its own exceptions (``guard.py``): the training loop never sees one.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from collectors import attach
from collectors.checkpoints import checkpoint_record
from collectors.collectives import collectives_for
from collectors.config import RunHealthConfig
from collectors.counters import Counters
from collectors.directives import IMMEDIATE, Armory, Consensus, Directive
from collectors.embedded import mark_done
from collectors.guard import EntryErrors, guarded
from collectors.layout import Identity, discover_identity, resolve_device
from collectors.markers import marker_factory
from collectors.phases import Phase, PhaseClock, stamps_for
from collectors.restore import ResumeNote, gather_restored
from collectors.ring import PinnedRing
from collectors.samplers import Sampler
from collectors.sender import Sender, Transport
from collectors.stacks import StackDump, dump_stacks
from collectors.values import learning_rate, local_value, loss_scale, on_device
from collectors.window import (
    Counting,
    Microbatch,
    PendingWindow,
    RenderContext,
    Totals,
    WindowValues,
    label_rows,
    render_ids,
    settle_on_host,
)
from collectors.wire import Record, to_wire

if TYPE_CHECKING:
    import torch

log = logging.getLogger("runhealth.collectors")

# The phases the step-path entry points mark, as module constants: an enum member looked up on
# its class costs a microsecond or two right after a training step.
FORWARD, BACKWARD, OPTIMIZER, DATA = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.DATA

Batch = TypeVar("Batch")
Reduction = Literal["mean", "sum"]

# Per-microbatch values are kept in lists and summed at the window's end (one stack instead of
# a device add per microbatch); past this many they are folded, so memory stays bounded.
FOLD_MICROBATCHES = 64


class RunHealth:
    """One per rank. Construct (cheap, no side effects), ``start()`` (attach), train, ``close()``.

    ``model``: device and resume evidence; with accumulation, a forward pre-hook on it marks
    each microbatch's forward. ``optimizer`` (one or several): step hooks count real updates and
    read the learning rate used. ``scaler``: a GradScaler whose scale is recorded without a
    sync. ``scheduler``: read only at resume. ``mesh`` or ``groups``
    (``{"dp": pg, "tp": pg, ...}``): the parallel layout; plain data parallelism otherwise.
    ``samplers``: built with ``submit`` as their sink, started at attach (``samplers.py``). ``transport``: where batches
    go instead of the HTTP service (tests, custom sinks). ``environ``: the environment, read
    once here (``os.environ`` when omitted). Objects created later: ``watch(...)``.
    """

    def __init__(
        self,
        *,
        model: Any = None,
        optimizer: Any = None,
        scaler: Any = None,
        scheduler: Any = None,
        mesh: Any = None,
        groups: Mapping[str, Any] | None = None,
        device: Any = None,
        run_config: Mapping[str, Any] | None = None,
        samplers: Sequence[Sampler] = (),
        transport: Transport | None = None,
        config: RunHealthConfig | None = None,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
        hostname: Callable[[], str] = attach.hostname,
        canary_faults: Any = None,
    ) -> None:
        self._environ = dict(os.environ if environ is None else environ)  # the one read
        self.config = config or RunHealthConfig.from_environ(self._environ)
        self._counters = Counters()
        self.faults = EntryErrors(self._counters)
        self._clock = clock
        self._hostname = hostname
        self._layout_args = (mesh, groups, device)
        self._run_config = dict(run_config or {})
        self._samplers = list(samplers)
        self._transport = transport
        self._model: Any = None
        self._optimizers: list[Any] = []
        self._scaler: Any = None
        self._scheduler: Any = None
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self._started = self._active = self._closed = False
        self._destination: attach.Destination | None = None
        self._window: WindowValues | None = None
        self._last_end: float | None = None
        self._attempt = self._step = 0
        self._consumed: int | None = 0
        # Records handed over before start, sent at start; events get the identity then.
        self._early: list[tuple[Record, bool]] = []
        self._resume: ResumeNote | None = None
        self._totals: Totals | None = None  # made only when a window has device parts or folds
        self._forward_hooked = False
        hook_config = self.config.hook
        self._counting = Counting(hook_config.shift_labels, hook_config.ignore_index)
        self._logged: set[str] = set()
        # Directives: armed by the sender thread, acted on at window boundaries (directives.py).
        self._armory = Armory()
        self._stop: Directive | None = None
        self._boundary_attempt = -1
        # The attempt at which ``window_start`` next calls ``_boundary``: every ``agree_every``
        # attempts, or at once (0) when a local directive is armed. One comparison per window.
        self._next_boundary = 0
        self._next_poll = 0.0
        self._answered_with_post = False
        self._canary_stack: dict[str, Any] | None = None
        self._canary_faults = canary_faults  # emulated faulty hardware, for tests and drills
        self.watch(model=model, optimizer=optimizer, scaler=scaler, scheduler=scheduler)

    # Attaching and closing.

    def start(self) -> RunHealth:
        """Attach: learn who this rank is, agree on the incarnation, start sending. Every rank
        must call it (it runs attach-time collectives). Idempotent; returns ``self``."""
        if not self._started:
            self._started = True
            try:
                self._attach()
                self._active = True
            except Exception:
                self.faults.record("start")
                log.error("runhealth: attach failed; the hook stays off for this process")
            else:
                self._after_attach()
        return self

    def _attach(self) -> None:
        torch = importlib.import_module("torch")
        self._torch = torch
        mesh, groups, device = self._layout_args
        self._device = resolve_device(device, self._model)
        self.identity: Identity = discover_identity(
            torch,
            self._environ,
            device=self._device,
            mesh=mesh,
            groups=groups,
            hostname=self._hostname,
        )
        collectives = collectives_for(torch)
        self._collectives = collectives
        ids = attach.agree_on_run(collectives, self.config.transport.run, self._environ)
        self.incarnation, self.run = ids.incarnation, ids.run
        if self.config.transport.url or self._transport is not None:
            self._destination = attach.configured(self.config)
        else:
            self._destination = attach.embedded(
                self.config, self.identity, ids.run, collectives, self._environ
            )
        self._sender: Sender = attach.build_sender(
            self.config,
            self.identity,
            ids,
            self._destination,
            self._counters,
            transport=self._transport,
            heartbeat=self._heartbeat,
            poll=self._on_sender_cycle,
            directives=self._on_posted_directives,
        )
        self._ask_directives_with_posts()
        self._consensus = Consensus.create(torch)
        device_type = self._device.type
        new_marker = marker_factory(device_type)
        self._ring = PinnedRing[PendingWindow](self.config.ring, device=self._device, new_marker=new_marker)
        stamps = stamps_for(device_type, self.identity.world_size)
        self._phases = PhaseClock(stamps, self.config.hook.max_phase_marks, self._clock)
        self._render_context = RenderContext(
            self.identity.record_fields(self.incarnation),
            self._counting,
            self.config.hook.max_sample_ids,
            self._phases,
        )
        self._dp_size = self.identity.layout.dp.size
        self._agree_every = self.config.hook.agree_every
        # True until a window goes through the ring: while it is, and phases are stamped on the
        # host, a window with nothing on the device is complete at its end and goes straight
        # to the sender, without the ring or its lock. On a GPU its phase events still need the
        # ring's marker.
        self._ring_idle = self._phases.host_timed
        # A CPU rank: every value is on the host, so a window is handed to the sender as the
        # trainer gave it, and settled there (``window_end``).
        self._host_rank = device_type == "cpu"

    def _after_attach(self) -> None:
        self._sender.start()
        self._pid = os.getpid()
        atexit.register(self._close_at_exit)
        if self.identity.rank == 0:
            self._sender.submit(self._run_start())
        for record, is_event in self._early:
            if is_event:
                self._submit_event(record)
            else:
                self._sender.submit(record)
        self._early.clear()
        for sampler in self._samplers:
            self._start_sampler(sampler)

    def close(self, status: Literal["completed", "failed", "stopped"] = "completed") -> None:
        """Record what is left, flush (bounded), stop samplers and the embedded service."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        if self._active:
            self._close(status)
        self._active = False

    def _close_at_exit(self) -> None:
        """The interpreter is exiting with the hook still open: a script that attached with
        ``start()`` and never closed, or an exception that skipped the framework's end of
        training (the transformers ``Trainer`` calls no callback when ``train()`` raises). The
        sender thread is a daemon and dies with the interpreter: without this, the windows
        still queued (up to a flush interval's worth, the last ones before a crash) and the
        run's finish would be lost. An uncaught exception finishes the incarnation as
        "failed", any other exit as "completed" (the exit code is not visible from here). A
        forked child inherits the handler but not the sender thread, and must not stop the
        parent's embedded service: there it does nothing."""
        if os.getpid() != self._pid:
            return
        uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        self.close("failed" if uncaught is not None else "completed")

    @guarded
    def _close(self, status: str) -> None:
        if self._window is not None:
            self.window_end()
        with self._lock:
            # Waiting for the device here is fine: training is over.
            self._emit(self._ring.drain())
        self._flush_resume()
        self._phases.enter(Phase.CLOSED)
        if self.identity.rank == 0:
            self._sender.submit(
                {
                    "kind": "run_finish",
                    "incarnation": self.incarnation,
                    "time": self._clock(),
                    "status": status,
                }
            )
        for sampler in self._samplers:
            self._stop_sampler(sampler)
        for handle in self._handles:
            handle.remove()
        self._consensus.close(self.config.directives.close_wait_s)
        if not self._sender.close():
            log.warning(
                "runhealth: records are left in the spool under %s; the run's next trainer replays "
                "them, or: runhealth spool send --dir %s --run %s --url URL --token TOKEN",
                self._sender.spool_path.parent,
                self.config.spool.directory,
                self.run,
            )
        self._release_service(wait_for_peers=status != "failed")

    def _release_service(self, *, wait_for_peers: bool) -> None:
        """Mark this rank done; the rank running the node's service stops it once the node's
        ranks are done. After a failure it does not wait for them: peers of a failed rank are
        usually blocked in a collective until the launcher ends them, and this process's exit
        is what tells the launcher. What they send after the stop is spooled and replayed by
        the next start."""
        destination = self._destination
        if destination is None:
            return
        if destination.endpoint is not None:
            mark_done(destination.endpoint, self.identity.rank)
        if destination.service is not None:
            ranks = destination.node_ranks if wait_for_peers else 1
            destination.service.stop(destination.endpoint, ranks)

    def __enter__(self) -> RunHealth:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close("failed" if exc_type is not None else "completed")

    # Late wiring (framework adapters create the optimizer after the callback).

    @guarded
    def watch(
        self, *, model: Any = None, optimizer: Any = None, scaler: Any = None, scheduler: Any = None
    ) -> None:
        if model is not None and self._model is None:
            self._model = model
        optimizers = optimizer if isinstance(optimizer, list | tuple) else [optimizer]
        for item in optimizers:
            if item is not None and all(item is not known for known in self._optimizers):
                self._optimizers.append(item)
                self._handles.append(item.register_step_pre_hook(self._before_optimizer_step))
                self._handles.append(item.register_step_post_hook(self._after_optimizer_step))
        self._scaler = scaler if scaler is not None else self._scaler
        self._scheduler = scheduler if scheduler is not None else self._scheduler

    # The window: the hot path. No host-device synchronization from here to window_end, and as
    # little work as possible: host values are only referenced here and read on the sender
    # thread (``window.py``).

    def windows(
        self,
        batches: Iterable[Batch],
        *,
        sample_ids: Callable[[Batch], Any] | None = None,
        microbatches: int = 1,
    ) -> Iterator[Batch]:
        """Iterate ``batches`` as windows of ``microbatches`` batches each, timing the wait for
        each batch as data wait. Exceptions from the loader itself are the trainer's and pass."""
        self.start()
        iterator = iter(batches)
        while True:
            if self.should_stop():
                return  # before fetching: the next batch stays for after the rollback
            for index in range(max(1, microbatches)):
                if index:
                    self._enter(Phase.DATA)
                waited = time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    if index:
                        self.window_end()
                    return
                self._microbatch_arrived(index, time.perf_counter() - waited, sample_ids, batch)
                yield batch
            self.window_end()

    # The step-path entry points below catch their own exceptions inline instead of through
    # ``@guarded``: its extra frame and argument packing cost microseconds per call once a
    # training step has evicted the caches, and they run several times a step.

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
        try:
            if self._window is not None or not self._active:
                self._ready_for_window()
                if not self._active:
                    return
            if self._attempt >= self._next_boundary:
                self._boundary()
            now = time.perf_counter()
            if data_wait_s is None and self._last_end is not None:
                data_wait_s = now - self._last_end
            self._attempt += 1
            ids = list(sample_ids) if type(sample_ids) is list else self._sample_ids(sample_ids)
            window = WindowValues(self._attempt, data_wait_s, ids, examples)
            if self._scaler is not None:
                window.loss_scale = loss_scale(self._scaler)
            if self._optimizers:
                lr = self._optimizers[0].param_groups[0]["lr"]
                window.lr = lr if type(lr) is float else learning_rate(self._optimizers[0])
            self._window = window
            phases = self._phases  # ``PhaseClock.enter``, inlined (see ``PhaseClock.marks``)
            phases.current = mark = (FORWARD, now, phases.stamp())
            phases.marks.append(mark)
            if self._resume is not None:
                self._flush_resume()
        except Exception:
            self.faults.record("window_start")

    def _ready_for_window(self) -> None:
        """Attach on first use; close a window the trainer left open (no ``window_end``)."""
        if not self._active:
            self.start()
        elif self._window is not None:
            self.window_end()

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
            window = self._window
            if window is None:
                self._note_once("loss", "loss() outside a window is ignored (call window_start)")
                return
            window.sum_reduction = reduction == "sum"
            window.count = count = window.count + 1
            window.microbatches.append((loss, labels, tokens))
            if count > 1:
                self._accumulating(window)
            phases = self._phases  # ``PhaseClock.enter``, inlined (see ``PhaseClock.marks``)
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
            window = self._window
            if window is not None:
                window.grad_norm = norm
                phases = self._phases  # ``PhaseClock.enter``, inlined (see ``PhaseClock.marks``)
                phases.current = mark = (OPTIMIZER, time.perf_counter(), phases.stamp())
                phases.marks.append(mark)
        except Exception:
            self.faults.record("grad_norm")

    @guarded
    def optimizer_step_observed(self) -> None:
        """An update happened in this window (called by the optimizer's step post-hook, or by an
        adapter that sees the step another way)."""
        if self._window is not None:
            self._window.updates += 1

    def window_end(self) -> None:
        """Close the window and start its device values' trip to the host; hand the windows
        whose values have arrived to the sender. Never waits for the device, except when the
        ring is full (``PinnedRing.pop_oldest``).

        A CPU rank's window (unfolded, with no device flag) is handed to the sender as the
        trainer gave it: the counters advance here and the loss is read (to free its graph
        here); counting labels and reading the other values wait for the sender's batch. That
        path is written out in this one function: right after a training step each call layer
        costs about a microsecond, and inlining ``_advance`` and ``PhaseClock.take_window``
        here measured 4 us less per window (same rules; keep them in step)."""
        try:
            window = self._window
            if window is None or not self._active:
                return
            self._window = None
            self._last_end = end = time.perf_counter()
            phases = self._phases  # ``PhaseClock.enter``, inlined (see ``PhaseClock.marks``)
            phases.current = mark = (DATA, end, phases.stamp())
            marks = phases.marks
            marks.append(mark)
            if not self._host_rank or self._totals is not None or window.verdicts:
                self._close_window(window, end)
                return
            microbatches = window.microbatches
            examples = window.examples  # ``WindowValues.local_examples``
            if examples is None:
                ids = window.sample_ids
                examples = len(ids) if ids is not None else label_rows(microbatches) or None
            updated = window.updates > 0
            if updated or not self._optimizers:  # ``_advance``
                self._step += 1
            if examples is None:
                self._consumed = None
            elif self._consumed is not None:
                self._consumed += examples * self._dp_size
            for index, (loss, labels, tokens) in enumerate(microbatches):
                if getattr(loss, "is_cpu", False):
                    # Read now (host memory: no device involved). The tensor would hold its
                    # autograd graph until the render, and the graph freed on the sender
                    # thread costs that thread several times what it costs here.
                    microbatches[index] = (loss.item(), labels, tokens)
            phases.marks = []  # ``PhaseClock.take_window``
            complete = not phases.overflow and len(marks) <= phases.max_marks
            phases.overflow = False
            skipped = (not updated) if self._optimizers else None
            window.handed = (
                self._render_context,
                self._step,
                self._consumed,
                skipped,
                end,
                (marks, complete),
            )
            self._sender.submit(window)
        except Exception:
            self.faults.record("window_end")

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
            ready = ring.pop_ready()
            if ring.full:
                ready.append(ring.pop_oldest())
                self._counters.add("ring_waits")
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
            totals.fold(self._torch, window.sum_reduction, self._counting)
        self._phases.bound()

    def _finish(self, window: WindowValues, end: float) -> tuple[PendingWindow, list[torch.Tensor]]:
        """Settle the window, advance the three counters, split host facts from device values."""
        totals, host, rows = self._settle_window(window)
        if window.grad_norm is not None:
            window.grad_norm = local_value(window.grad_norm, self._device)
        updated = window.updates > 0 or bool(window.verdicts)
        self._advance(updated, window.local_examples(rows))
        names: tuple[str, ...] = ()
        tensors: list[torch.Tensor] = []
        if totals is not None or not window.scalars_on_host():
            names, tensors = (totals or Totals()).device_values(window, self._torch)
        skipped = (not updated) if self._optimizers else None
        marks = self._phases.take_window()
        pending = PendingWindow(
            self._render_context,
            window,
            totals,
            host,
            self._step,
            self._consumed,
            skipped,
            end,
            names,
            marks,
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
            rows = label_rows(window.microbatches)
        window.microbatches = []  # the window keeps no loss that still holds its graph
        return totals, host or [], rows

    def _advance(self, updated: bool, examples: int | None) -> None:
        """Count the attempt's update (as far as the host knows: a device verdict is counted as
        an update now, corrected when rendered) and its examples. Written out again in
        ``window_end`` for a CPU rank's window: keep the two in step."""
        if updated or not self._optimizers:
            self._step += 1
        if examples is None:
            self._consumed = None  # unknown from here on, rather than wrong
        elif self._consumed is not None:
            self._consumed += examples * self._dp_size

    def _emit(self, ready: list[tuple[PendingWindow, list[float]]]) -> None:
        """Hand completed windows to the sender (the caller holds the lock, so the order is
        kept); the sender renders them into records."""
        for pending, values in ready:
            pending.device_values = values
            self._sender.submit(pending)

    def _drain_ready(self) -> None:
        """From the sender thread: records reach the store while the trainer is stuck."""
        if self._active:
            with self._lock:
                self._emit(self._ring.pop_ready())

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
        if self._model is not None:
            self._handles.append(self._model.register_forward_pre_hook(self._before_forward))

    @guarded
    def _before_forward(self, _module: Any, _args: Any) -> None:
        if self._window is not None:
            self._phases.enter(Phase.FORWARD)

    def _before_optimizer_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The optimizer phase begins, if ``grad_norm`` did not begin it; the learning rate the
        update uses is read again. The window's start read one already (the only one a
        skipped update has), but loops that set the rate by hand at the top of an iteration
        (nanoGPT, for one) may do so after ``window_start``."""
        try:
            window = self._window
            if window is None:
                return
            phases = self._phases
            if phases.current[0] is not OPTIMIZER:
                phases.enter(OPTIMIZER)
            lr = optimizer.param_groups[0]["lr"]
            window.lr = lr if type(lr) is float else learning_rate(optimizer)
        except Exception:
            self.faults.record("_before_optimizer_step")

    def _after_optimizer_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The step ran. With a GradScaler, an optimizer that handles AMP scaling itself (fused
        Adam, AdamW, SGD) is stepped even when the gradients overflowed, and skips the update
        inside its kernel: the scaler's found-inf flag (set on the optimizer for the step) says
        which. On the CPU it is read at once; on a device it travels through the ring."""
        try:
            window = self._window
            if window is None:
                return
            # The GradScaler's flag, set on such an optimizer for the duration of its step.
            flag = getattr(optimizer, "found_inf", None)
            if flag is None:  # the common case, kept inline (the step path)
                window.updates += 1
            else:
                self._count_flagged_update(window, flag)
        except Exception:
            self.faults.record("_after_optimizer_step")

    def _count_flagged_update(self, window: WindowValues, flag: Any) -> None:
        if flag.is_cpu:
            window.updates += int(flag.item() == 0)
        else:
            window.verdicts = [*(window.verdicts or []), flag]

    @guarded
    def _microbatch_arrived(
        self, index: int, waited: float, sample_ids: Callable[[Any], Any] | None, batch: Any
    ) -> None:
        ids = sample_ids(batch) if sample_ids is not None else None
        if index == 0:
            self.window_start(sample_ids=ids, data_wait_s=waited)
            return
        window = self._window
        if window is None:
            return
        window.data_wait_s = (window.data_wait_s or 0.0) + waited
        extra = self._sample_ids(ids)
        if extra is not None:  # accumulation: the window's ids are its microbatches' ids
            limit = self.config.hook.max_sample_ids
            window.sample_ids = [
                *(render_ids(window.sample_ids, limit) or []),
                *(render_ids(extra, limit) or []),
            ]
        self._phases.enter(Phase.FORWARD)

    @guarded
    def _enter(self, phase: Phase) -> None:
        if self._active:
            self._phases.enter(phase)

    # Checkpoints and resumes.

    @guarded
    def checkpoint_saved(
        self,
        step: int,
        path: str,
        *,
        manifest: Mapping[str, Any] | None = None,
        consumed: int | None = None,
        tags: Sequence[str] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """A committed checkpoint (call it after the last file and the manifest landed). The
        store keys checkpoints by path, so rank 0 sends and other ranks' calls do nothing."""
        record = checkpoint_record(
            step, path, self._clock(), manifest=manifest, consumed=consumed, tags=tags, metrics=metrics
        )
        self._submit_event(record)
        if self.config.hook.canary_on_checkpoint and self._active:
            self._run_canary(None)

    @guarded
    def resumed(
        self,
        *,
        checkpoint_path: str | None = None,
        checkpoint_step: int | None = None,
        consumed: int | None = None,
        first_sample_ids: Any = None,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """What a restart restored. Reads device values (moment norms, the scale): a sync,
        fine once at resume. Objects default to the watched ones. The step counter continues
        from ``checkpoint_step`` (else the optimizer's step counter), ``consumed`` likewise;
        the first batch's ids come from the first window unless given."""
        if self._active and self._attempt > 0:
            self._new_incarnation()  # restored in this process: what follows is a new start
        self._stop = None
        watched_optimizer = self._optimizers[0] if self._optimizers else None
        restored = gather_restored(
            model=model if model is not None else self._model,
            optimizer=optimizer if optimizer is not None else watched_optimizer,
            scheduler=scheduler if scheduler is not None else self._scheduler,
            scaler=scaler if scaler is not None else self._scaler,
        )
        restored.update(extra or {})
        step = checkpoint_step
        if step is None and "optimizer_step_max" in restored.get("optimizer", {}):
            step = int(restored["optimizer"]["optimizer_step_max"])
        if step is not None:
            self._step = step
        if consumed is not None:
            self._consumed = consumed
        restored.update(resumed_step=step, consumed=consumed)
        if first_sample_ids is not None:
            restored["first_sample_ids"] = render_ids(first_sample_ids, self.config.hook.max_sample_ids)
        self._resume = ResumeNote(to_wire(restored), checkpoint_path, checkpoint_step, self._clock())
        if first_sample_ids is not None or self._window is not None:
            self._flush_resume()

    def _flush_resume(self) -> None:
        """Send the pending resume event, with the current window's first ids if it lacks them."""
        resume = self._resume
        if resume is None or not self._active:
            return
        self._resume = None
        ids = self._window.sample_ids if self._window is not None else None
        self._submit_event(resume.record(render_ids(ids, self.config.hook.max_sample_ids)))

    def _submit_event(self, record: Record) -> None:
        """Checkpoint and resume events: identity added at send time (known after start)."""
        if not self._active:
            if len(self._early) < self.config.sender.queue_records:
                self._early.append((record, True))
            return
        if record["kind"] == "checkpoint" and self.identity.rank != 0:
            return
        self._sender.submit({**record, "incarnation": self.incarnation, "rank": self.identity.rank})

    # Samplers, hang evidence, counters.

    @guarded
    def submit(self, record: dict[str, Any]) -> None:
        """The sink samplers hand records to (any thread; never blocks)."""
        wire = to_wire(record)
        if self._active:
            self._sender.submit(wire)
        elif not self._closed and len(self._early) < self.config.sender.queue_records:
            self._early.append((wire, False))

    @guarded
    def add_sampler(self, sampler: Sampler) -> None:
        self._samplers.append(sampler)
        if self._active:
            self._start_sampler(sampler)

    @guarded
    def _start_sampler(self, sampler: Sampler) -> None:
        sampler.start()

    @guarded
    def _stop_sampler(self, sampler: Sampler) -> None:
        sampler.stop()

    @guarded
    def stack_dump(self) -> StackDump:
        """Every Python thread's stack (and the NCCL flight recorder when it is on). The hook
        point for the service's dump request; safe from any thread while training is stuck."""
        return dump_stacks(nccl_trace=self.config.hook.nccl_trace)

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot: sent, spooled, replayed, dead_lettered, dropped, and the rest."""
        return self._counters.snapshot()

    @property
    def progress(self) -> dict[str, int | None]:
        """The three counters: windows attempted, successful updates, consumed examples."""
        context = getattr(self, "_render_context", None)
        step = self._step - (context.device_skips.count if context is not None else 0)
        return {"attempt": self._attempt, "step": step, "consumed": self._consumed}

    @property
    def spool_path(self) -> str | None:
        sender = getattr(self, "_sender", None)
        return None if sender is None else str(sender.spool_path)

    @property
    def embedded_pid(self) -> int | None:
        """The PID of the embedded service this rank started, if it started one."""
        destination = self._destination
        if destination is None or destination.service is None:
            return None
        return destination.service.pid

    # Directives: polled on the sender thread, acted on at window boundaries.

    @guarded
    def should_stop(self) -> bool:
        """True once a rollback directive stopped this rank at a window boundary (every rank
        stops at the same one). ``windows()`` checks it itself; a hand-written loop calls it
        before fetching each batch. The directive is then in ``rh.directive``."""
        if self._active:
            self._boundary()
        return self._stop is not None

    @property
    def directive(self) -> dict[str, Any] | None:
        """The rollback to carry out (checkpoint path and step, batch ids to skip, devices and
        nodes to avoid), once ``should_stop()``; cleared by ``resumed()``."""
        stop = self._stop
        return (
            None
            if stop is None
            else {"id": stop.id, "kind": stop.kind, "step": stop.act_at_step, **stop.payload}
        )

    def _boundary(self) -> None:
        """Once per window boundary, on every rank alike: local directives, then the agreement."""
        if self._boundary_attempt == self._attempt or self._stop is not None:
            return
        self._boundary_attempt = attempt = self._attempt
        self._next_boundary = attempt - attempt % self._agree_every + self._agree_every
        # After that assignment: a local directive the sender thread arms from here on either
        # shows here or sets ``_next_boundary`` to 0 after it (``_apply_directives``).
        local = self._armory.take_local()
        if self._armory.local:
            self._next_boundary = 0
        if local is not None:
            self._act(local)
        if attempt % self._agree_every:
            return
        agreed = self._consensus.exchange(self._armory.oldest_armed())
        directive = self._armory.known(agreed) if agreed else None
        if (
            directive is not None
            and directive.act_at_step is not None
            and self._step >= directive.act_at_step
        ):
            self._armory.handled(directive.id)
            self._act(directive)

    def _act(self, directive: Directive) -> None:
        if directive.kind == "canary":
            self._run_canary(directive)
        elif directive.kind == "rollback":
            self._stop = directive
            self._ack(directive, "done", self._step, {"stopped_at_attempt": self._attempt})
        else:
            self._ack(
                directive, "failed", self._step, {"reason": f"unknown directive kind {directive.kind!r}"}
            )

    def _run_canary(self, directive: Directive | None) -> None:
        """The canary suite on this rank's device (a sync, at a boundary, on purpose)."""
        from collectors.canary import CanaryConfig, run_canary, stack_key

        if self._canary_stack is None:
            from collectors.canary import describe_stack

            self._canary_stack = describe_stack(self._device)
        golden_by_stack = (directive.payload.get("golden") or {}) if directive is not None else {}
        golden = golden_by_stack.get(stack_key(self._canary_stack))
        try:
            outcome = run_canary(
                self._device, CanaryConfig(), golden, self._canary_faults, self._canary_stack
            )
        except Exception as exc:  # the suite must never take training down
            self.faults.record("canary")
            if directive is not None:
                self._ack(directive, "failed", self._step, {"reason": f"{type(exc).__name__}: {exc}"})
            return
        record = {
            "kind": "canary_result",
            "incarnation": self.incarnation,
            "rank": self.identity.rank,
            "step": self._step,
            "time": self._clock(),
            "node": self.identity.node,
            "directive_id": directive.id if directive is not None else None,
            **outcome.as_wire(),
        }
        if self.identity.device_uuid is not None:
            record["device_uuid"] = self.identity.device_uuid
        self._sender.submit(to_wire(record))
        if directive is not None:
            self._ack(directive, "done", self._step, {"missed_golden": list(outcome.missed)})

    def _ack(
        self, directive: Directive, status: str, step: int, detail: Mapping[str, Any] | None = None
    ) -> None:
        self._sender.submit(
            {
                "kind": "directive_ack",
                "directive_id": directive.id,
                "incarnation": self.incarnation,
                "rank": self.identity.rank,
                "time": self._clock(),
                "status": status,
                "step": step,
                "detail": to_wire(dict(detail or {})),
            }
        )

    def _on_sender_cycle(self) -> None:
        """Each sender cycle, before its batches: windows whose values arrived join the queue,
        and directives are asked for when due, unless the last cycle's batch brought them."""
        self._phases.resync()
        self._drain_ready()
        answered, self._answered_with_post = self._answered_with_post, False
        now = time.monotonic()
        if now >= self._next_poll and not answered:
            self._next_poll = now + self.config.directives.poll_interval_s
            self._poll_directives()
        service = self._destination.service if self._destination is not None else None
        if service is not None:
            service.revive()  # the node's embedded service, if it died

    def _ask_directives_with_posts(self) -> None:
        ask = getattr(self._sender.transport, "ask_directives_with_posts", None)
        if ask is not None:
            ask(self.incarnation, self.identity.rank)

    def _on_posted_directives(self, items: list[dict[str, Any]]) -> None:
        """A batch's answer carried this rank's pending directives: as good as a poll, and the
        next cycle's own poll is spared (the sender thread sets and reads the flag)."""
        self._answered_with_post = True
        self._apply_directives(items)

    @guarded
    def _poll_directives(self) -> None:
        fetch = getattr(self._sender.transport, "directives", None)
        if fetch is None or not self._active:
            return
        items = fetch(self.incarnation, self.identity.rank)
        if items is not None:
            self._apply_directives(items)

    @guarded
    def _apply_directives(self, items: list[dict[str, Any]]) -> None:
        if not self._active:
            return
        pending = [Directive.from_wire(item) for item in items]
        for directive in pending:
            if directive.kind == IMMEDIATE and self._armory.first_time(directive.id):
                self._answer_dump(directive)
        self._armory.update(pending, self._step, self._ack)
        if self._armory.local:  # acted on at the next window's start (``_boundary``)
            self._next_boundary = 0

    def _answer_dump(self, directive: Directive) -> None:
        """All thread stacks, taken here on the sender thread: it works while training is stuck."""
        dump = dump_stacks(nccl_trace=self.config.hook.nccl_trace)
        self._sender.submit(
            {
                "kind": "stack_dump",
                "incarnation": self.incarnation,
                "rank": self.identity.rank,
                "time": dump.time,
                "stacks": dump.threads[:4_000_000],
                "directive_id": directive.id,
                "flight_recorder": dump.flight_recorder,
            }
        )
        self._ack(directive, "done", self._step, {"note": dump.note} if dump.note else None)

    def _new_incarnation(self) -> None:
        """A restore inside this process: every rank calls ``resumed`` at the same boundary, so
        rank 0's new incarnation id reaches all in one broadcast, as at attach."""
        with self._lock:
            self._emit(self._ring.drain())
        self.incarnation = str(self._collectives.broadcast(str(uuid.uuid4())))
        self._ask_directives_with_posts()
        self._attempt = self._next_boundary = 0
        self._boundary_attempt = -1
        context = self._render_context
        self._render_context = RenderContext(
            self.identity.record_fields(self.incarnation),
            context.counting,
            context.max_sample_ids,
            context.phases,
        )
        if self.identity.rank == 0:
            self._sender.submit(self._run_start())

    # Records of the run.

    def _heartbeat(self) -> Record | None:
        """Built on the sender thread, on its own clock, from state the training thread
        publishes with single reference assignments."""
        state = self._phases.state
        return {
            "kind": "heartbeat",
            "incarnation": self.incarnation,
            "rank": self.identity.rank,
            "node": self.identity.node,
            "phase": state.phase.value,
            "phase_since": self._phases.epoch(state.since),
            "time": self._clock(),
            "step": self.progress["step"],
            "attempt": self._attempt,
        }

    def _run_start(self) -> Record:
        identity = self.identity
        return {
            "kind": "run_start",
            "incarnation": self.incarnation,
            "time": self._clock(),
            "world_size": identity.world_size,
            "layout": identity.layout.sizes(),
            # The service places directive steps from how often this hook polls and agrees.
            "config": to_wire(
                {
                    **self._run_config,
                    "runhealth_hook": {
                        "directive_poll_s": self.config.directives.poll_interval_s,
                        "agree_every": self.config.hook.agree_every,
                        "heartbeat_s": self.config.sender.heartbeat_interval_s,
                        "flush_s": self.config.sender.flush_interval_s,
                    },
                }
            ),
        }

    def _note_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning("runhealth: %s", message)
