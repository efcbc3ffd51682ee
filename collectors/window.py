"""One accumulation window (one optimizer-step attempt): what the hook keeps, what it sends.

During the window the training thread only keeps references: each microbatch's loss, labels or
token count, the grad norm. At the window's end they are settled in one place. Device values
stay on the device (summed there when there are several microbatches) and reach the host
through the ring. Host values (numbers, CPU tensors, CPU labels still to be counted) are read
when the record is rendered, on the sender thread: reading a CPU tensor waits for no device,
and doing it there, in a batch, keeps the training thread's share small. On the reference CPU a
small tensor op costs 10-60 us right after a training step has evicted the caches, and about
5 us in the sender's batch.

The trainer must not modify a window's CPU labels or sample-id list in place after handing them
over: they are read within a flush interval of the window's end.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy

from collectors.phases import TIMED, Mark, Phase, durations, wall_durations
from collectors.tokens import supervised_tokens
from collectors.values import host_float, local_value, on_device
from collectors.wire import Draft, NotRendered, Record
from policies import protocol
from policies.protocol import float_to_wire

if TYPE_CHECKING:
    from collectors.phases import PhaseClock

Value = Any  # a tensor (device or CPU) or a host number
Microbatch = tuple[Any, Any, Any]  # (loss, labels, tokens) as the trainer gave them
# A CPU rank's window as handed over: its render context, step, consumed examples, skipped,
# end (``perf_counter`` seconds), phase marks (``PhaseClock.take_window``).
HandOver = tuple["RenderContext", int, int | None, bool | None, float, tuple[Sequence[Mark], bool]]
SCALARS = ("grad_norm", "loss_scale", "lr")


@dataclass(slots=True)
class Sums:
    """Host-side sums over microbatches, and whether each is known for the whole window."""

    loss_sum: float = 0.0
    tokens: float = 0.0
    loss_total: float = 0.0
    tokens_known: bool = True
    sum_known: bool = True

    def copy(self) -> Sums:
        return Sums(self.loss_sum, self.tokens, self.loss_total, self.tokens_known, self.sum_known)

    def add(self, loss: float, count: float | None, sum_reduction: bool) -> None:
        self.loss_total += loss
        if count is None:
            self.tokens_known = False
        else:
            self.tokens += count
        if sum_reduction:
            self.loss_sum += loss
        elif count is not None:
            self.loss_sum += loss * count
        else:
            self.sum_known = False


@dataclass(frozen=True, slots=True)
class Counting:
    """How labels are counted (``tokens.py``)."""

    shift: bool
    ignore_index: int

    def on_device(self, labels: Any) -> Any:
        """A device count (device ops, no sync)."""
        return supervised_tokens(labels, shift=self.shift, ignore_index=self.ignore_index)

    def count(self, labels: Any) -> float:
        """The count of CPU labels, with numpy where it can (1.5 us against 5 for the same torch
        ops, warm), since every window pays it."""
        try:
            array = labels.numpy()
        except (AttributeError, RuntimeError, TypeError):  # not a plain CPU tensor
            return float(self.on_device(labels).item())
        return float(numpy.count_nonzero(self.supervised(array, array.ndim)))

    def supervised(self, array: numpy.ndarray, label_dims: int) -> numpy.ndarray:
        """Which labels of a numpy array are targets (True), along its last axis: leading axes
        stay, so stacked labels of many windows are judged in one operation. ``label_dims``: the
        dimensions of one window's labels (1: one class per example, never shifted)."""
        targets = array[..., 1:] if self.shift and label_dims > 1 else array
        flags: numpy.ndarray = targets != self.ignore_index
        return flags


@dataclass(slots=True)
class WindowValues(Draft):
    """Filled by the training thread between ``window_start`` and ``window_end`` (references
    only); read, never written, after it.

    A CPU rank hands the window itself to the sender (``RunHealth.window_end``), with the
    ``handed`` facts set: rendered there as a ``PendingWindow`` of host values. Making that
    object on the sender rather than at the window's end spares the training thread an object
    of ten fields (a few microseconds right after a training step)."""

    attempt: int
    data_wait_s: float | None
    sample_ids: Any = None  # as given: a list, a CPU tensor or array; rendered later
    examples: int | None = None
    sum_reduction: bool = False
    microbatches: list[Microbatch] = field(default_factory=list)
    count: int = 0  # microbatches, folded ones included
    grad_norm: Value | None = None
    loss_scale: Value | None = None
    lr: Value | None = None
    updates: int = 0  # optimizer steps known on the host to have updated
    verdicts: list[Any] | None = None  # device found-inf flags of fused optimizers' steps
    # A GradScaler's per-optimizer state at the window's start: ``update()`` replaces it, so the
    # same object at the end means the scaler neither stepped nor updated in this window.
    scaler_round: Any = None
    stepped: bool = False  # an optimizer's step ran (its pre-hook fired), whatever it updated
    # Windows merged into this one: a loop that opens a window per microbatch and updates every
    # K-th (``accumulation.py``); ``held`` is the gradient it accumulates into while it waits.
    parts: int = 1
    held: tuple[Any, Any] | None = None
    handed: HandOver | None = None

    def render(self) -> Record:
        handed = self.handed
        if handed is None:
            raise ValueError("a window is rendered only once handed over (RunHealth.window_end)")
        context, step, consumed, skipped, end, marks = handed
        return PendingWindow(
            context, self, None, self.microbatches, step, consumed, skipped, end, (), marks
        ).render()

    def identify(self) -> Record:
        handed = self.handed
        if handed is None:
            return {"kind": "step", "attempt": self.attempt}
        return {"kind": "step", **handed[0].identity, "attempt": self.attempt, "step": handed[1]}

    def local_examples(self, rows: int) -> int | None:
        """This rank's examples: as given, else the sample ids, else the label rows."""
        if self.examples is not None:
            return self.examples
        if self.sample_ids is not None:
            return len(self.sample_ids)
        return rows or None

    def counts_rows(self) -> bool:
        """Label rows are the example count only when neither examples nor ids were given."""
        return self.examples is None and self.sample_ids is None

    def scalars_on_host(self) -> bool:
        """No device scalar (grad norm, loss scale, lr) and no device found-inf flag."""
        return (
            getattr(self.grad_norm, "is_cpu", True)
            and getattr(self.loss_scale, "is_cpu", True)
            and getattr(self.lr, "is_cpu", True)
            and not self.verdicts
        )


@dataclass(slots=True)
class Totals:
    """A window's settled microbatches: device parts on the device, host parts for the sender."""

    device_loss_sums: list[Any] = field(default_factory=list)
    device_tokens: list[Any] = field(default_factory=list)
    device_losses: list[Any] = field(default_factory=list)
    host: list[Microbatch] = field(default_factory=list)  # losses detached, read when rendered
    folded: Sums = field(default_factory=Sums)  # host parts already read; device known-flags
    rows: int = 0  # label rows: the example count when none was given

    def settle(
        self, microbatches: Sequence[Microbatch], sum_reduction: bool, counting: Counting, count_rows: bool
    ) -> None:
        """Take microbatches as given: detach, count device labels on the device, keep the rest.
        Label rows are counted only when they are the example count (``count_rows``)."""
        for loss, labels, tokens in microbatches:
            if labels is not None and count_rows:
                self.rows += int(labels.shape[0])  # a host shape: no sync
            loss = loss.detach() if getattr(loss, "requires_grad", False) else loss
            if on_device(loss) or on_device(tokens) or on_device(labels):
                self._device(loss, labels, tokens, sum_reduction, counting)
            else:
                self.host.append((loss, labels if tokens is None else None, tokens))

    def _device(self, loss: Any, labels: Any, tokens: Any, sum_reduction: bool, counting: Counting) -> None:
        """A microbatch with something on the device: sums stay there (device ops, no sync)."""
        loss, tokens = local_value(loss), local_value(tokens)
        if hasattr(loss, "element_size") and loss.is_floating_point() and loss.element_size() < 4:
            # A half-precision loss (a model in fp16 or bf16, no autocast) summed in its own type
            # overflows or rounds: an fp16 loss of 10 over 8,192 tokens is inf, and bf16 keeps 3
            # digits. One cast on the device; an fp32 loss, the usual one, is used as it is.
            loss = loss.float()
        count = tokens
        if count is None and labels is not None:
            # Device labels are counted there; CPU labels beside a device loss are counted now,
            # on the host (it waits for no device), since the loss sum needs the count.
            count = counting.on_device(labels) if on_device(labels) else counting.count(labels)
        if on_device(loss):
            count = moved_to(count, loss.device)
        self._add(self.device_losses, "loss_total", loss)
        if count is None:
            self.folded.tokens_known = False
        else:
            self._add(self.device_tokens, "tokens", count)
        if sum_reduction:
            self._add(self.device_loss_sums, "loss_sum", loss)
        elif count is not None:
            self._add(self.device_loss_sums, "loss_sum", loss * count)  # on the device if either is
        else:
            self.folded.sum_known = False

    def _add(self, device_parts: list[Any], name: str, value: Any) -> None:
        """A device part joins the device sums; a host part (a number, a CPU tensor: reading it
        waits for no device) is added to the host sums at once."""
        if on_device(value):
            device_parts.append(value)
        else:
            setattr(self.folded, name, getattr(self.folded, name) + host_float(value))

    def fold(self, torch: Any, sum_reduction: bool, counting: Counting) -> None:
        """Bound the lists of a window with very many microbatches: device parts are summed on
        the device, host parts on the host (a rare, one-off cost on the training thread)."""
        self.device_loss_sums = [total(self.device_loss_sums, torch)] if self.device_loss_sums else []
        self.device_tokens = [total(self.device_tokens, torch)] if self.device_tokens else []
        self.device_losses = [total(self.device_losses, torch)] if self.device_losses else []
        for microbatch in self.host:
            add_host(self.folded, microbatch, sum_reduction, counting)
        self.host = []

    def device_values(
        self, window: WindowValues, torch: Any, device: Any
    ) -> tuple[tuple[str, ...], list[Any]]:
        """The device tensors for the ring, one per quantity (0-dim), and their names, each on
        ``device`` (the ring's: its copies are ordered on that device's stream)."""
        values: dict[str, Any] = {}
        for name, parts in (
            ("loss_sum", self.device_loss_sums),
            ("tokens", self.device_tokens),
            ("loss_total", self.device_losses),
        ):
            if parts:
                values[name] = total(parts, torch)
        for name in SCALARS:
            value = getattr(window, name)
            if on_device(value):
                values[name] = value if value.dim() == 0 else value.reshape(())
        if window.verdicts:
            values["found_inf"] = total(window.verdicts, torch)
        return tuple(values), [moved_to(value, device) for value in values.values()]


def settle_on_host(microbatches: Sequence[Microbatch]) -> list[Microbatch] | None:
    """The common case, settled without a ``Totals``: every microbatch on the host. Losses are
    detached (holding a loss until it is rendered must not hold its autograd graph); labels
    beside a token count are dropped, as ``Totals.settle`` does. None when anything is on a
    device: ``Totals.settle`` sums those on the device."""
    host = []
    for loss, labels, tokens in microbatches:
        if not (
            getattr(loss, "is_cpu", True)
            and getattr(labels, "is_cpu", True)
            and getattr(tokens, "is_cpu", True)
        ):
            return None
        if getattr(loss, "requires_grad", False):
            loss = loss.detach()
        host.append((loss, labels if tokens is None else None, tokens))
    return host


def prepare_batch(drafts: Sequence[Draft]) -> None:
    """Before a batch's windows are rendered one by one (the sender thread), what each would do
    with torch or numpy calls of its own is done for the whole batch at once: counting CPU
    labels (four numpy calls a window, 6-7 us of the sender's CPU each on the reference CPU)
    and reading CPU scalar tensors (an ``item()`` a value, each letting the training thread
    take the GIL in the middle). Together: 28 -> 22-25 us of sender CPU per step.

    Plain ``torch.Tensor`` values are grouped by shape and dtype; a group that torch or numpy
    refuses as a whole (a device tensor, one that needs grad) is left to be read one by one
    when rendered, as is anything else (a DTensor, whose reads may start a collective)."""
    torch = sys.modules.get("torch")
    if torch is None:  # no tensor can be in a window then
        return
    count_labels(drafts, torch)
    read_scalars(drafts, torch)


def count_labels(drafts: Sequence[Draft], torch: Any) -> None:
    """Each counted microbatch gets its count as its token count (how ``add_host`` uses it)."""
    tensor = torch.Tensor
    groups: dict[tuple[Counting, Any, Any], list[tuple[list[Microbatch], int, Any]]] = {}
    for draft in drafts:
        if type(draft) is WindowValues and draft.handed is not None:
            microbatches, counting = draft.microbatches, draft.handed[0].counting
        elif type(draft) is PendingWindow and draft.totals is None:
            microbatches, counting = draft.host, draft.context.counting
        else:
            continue
        for index, (_, labels, tokens) in enumerate(microbatches):
            if tokens is None and type(labels) is tensor:
                key = (counting, labels.shape, labels.dtype)
                groups.setdefault(key, []).append((microbatches, index, labels))
    for (counting, shape, _), members in groups.items():
        if counting.shift and not shape:
            continue  # a scalar has nothing to shift: ``Counting.count`` says what is wrong
        try:
            stacked = torch.stack([labels for _, _, labels in members]).numpy()
        except (RuntimeError, TypeError):  # on a device, or needs grad
            continue
        flags = counting.supervised(stacked, len(shape)).reshape(len(members), -1)
        counts = numpy.count_nonzero(flags, axis=1).tolist()
        for (microbatches, index, _), count in zip(members, counts, strict=True):
            loss, _, _ = microbatches[index]
            microbatches[index] = (loss, None, float(count))


def read_scalars(drafts: Sequence[Draft], torch: Any) -> None:
    """A handed-over window's CPU scalar tensors (grad norm, loss scale, rate) become floats,
    one ``tolist()`` per dtype for the whole batch."""
    tensor = torch.Tensor
    groups: dict[tuple[Any, Any], list[tuple[WindowValues, str, Any]]] = {}
    for draft in drafts:
        if type(draft) is not WindowValues or draft.handed is None:
            continue
        for name in SCALARS:
            value = getattr(draft, name)
            if type(value) is tensor:
                groups.setdefault((value.shape, value.dtype), []).append((draft, name, value))
    for (shape, _), members in groups.items():
        if shape:
            continue  # not 0-dim: read one by one when rendered
        try:
            stacked = torch.stack([value for _, _, value in members])
        except (RuntimeError, TypeError):
            continue
        if not stacked.is_cpu:
            continue
        for (draft, name, _), value in zip(members, stacked.detach().tolist(), strict=True):
            setattr(draft, name, float(value))


def label_rows(microbatches: Sequence[Microbatch]) -> int:
    """Label rows (host shapes: no sync), the example count when none was given."""
    return sum(int(labels.shape[0]) for _, labels, _ in microbatches if labels is not None)


class PendingWindow(Draft):
    """A finished window: waiting for its device values in the ring (``device_values`` is set
    when they arrive), then rendered into a record on the sender thread. One object per window
    carries everything: on the training thread each object made costs microseconds."""

    __slots__ = (
        "consumed",
        "context",
        "device_names",
        "device_values",
        "host",
        "marks",
        "skipped",
        "step",
        "time",
        "totals",
        "values",
    )

    def __init__(
        self,
        context: RenderContext,
        values: WindowValues,
        totals: Totals | None,
        host: list[Microbatch],
        step: int,
        consumed: int | None,
        skipped: bool | None,
        time: float,
        device_names: tuple[str, ...],
        marks: tuple[Sequence[Mark], bool],
    ) -> None:
        self.context = context
        self.values = values
        self.totals = totals  # None when nothing was on a device or folded (the common case)
        self.host = host  # host microbatches not in ``totals``, losses detached
        self.step = step
        self.consumed = consumed
        self.skipped = skipped
        self.time = time  # when the window ended, ``perf_counter`` seconds
        self.device_names = device_names  # what each value in the ring slot is
        self.device_values: list[float] = []
        self.marks = marks

    def render(self) -> Record:
        phases = self.context.phases
        marks, complete = self.marks
        try:
            record = self._record(self._values(), durations(marks, complete, phases.stamps))
            if phases.wall_apart:
                add_phase_times(record, wall_durations(marks, complete), WALL_FIELDS)
            return record
        finally:
            phases.release(marks)

    def identify(self) -> Record:
        return {"kind": "step", **self.context.identity, "attempt": self.values.attempt, "step": self.step}

    def _values(self) -> dict[str, float | None]:
        window, totals = self.values, self.totals
        sums = totals.folded.copy() if totals is not None else Sums()
        counting = self.context.counting
        for microbatch in self.host if totals is None else [*totals.host, *self.host]:
            add_host(sums, microbatch, window.sum_reduction, counting)
        device = dict(zip(self.device_names, self.device_values, strict=True)) if self.device_names else {}
        has_loss = window.count > 0
        values: dict[str, float | None] = {
            "tokens": sums.tokens + device.get("tokens", 0.0) if has_loss and sums.tokens_known else None,
            "loss_sum": sums.loss_sum + device.get("loss_sum", 0.0) if has_loss and sums.sum_known else None,
            "loss_total": sums.loss_total + device.get("loss_total", 0.0) if has_loss else None,
        }
        for name in SCALARS:
            value = getattr(window, name)
            values[name] = device[name] if name in device else None if value is None else host_float(value)
        return values

    def _verdict(self) -> tuple[int, bool | None]:
        """The step number and skip flag, once a device-only verdict is known."""
        skipped, skips = self.skipped, self.context.device_skips
        if self.device_names and "found_inf" in self.device_names:
            found_inf = self.device_values[self.device_names.index("found_inf")]
            skipped = found_inf > 0 and self.values.updates == 0
            skips.count += int(skipped)
        return self.step - skips.count, skipped

    def _record(self, values: dict[str, float | None], spent: dict[Phase, float] | None) -> Record:
        """The step record (``policies.protocol.STEP``), written here field by field rather
        than through ``protocol.build``: the sender renders every window of the run, and the
        generic checks cost about 60 us a record (25 fields, 32 sample ids), twice the whole
        render. The identity is checked once, at attach (``records.step_identity``); the tests
        validate rendered records against the protocol."""
        window = self.values
        step, skipped = self._verdict()
        record: Record = {
            "kind": "step",
            **self.context.identity,
            "attempt": window.attempt,
            "step": step,
            "time": self.context.phases.epoch(self.time),
            "microbatches": window.count,
        }
        tokens = values["tokens"]
        optional: tuple[tuple[str, Any], ...] = (
            ("skipped", skipped),
            ("consumed", self.consumed),
            ("sample_ids", render_ids(window.sample_ids, self.context.max_sample_ids)),
            ("tokens", int(tokens) if tokens is not None else None),
            ("loss_sum", values["loss_sum"]),
            ("reported_loss", reported_loss(values, window)),
            ("grad_norm", values["grad_norm"]),
            ("lr", values["lr"]),
            ("loss_scale", values["loss_scale"]),
            ("data_wait_s", window.data_wait_s),
        )
        for name, value in optional:
            if value is not None:
                # ``x - x == 0`` holds for exactly the finite floats: most values pass here
                # without a call (the sender renders every window of the run).
                record[name] = (
                    value if type(value) is not float or value - value == 0 else float_to_wire(value)
                )
        add_phase_times(record, spent, PHASE_FIELDS)
        return record


class UnfinishedWindow(Draft):
    """A window counted as an attempt whose record could not be made on the training thread (an
    exception in ``window_start`` or ``window_end``, counted there): the sender dead-letters
    what names it, with the error, since it has no record to render."""

    __slots__ = ("error", "record")

    def __init__(self, identity: dict[str, Any], attempt: int, where: str, error: Exception) -> None:
        self.record: Record = {"kind": "step", **identity, "attempt": attempt}
        self.error = f"{where} failed: {type(error).__name__}: {error}"

    def identify(self) -> Record:
        return self.record

    def render(self) -> Record:
        raise NotRendered(self.error)


def add_phase_times(record: Record, spent: dict[Phase, float] | None, fields: dict[Phase, str]) -> None:
    for phase, seconds in (spent or {}).items():
        record[fields[phase]] = seconds if seconds - seconds == 0 else float_to_wire(seconds)


# Record fields of the phase timings (an enum's ``.value`` is a Python-level lookup), and of
# their wall times where the phases are thread CPU time (``PhaseClock.wall_apart``).
PHASE_FIELDS = {phase: f"{phase.value}_s" for phase in Phase}
WALL_FIELDS = {phase: f"{phase.value}_wall_s" for phase in Phase}
# A timed phase the protocol has no field for fails here, at import, not as a refused batch.
protocol.require(protocol.STEP, *(fields[phase] for phase in TIMED for fields in (PHASE_FIELDS, WALL_FIELDS)))


def moved_to(value: Any, device: Any) -> Any:
    """A device tensor on another device moved to ``device`` (an async device-to-device copy, no
    sync); anything else as it is. One process can train over several accelerators (a model
    split across them, ``device_map="auto"``): the loss is on the last, the labels on the first,
    the grad norm where ``clip_grad_norm_`` put it, and one op or one stack over two devices
    fails."""
    if on_device(value) and value.device != device:
        return value.to(device, non_blocking=True)
    return value


def total(items: Sequence[Value], torch: Any) -> Value:
    """The sum of same-place values: device ops only when there are several tensors."""
    if len(items) == 1:
        return items[0]
    if not hasattr(items[0], "device"):
        return float(sum(items))
    return torch.stack([item if hasattr(item, "device") else torch.tensor(item) for item in items]).sum()


def add_host(sums: Sums, microbatch: Microbatch, sum_reduction: bool, counting: Counting) -> None:
    loss, labels, tokens = microbatch
    count = None
    if tokens is not None:
        count = host_float(tokens)
    elif labels is not None:
        count = counting.count(labels)
    sums.add(host_float(loss), count, sum_reduction)


@dataclass
class DeviceSkips:
    """Skips only the device knew about (a fused optimizer's found-inf flag), counted as they
    are rendered, in window order. The training thread counted those windows as updates; every
    later step number is corrected by this count. Written by the sender thread only."""

    count: int = 0


@dataclass(frozen=True)
class RenderContext:
    """What every step record of this rank shares; made once, at attach."""

    identity: dict[str, Any]
    counting: Counting
    max_sample_ids: int
    phases: PhaseClock
    device_skips: DeviceSkips = field(default_factory=DeviceSkips)


def reported_loss(values: dict[str, float | None], window: WindowValues) -> float | None:
    """The loss as the trainer reports it: the mean of its per-microbatch losses (mean
    reduction), or the window's loss sum over its tokens (sum reduction)."""
    if window.sum_reduction:
        loss_sum, tokens = values["loss_sum"], values["tokens"]
        return loss_sum / tokens if loss_sum is not None and tokens else None
    loss_total = values["loss_total"]
    return loss_total / window.count if loss_total is not None else None


# Integer sample ids travel as 64-bit JSON integers; a wider one (a 128-bit hash) as its
# decimal string, which the service takes as an id like any other: it once failed the
# window's encoding, and the window was lost with nothing on disk to say so.
ID_MIN, ID_MAX = -(2**63), 2**63 - 1


def render_ids(ids: Any, limit: int) -> list[int | str] | None:
    """Sample ids as the service takes them: ints or strings, at most ``limit``."""
    if ids is None:
        return None
    listed = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return [_render_id(item) for item in listed[:limit]]


def _render_id(item: Any) -> int | str:
    if isinstance(item, int) and not isinstance(item, bool):
        return item if ID_MIN <= item <= ID_MAX else str(item)
    return item if isinstance(item, str) else str(item)
