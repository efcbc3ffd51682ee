"""``RunHealthCallback``: the transformers ``Trainer``'s events, translated into the hook's calls.

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.add_callback(RunHealthCallback(trainer))
    trainer.train()

Every value is taken where the Trainer produces it, as a reference, never read on the training
thread: ``logging_steps=1`` would make the Trainer all-gather and ``.item()`` its loss every step,
and what it logs is a rounded mean of per-rank means, not this rank's token-weighted sum.

- A window (one optimizer-step attempt, all its ``gradient_accumulation_steps`` microbatches) is
  ``on_step_begin`` to ``on_step_end``.
- Each microbatch's loss and labels: a forward hook on the model, which sees the ``labels`` the
  Trainer passes and the loss tensor in the output (kept on the device). When the Trainer passes
  ``num_items_in_batch`` the model's loss is its sum over that window-wide (and, with
  ``average_tokens_across_devices``, world-wide) token count; the hook multiplies it back into
  this microbatch's sum, on the device.
- A loss computed outside the model (a ``compute_loss`` override that pops the labels, as the
  transformers docs show; ``compute_loss_func``; label smoothing): the model's output carries
  none, so the callback wraps this trainer's ``compute_loss`` and takes what it returns, with the
  labels it was handed (read before the override pops them). It is taken as the microbatch's
  mean over its supervised tokens (what ``CrossEntropyLoss`` and the label smoother return),
  or, under ``compute_loss_func`` with ``num_items_in_batch``, as its share of the window's sum
  (that function's contract). Given the trainer only, like the grad norm.
- The grad norm before clipping: the Trainer gets it, as a device tensor, from
  ``accelerator.clip_grad_norm_`` and hands callbacks nothing of it (``on_pre_optimizer_step``
  comes after clipping; ``on_log`` gets a float after its own ``.item()``, on logging steps
  only). So, given the trainer, the callback wraps that one method on this trainer's
  accelerator and passes the returned tensor on: no sync. Without the trainer, no grad norm.
- Updates: the hook's step hooks on the optimizer accelerate wraps. ``AcceleratedOptimizer`` is
  not a real ``torch.optim.Optimizer`` (its step runs no step hooks), while the inner optimizer
  is stepped only when the GradScaler finds no inf; ``global_step`` counts skipped attempts too.
- Checkpoints: ``on_save``, on every rank at the same step (the hook runs its checkpoint canary
  there when configured). The saving ranks first write the hook's counters into the folder
  (``runhealth.json``), so that a resume continues them exactly, and hand the folder to
  ``checkpoint_saved``, which returns at once: no barrier is added to the save and nothing is
  read on the training thread. Rank 0's hook hashes the folder on its own thread once its files
  are quiet, the other ranks' RNG states or shards included (``collectors.manifests``), and the
  checkpoint is a rollback target once that manifest is recorded. ``manifests=False`` records
  checkpoints without it (they are then no rollback target). The Trainer's ``_save_checkpoint``
  (this trainer's, wrapped) declares each save as it starts (``rh.checkpoint_saving``): the save
  is timed to ``on_save`` for the preemption budget's ``T_save``.
- Resume: ``global_step > 0`` at ``on_train_begin`` (the Trainer loaded a checkpoint's state).
  The resume states the data position the Trainer restored: the checkpoint's consumed count,
  or, under ``ignore_data_skip`` with a checkpoint inside an epoch, the count at that epoch's
  start (the Trainer restarts the epoch's loader from its first batch instead of skipping to
  the checkpoint's), which the service reports as a data cursor reset or mismatch.
- Directives: after each window, ``rh.should_stop()``; a rollback stops the Trainer there
  (``control.should_training_stop``), on every rank at the same step, and ``rh.directive`` says
  what to restore.
- An exception out of ``train()``: the Trainer calls no callback (no ``on_train_end``), so the
  hook is closed when the interpreter exits, its queued windows delivered and the incarnation
  finished as failed (``RunHealth._close_at_exit``). A process that lives on after the
  exception (a notebook) closes it itself: ``callback.rh.close("failed")``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

try:
    import accelerate  # noqa: F401  the Trainer needs it: said here, at import
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - exercised by the no-transformers check
    raise ImportError("collectors.hf needs transformers and accelerate: pip install 'runhealth[hf]'") from exc

from collectors.guard import guarded
from collectors.hook import RunHealth
from collectors.tokens import supervised_tokens

log = logging.getLogger("runhealth.collectors")

PROGRESS_FILE = "runhealth.json"


class RunHealthCallback(TrainerCallback):
    """Attach ``RunHealth`` to a ``Trainer``, on every rank.

    ``trainer``: the Trainer this callback is added to; needed for the grad norm before clipping
    (see the module docstring). ``rh``: a hook to use (the caller closes it); by default one is
    made from the environment, closed at ``on_train_end`` and made anew for another ``train()``
    (a new incarnation). ``manifests``: hash each saved checkpoint for its manifest (rank 0,
    off the training thread).

    Every event is ``guarded``: an exception is counted and logged once, never raised into
    training. ``self`` is positional-only in them since the Trainer passes its objects as
    keyword arguments, which ``**kwargs`` takes.
    """

    def __init__(
        self, trainer: Trainer | None = None, *, rh: RunHealth | None = None, manifests: bool = True
    ) -> None:
        self.rh = rh if rh is not None else RunHealth()  # cheap: attaches at on_train_begin
        self.faults = self.rh.faults  # what ``guarded`` records into
        self._owned = rh is None
        self._closed = False
        self._trainer = trainer
        self._manifests = manifests
        self._open = False
        self._idle_since: float | None = None  # when the Trainer last finished its own work
        self._forward_handle: Any = None
        self._clip_wrapper: Any = None
        self._loss_wrapper: Any = None
        self._save_wrapper: Any = None
        self._loss_seen = False  # the model's forward hook took the current microbatch's loss
        self._epoch_start_consumed: int | None = 0
        self._resumed_in_epoch = False  # the next on_epoch_begin continues an epoch, not starts one

    # Attaching and detaching.

    @guarded
    def on_train_begin(
        self,
        /,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        if self._owned and self._closed:  # another train() after one ended: a new incarnation
            self.rh, self._closed = RunHealth(), False
            self.faults = self.rh.faults
        # The hook unwraps the AcceleratedOptimizer and takes the GradScaler it carries
        # (``collectors.wrappers``, ``WindowAccounting.watch``).
        self.rh.watch(model=model, optimizer=optimizer, scheduler=lr_scheduler)
        # The batch the Trainer runs (for the service's batch arithmetic on resume).
        self.rh.declare_batch(
            micro_batch=args.per_device_train_batch_size, accumulation=args.gradient_accumulation_steps
        )
        self.rh.start()
        if model is not None and self._forward_handle is None:
            self._forward_handle = model.register_forward_hook(self._after_forward, with_kwargs=True)
        self._wrap_clip()
        self._wrap_compute_loss()
        self._wrap_save()
        if state.global_step > 0:
            self._resumed(args, state)
        self._idle_since = time.perf_counter()

    @guarded
    def on_train_end(
        self, /, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._open = False
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None
        self._unwrap_clip()
        self._unwrap_compute_loss()
        self._unwrap_save()
        if self._owned:
            self.rh.close("stopped" if self.rh.directive is not None else "completed")
            self._closed = True

    # The window.

    @guarded
    def on_epoch_begin(
        self, /, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._idle_since = time.perf_counter()  # the epoch's iterator is made after this
        if self._resumed_in_epoch:  # the resumed epoch began before the checkpoint
            self._resumed_in_epoch = False
        else:
            self._epoch_start_consumed = self.rh.progress["consumed"]

    @guarded
    def on_step_begin(
        self, /, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The Trainer fetched the window's batches just before this; since its last own work
        # (the previous step, logging, evaluation, a save) it was waiting for data.
        since = self._idle_since
        self.rh.window_start(data_wait_s=None if since is None else time.perf_counter() - since)
        self._open = True

    @guarded
    def on_step_end(
        self, /, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._open = False
        self.rh.window_end()
        if self.rh.should_stop():  # a rollback directive, at the step every rank agreed on
            control.should_training_stop = True
        self._idle_since = time.perf_counter()

    @guarded
    def on_log(
        self, /, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._idle_since = time.perf_counter()

    @guarded
    def on_evaluate(
        self, /, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._idle_since = time.perf_counter()

    @guarded
    def _after_forward(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        """Each training microbatch's loss, as a device tensor (no sync), with its labels.
        Evaluation forwards (not training, or outside a window) are not the window's."""
        if not (self._open and module.training):
            return
        labels = kwargs.get("labels")
        loss = output_loss(output, labels)
        if loss is None:  # a loss computed outside the model: see _wrap_compute_loss
            return
        self._loss_seen = True
        loss = loss.detach()
        tokens = None
        shift_labels = kwargs.get("shift_labels")  # padding-free collators: already the targets
        if shift_labels is not None:
            ignore_index = self.rh.config.hook.ignore_index
            tokens = supervised_tokens(shift_labels, shift=False, ignore_index=ignore_index)
        items = kwargs.get("num_items_in_batch")
        if items is not None:
            # The model divided this microbatch's summed loss by the count of the window (of all
            # ranks, with average_tokens_across_devices): multiplied back, it is this
            # microbatch's sum. A device op on device values.
            self.rh.loss(loss * items, labels=labels, tokens=tokens, reduction="sum")
        else:
            self.rh.loss(loss, labels=labels, tokens=tokens, reduction="mean")

    def _wrap_clip(self) -> None:
        """Pass the pre-clip norm ``accelerator.clip_grad_norm_`` returns to the hook, as the
        tensor it is. Only on this trainer's accelerator, undone at ``on_train_end``."""
        if self._trainer is None:
            log.warning(
                "runhealth: RunHealthCallback has no trainer, so grad norms are not recorded "
                "(the Trainer gives callbacks no pre-clip norm): use RunHealthCallback(trainer)"
            )
            return
        if self._clip_wrapper is not None:
            return
        accelerator = self._trainer.accelerator
        clip = accelerator.clip_grad_norm_
        rh = self.rh

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            norm = clip(*args, **kwargs)
            rh.grad_norm(norm)  # guarded; ignored outside a window
            return norm

        accelerator.clip_grad_norm_ = clip_grad_norm_
        self._clip_wrapper = clip_grad_norm_

    def _wrap_compute_loss(self) -> None:
        """Take the loss ``compute_loss`` returns when the model's output had none (see the
        module docstring). Only on this trainer, undone at ``on_train_end``."""
        if self._trainer is None or self._loss_wrapper is not None:
            return
        compute = self._trainer.compute_loss
        callback = self

        def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            labels = inputs.get("labels") if isinstance(inputs, Mapping) else None  # before a pop
            callback._loss_seen = False
            result = compute(model, inputs, *args, **kwargs)
            if not callback._loss_seen:
                callback._outside_loss(model, result, labels, kwargs.get("num_items_in_batch"))
            return result

        self._trainer.compute_loss = compute_loss  # type: ignore[method-assign]
        self._loss_wrapper = compute_loss

    @guarded
    def _outside_loss(self, model: Any, result: Any, labels: Any, items: Any) -> None:
        """A training microbatch's loss that ``compute_loss`` computed outside the model."""
        if not (self._open and getattr(model, "training", False)):
            return
        loss = result[0] if isinstance(result, tuple | list) and result else result
        if not (hasattr(loss, "detach") and loss.dim() == 0):
            return
        loss = loss.detach()
        if items is not None and getattr(self._trainer, "compute_loss_func", None) is not None:
            self.rh.loss(loss * items, labels=labels, reduction="sum")  # a share of the window's sum
        else:
            self.rh.loss(loss, labels=labels, reduction="mean")

    def _wrap_save(self) -> None:
        """Declare each save as it starts (``on_save`` comes once it is written): the hook times
        it to its record, the preemption budget's ``T_save``. The Trainer's own
        ``_save_checkpoint``, wrapped on this trainer only, undone at ``on_train_end``."""
        if self._trainer is None or self._save_wrapper is not None:
            return
        save = self._trainer._save_checkpoint
        rh = self.rh

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            rh.checkpoint_saving()
            try:
                return save(*args, **kwargs)
            except BaseException:
                rh.checkpoint_failed()
                raise

        self._trainer._save_checkpoint = save_checkpoint  # type: ignore[method-assign]
        self._save_wrapper = save_checkpoint

    def _unwrap_save(self) -> None:
        wrapper, self._save_wrapper = self._save_wrapper, None
        trainer = self._trainer
        if wrapper is not None and trainer is not None and vars(trainer).get("_save_checkpoint") is wrapper:
            del trainer._save_checkpoint  # the class's method again

    def _unwrap_compute_loss(self) -> None:
        wrapper, self._loss_wrapper = self._loss_wrapper, None
        trainer = self._trainer
        if wrapper is not None and trainer is not None and vars(trainer).get("compute_loss") is wrapper:
            del trainer.compute_loss  # the class's method again

    def _unwrap_clip(self) -> None:
        wrapper, self._clip_wrapper = self._clip_wrapper, None
        if wrapper is None or self._trainer is None:
            return
        accelerator = self._trainer.accelerator
        if vars(accelerator).get("clip_grad_norm_") is wrapper:
            del accelerator.clip_grad_norm_  # the class's method again

    # Checkpoints and resumes.

    @guarded
    def on_save(
        self, /, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        path = checkpoint_folder(args, state)
        progress = self.rh.progress  # the boundary: the window that triggered the save is closed
        step, consumed = int(progress["step"] or 0), progress["consumed"]
        # Only counters the hook kept (no windows: it is not attached, and they mean nothing).
        if args.should_save and progress["attempt"] and os.path.isdir(path):
            extra = {"global_step": state.global_step, "epoch_start_consumed": self._epoch_start_consumed}
            write_progress(path, {**progress, **extra})
        # Returns at once: the manifest is built off this thread (see the module docstring).
        self.rh.checkpoint_saved(step, path, consumed=consumed, hash_files=self._manifests)
        self._idle_since = time.perf_counter()

    def _resumed(self, args: TrainingArguments, state: TrainerState) -> None:
        """The Trainer restored a checkpoint's state, model, optimizer, scheduler and scaler
        before ``on_train_begin``. Its folder is found by the Trainer's own naming; the hook's
        counters at that boundary come from the file ``on_save`` wrote there, else the hook
        takes the optimizer's step counter and leaves the consumed count unknown."""
        path = checkpoint_folder(args, state)
        found = os.path.isdir(path)
        progress = read_progress(path) if found else {}
        self._epoch_start_consumed = progress.get("epoch_start_consumed")
        self._resumed_in_epoch = not float(state.epoch or 0).is_integer()
        consumed = progress.get("consumed")
        if args.ignore_data_skip and self._resumed_in_epoch:
            # The Trainer restarts this epoch's loader from its first batch: that is where the
            # data is, whatever the checkpoint says (None when the checkpoint did not record it).
            consumed = self._epoch_start_consumed
        self.rh.resumed(
            checkpoint_path=path if found else None,
            checkpoint_step=progress.get("step"),
            consumed=consumed,
            extra={"global_step": state.global_step, "ignore_data_skip": bool(args.ignore_data_skip)},
        )


def output_loss(output: Any, labels: Any) -> Any:
    """The loss in a model's output: ``ModelOutput.loss``, or the first item of a tuple output
    when labels were given (``return_dict=False``); None when there is none."""
    loss: Any = None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, tuple | list) and output and labels is not None:
        loss = output[0]
    return loss if hasattr(loss, "detach") and loss.dim() == 0 else None


def checkpoint_folder(args: TrainingArguments, state: TrainerState) -> str:
    """Where the Trainer saves (and, by the same name, resumes) the checkpoint of this step.
    Absolute, so the save and the resume name it alike."""
    folder = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    return os.path.abspath(os.path.join(str(args.output_dir), folder))


def write_progress(folder: str, progress: Mapping[str, Any]) -> None:
    """The hook's counters at this checkpoint, written whole or not at all (rename)."""
    target = os.path.join(folder, PROGRESS_FILE)
    partial = target + ".partial"
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump(dict(progress), handle)
    os.replace(partial, target)


def read_progress(folder: str) -> dict[str, Any]:
    try:
        with open(os.path.join(folder, PROGRESS_FILE), encoding="utf-8") as handle:
            progress = json.load(handle)
    except (OSError, ValueError):
        return {}
    return progress if isinstance(progress, dict) else {}
