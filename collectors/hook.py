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

This module wires the hook's parts and runs its lifecycle (attach, close, exit):

- ``accounting.py``: the window accounting, the hot path (``window_start`` ... ``window_end``,
  the optimizer's step hooks), with the three counters (attempt, step, consumed);
- ``checkpoint_events.py``: checkpoint and resume events;
- ``agent.py``: the directive agent (boundaries, rollback stops, canaries, acks, stack dumps);
- ``records.py``: every record the hook makes, through the record protocol
  (``policies.protocol``; step records are rendered by ``window.py``);
- the transport: the sender thread (``sender.py``, with its spool) to the service, embedded or
  configured (``attach.py``), and the outbox for records handed over before attach;
- the device and link readers (``readers.py``: NVML, InfiniBand/RoCE), on their own threads.

No host-device synchronization on the hot path (``accounting.py`` says where each value is
read). Every public method catches its own exceptions (``guard.py``): the training loop never
sees one.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar

from collectors import attach, records
from collectors.accounting import WindowAccounting
from collectors.agent import DirectiveAgent
from collectors.checkpoint_events import CheckpointEvents
from collectors.collectives import collectives_for
from collectors.compiles import CompileWatch
from collectors.config import RunHealthConfig
from collectors.counters import Counters
from collectors.cpu_use import CompileActivity
from collectors.directives import Consensus
from collectors.guard import EntryErrors, guarded
from collectors.layout import Identity, discover_identity, resolve_device
from collectors.markers import marker_factory
from collectors.outbox import Outbox
from collectors.phases import Phase, PhaseClock, stamps_for
from collectors.readers import Readers, build_readers
from collectors.rendezvous import Rendezvous
from collectors.ring import PinnedRing
from collectors.samplers import Sampler
from collectors.sender import Sender, Transport
from collectors.stacks import StackDump, dump_stacks
from collectors.window import Counting, PendingWindow
from collectors.wire import Record
from collectors.wrappers import inner_scheduler
from policies.batch_size import declaration
from policies.protocol import to_wire

log = logging.getLogger("runhealth.collectors")

Batch = TypeVar("Batch")


class RunHealth:
    """One per rank. Construct (cheap, no side effects), ``start()`` (attach), train, ``close()``.

    ``model``: device and resume evidence; with accumulation, a forward pre-hook on it marks
    each microbatch's forward. ``optimizer`` (one or several): step hooks count real updates and
    read the learning rate used. ``scaler``: a GradScaler whose scale is recorded without a
    sync. ``scheduler``: read only at resume. ``mesh`` or ``groups``
    (``{"dp": pg, "tp": pg, ...}``): the parallel layout; plain data parallelism otherwise.
    ``samplers``: built with ``submit`` as their sink, started at attach (``samplers.py``); the
    device and link readers are started there too, each off with ``config.readers``
    (``RUNHEALTH_READERS__NVML=0``, ``RUNHEALTH_READERS__LINKS=0``), and ``rh.readers`` says
    what they do.
    ``transport``: where batches go instead of the HTTP service (tests, custom sinks).
    ``environ``: the environment, read once here (``os.environ`` when omitted). Objects
    created later: ``watch(...)``.

    The window's methods (``window_start``, ``loss``, ``grad_norm``, ``window_end``,
    ``optimizer_step_observed``) are the window accounting's own (``accounting.py``), as are
    ``checkpoint_saved`` and ``resumed`` the checkpoint events' (``checkpoint_events.py``): the
    hook hands them out bound, so a call from the training loop adds no frame of the hook's.
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
        self.config = RunHealthConfig.from_environ(self._environ, explicit=config)  # merged: config.py
        self._counters = Counters()
        self.faults = EntryErrors(self._counters)
        self._clock = clock
        self._hostname = hostname
        self._layout_args = (mesh, groups, device)
        self._run_config = dict(run_config or {})
        self._samplers = list(samplers)
        self._readers: Readers | None = None
        self._compiles: CompileWatch | None = None
        self._reader_state: dict[str, str] = {}
        self._transport = transport
        self._started = self._closed = False
        self._destination: attach.Destination | None = None
        hook = self.config.hook
        counting = Counting(hook.shift_labels, hook.ignore_index)
        self._windows = windows = WindowAccounting(
            self._counters,
            self.faults,
            counting,
            hook.max_sample_ids,
            self.start,
            skip_nonfinite=hook.nonfinite_response == "skip_update",
        )
        self._agent = DirectiveAgent(self.config, windows, self.faults, clock, canary_faults)
        self._outbox = Outbox(self.config.sender.queue_records)
        self._events = events = CheckpointEvents(
            self.config, windows, self._agent, self._outbox, self.faults, clock, self._new_incarnation
        )
        windows.agent, windows.events = self._agent, events
        # The step path and the events, bound: see the class docstring.
        self.window_start = windows.window_start
        self.loss = windows.loss
        self.grad_norm = windows.grad_norm
        self.window_end = windows.window_end
        self.optimizer_step_observed = windows.optimizer_step_observed
        self.checkpoint_saving = events.checkpoint_saving
        self.checkpoint_staged = events.checkpoint_staged
        self.checkpoint_failed = events.checkpoint_failed
        self.checkpoint_saved = events.checkpoint_saved
        self.resumed = events.resumed
        self.watch(model=model, optimizer=optimizer, scaler=scaler, scheduler=scheduler)

    # Attaching and closing.

    def start(self) -> RunHealth:
        """Attach: learn who this rank is, agree on the incarnation, start sending. Every rank
        must call it (it runs attach-time collectives). Idempotent; returns ``self``."""
        if not self._started:
            self._started = True
            try:
                self._attach()
                self._windows.active = True
            except Exception:
                self.faults.record("start")
                log.error("runhealth: attach failed; the hook stays off for this process")
            else:
                self._after_attach()
        return self

    def _attach(self) -> None:
        torch = importlib.import_module("torch")
        mesh, groups, device = self._layout_args
        self._device = resolve_device(device, self._windows.model)
        self.identity: Identity = discover_identity(
            torch, self._environ, device=self._device, mesh=mesh, groups=groups, hostname=self._hostname
        )
        self._collectives = collectives_for(torch)
        ids = attach.agree_on_run(self._collectives, self.config.transport.run, self._environ)
        self.run = ids.run
        if ids.by_start_time and self.identity.rank == 0:
            self._events.run_named_at_start = ids.run  # a resume says what that costs, once
        rendezvous = Rendezvous.of_job(torch, ids.incarnation)
        if self.config.transport.url or self._transport is not None:
            self._destination = attach.configured(self.config)
        else:
            self._destination = attach.embedded(
                self.config, self.identity, ids.run, self._collectives, self._environ, rendezvous
            )
        if self._transport is None:
            self._destination = attach.node_relay(
                self.config,
                self.identity,
                ids.run,
                self._destination,
                self._environ,
                rendezvous,
                self._counters,
                self._hostname(),
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
            directives=self._agent.on_posted,
        )
        origin = records.Origin.of(self.identity, ids.incarnation)
        self._agent.attached(self._sender, Consensus.create(torch, self._device), self._device, origin)
        device_type = self._device.type
        ring = PinnedRing[PendingWindow](
            self.config.ring, device=self._device, new_marker=marker_factory(device_type)
        )
        stamps = stamps_for(device_type, self.identity.world_size)
        phases = PhaseClock(stamps, self.config.hook.max_phase_marks, self._clock)
        fields = records.step_identity(self.identity, ids.incarnation)
        dp_size = self.identity.layout.dp.size
        self._windows.attached(torch, self._device, self._sender, ring, phases, fields, dp_size)
        self._compiles = CompileWatch(phases)
        self._compile_activity = CompileActivity()

    def _after_attach(self) -> None:
        self._sender.start()
        self._pid = os.getpid()
        atexit.register(self._close_at_exit)
        if self.identity.rank == 0:
            self._sender.submit(self._run_start())
        self._outbox.open(self._sender, self._agent.origin)  # what came before attach, in order
        self._add_readers()
        for sampler in self._samplers:
            self._start_sampler(sampler)
        self._describe_readers()
        if self._compiles is not None:
            self._compiles.install_if_loaded()

    def close(self, status: Literal["completed", "failed", "stopped"] = "completed") -> None:
        """Record what is left, flush (bounded), stop samplers and the embedded service."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        if self._windows.active:
            self._close(status)
        self._windows.active = False
        self._outbox.close()

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
        windows = self._windows
        windows.flush()
        windows.drain()  # waiting for the device here is fine: training is over
        self._events.flush_resume()
        self._events.finish_manifests()  # the last checkpoints' records, before the sender stops
        windows.phases.enter(Phase.CLOSED)
        if self.identity.rank == 0:
            self._sender.submit(records.run_finish(self.incarnation, self._clock(), status))
        for sampler in self._samplers:
            self._stop_sampler(sampler)
        for handle in windows.handles:
            handle.remove()
        if self._compiles is not None:
            self._compiles.remove()
        self._agent.close()
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
        """Say this rank is done; the rank running the job's service stops it once every rank
        is done. After a failure it does not wait for them: peers of a failed rank are
        usually blocked in a collective until the launcher ends them, and this process's exit
        is what tells the launcher. What they send after the stop is spooled and replayed by
        the next start."""
        destination = self._destination
        if destination is None:
            return
        if destination.relay is not None:  # this rank's own records went through it already
            # The node's other ranks may still be sending their last batches through it.
            destination.relay.stop(wait_for_ranks_s=self.config.relay.close_wait_s if wait_for_peers else 0.0)
        rendezvous = destination.rendezvous
        if rendezvous is not None:
            rendezvous.done()
        if destination.service is not None:
            finished = None
            if wait_for_peers and rendezvous is not None:
                finished = functools.partial(rendezvous.finished, destination.ranks)
            destination.service.stop(finished)

    def __enter__(self) -> RunHealth:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close("failed" if exc_type is not None else "completed")

    def _new_incarnation(self) -> None:
        """A restore inside this process: every rank calls ``resumed`` at the same boundary, so
        rank 0's new incarnation id reaches all in one broadcast, as at attach."""
        self._windows.flush()  # a window held for accumulation belongs to the old timeline
        self._windows.drain()
        incarnation = str(self._collectives.broadcast(str(uuid.uuid4())))
        origin = records.Origin.of(self.identity, incarnation)
        self._outbox.origin = origin
        self._agent.restart(origin)
        self._windows.restart(records.step_identity(self.identity, incarnation))
        if self.identity.rank == 0:
            self._sender.submit(self._run_start())

    @guarded
    def declare_batch(
        self,
        *,
        micro_batch: int | None = None,
        accumulation: int | None = None,
        schedule_unit: Literal["updates", "examples", "tokens"] | None = None,
    ) -> None:
        """What this start's batch is, for the service's batch arithmetic on resume
        (``policies.batch_size``): sequences per replica's microbatch, microbatches per update,
        and what the scheduler's milestones are counted in (``examples`` or ``tokens``: remapped
        to a data budget, so a resume that changes the global batch leaves them in place). Sent
        with rank 0's run-start record: call it before ``start()`` (the framework adapters fill
        in what their framework knows: a field declared already is kept)."""
        declared = self._run_config.get("batch")
        given = declaration(micro_batch=micro_batch, accumulation=accumulation, schedule_unit=schedule_unit)
        self._run_config["batch"] = {**given, **(declared if isinstance(declared, dict) else {})}

    # Late wiring (framework adapters create the optimizer after the callback).

    @guarded
    def watch(
        self, *, model: Any = None, optimizer: Any = None, scaler: Any = None, scheduler: Any = None
    ) -> None:
        self._windows.watch(model=model, optimizer=optimizer, scaler=scaler)
        # A wrapper's inner scheduler (accelerate's ``AcceleratedScheduler``): ``wrappers.py``.
        self._events.scheduler = (
            inner_scheduler(scheduler) if scheduler is not None else self._events.scheduler
        )

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
        windows = self._windows
        iterator = iter(batches)
        while True:
            if self.should_stop():
                return  # before fetching: the next batch stays for after the rollback
            for index in range(max(1, microbatches)):
                if index:
                    windows.enter(Phase.DATA)
                waited = time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    if index:
                        windows.window_end()
                    return
                windows.microbatch_arrived(index, time.perf_counter() - waited, sample_ids, batch)
                yield batch
            windows.window_end()

    # Directives: polled on the sender thread, acted on at window boundaries (``agent.py``).

    @guarded
    def should_stop(self) -> bool:
        """True once a rollback directive stopped this rank at a window boundary (every rank
        stops at the same one). ``windows()`` checks it itself; a hand-written loop calls it
        before fetching each batch. The directive is then in ``rh.directive``."""
        windows = self._windows
        if windows.active:
            self._agent.boundary()
        stopping = self._agent.stop is not None
        if stopping and windows.carried is not None:
            windows.flush()  # recorded before the rollback's restore, in this timeline
        return stopping

    @property
    def directive(self) -> dict[str, Any] | None:
        """The rollback to carry out (checkpoint path and step, batch ids to skip, devices and
        nodes to avoid), once ``should_stop()``; cleared by ``resumed()``."""
        stop = self._agent.stop
        return (
            None
            if stop is None
            else {"id": stop.id, "kind": stop.kind, "step": stop.act_at_step, **stop.payload}
        )

    def _on_sender_cycle(self) -> None:
        """Each sender cycle, before its batches: windows whose values arrived join the queue,
        and directives are asked for when due."""
        self._windows.phases.resync()
        if self._compiles is not None:
            self._compiles.install_if_loaded()  # a model compiled after attach
        self._windows.drain_ready()
        self._agent.poll_if_due()
        service = self._destination.service if self._destination is not None else None
        if service is not None:
            service.revive()  # the node's embedded service, if it died

    # Samplers, hang evidence, counters.

    @guarded
    def submit(self, record: dict[str, Any]) -> None:
        """The sink samplers hand records to (any thread; never blocks)."""
        self._outbox.submit(to_wire(record))

    @guarded
    def add_sampler(self, sampler: Sampler) -> None:
        self._samplers.append(sampler)
        if self._windows.active:
            self._start_sampler(sampler)

    @guarded
    def _add_readers(self) -> None:
        """The device and link readers (``readers.py``), first among the samplers: started with
        them here and stopped with them at close."""
        self._readers = build_readers(
            self.config.readers, self.identity, self.submit, self._environ, self._clock
        )
        self._samplers[:0] = self._readers.samplers

    @guarded
    def _describe_readers(self) -> None:
        if self._readers is not None:
            self._reader_state = self._readers.describe()

    @property
    def readers(self) -> dict[str, str]:
        """What the device and link readers do, one line each (``{"nvml": ..., "links": ...}``):
        what they sample, or why they do nothing (off, no GPU, no NVML, no ports). Known once
        attached."""
        return dict(self._reader_state)

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
        return self._windows.progress

    @property
    def incarnation(self) -> str:
        """This run's incarnation id (a new one after a restore in this process); known once
        attached."""
        return self._agent.origin.incarnation

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

    # Records of the run (``records.py``).

    def _heartbeat(self) -> Record | None:
        """Built on the sender thread, on its own clock, from state the training thread
        publishes with single reference assignments."""
        phases = self._windows.phases
        state = phases.state
        now, since = self._clock(), phases.epoch(state.since)
        return records.heartbeat(
            self._agent.origin,
            now,
            state.phase.value,
            since,
            self.progress["step"],
            self._windows.attempt,
            self._compile_activity.busy_at(state.phase is Phase.COMPILING, since, now),
        )

    def _run_start(self) -> Record:
        return records.run_start(
            self.incarnation, self._clock(), self.identity, self._run_config, self.config
        )
