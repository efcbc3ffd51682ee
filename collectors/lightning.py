"""``RunHealthCallback``: Lightning's callback events, translated into the hook's calls.

    trainer = lightning.pytorch.Trainer(
        ..., callbacks=[RunHealthCallback(labels_from=lambda batch: batch["labels"])]
    )

Every value is taken where Lightning produces it, as a reference, never read on the training
thread (``self.log(..., sync_dist=True)`` every step would all-reduce and read it every step).

- A window is one optimizer-step attempt: it opens at the first ``on_train_batch_start`` after
  the previous one closed and closes at the ``on_train_batch_end`` of the batch whose optimizer
  step ran (``on_before_optimizer_step`` fired), so ``accumulate_grad_batches`` microbatches, or
  fewer at an epoch's end. Under manual optimization every batch is a window.
- Each microbatch's loss: ``outputs["loss"]`` at ``on_train_batch_end``, kept on the device.
  Under automatic optimization Lightning hands over the loss already divided by
  ``accumulate_grad_batches`` (for the backward); it is multiplied back, on the device. Labels:
  ``labels_from(batch)``, when given, for the supervised token count.
- The grad norm before clipping: taken from the clipping Lightning already does, never
  computed again. Clipping by norm (``gradient_clip_val``, the default
  ``configure_gradient_clipping``, or ``self.clip_gradients`` under manual optimization) ends in
  the precision plugin's ``clip_grad_by_norm``, which calls ``torch.nn.utils.clip_grad_norm_``
  and drops the total norm it returns. The callback replaces that method on this trainer's
  plugin with the same call that keeps the norm (a device tensor, no sync), undone when training
  ends. Without clipping by norm no norm is computed and none is recorded: not clipping, clipping
  by value, a ``configure_gradient_clipping`` that calls torch itself, or a plugin with its own
  clipping (FSDP, DeepSpeed). Under automatic optimization the plugin has unscaled the gradients
  before it clips; under manual optimization with a GradScaler ``self.clip_gradients`` runs
  before ``opt.step()`` unscales them, so that norm is divided by the scale, on the device.
- The loss scale: the precision plugin's GradScaler (``trainer.precision_plugin.scaler``).
- Updates: the hook's step hooks on ``trainer.optimizers``. ``global_step`` counts optimizer-step
  attempts, and the GradScaler skips ``optimizer.step`` on an overflow without Lightning knowing,
  so it counts skipped ones too; Lightning also steps a step-interval LR scheduler on a skip.
- Checkpoints: Lightning has no event after a checkpoint is written (``on_save_checkpoint`` runs
  while its dict is built), so the callback wraps ``save_checkpoint`` of this trainer (what
  ``ModelCheckpoint`` calls, and every rank must call), and acts after it returned: the file (or
  a sharded strategy's folder) is written and every rank passed the trainer's barrier. There,
  on every rank at the same step (the hook runs its checkpoint canary there when configured),
  it hands the path to ``checkpoint_saved``, which returns at once: the global rank 0's hook
  hashes it for the manifest on its own thread (``collectors.manifests``), nothing is read on
  the training thread. The hook's counters travel inside the checkpoint (``state_dict``), so a
  resume continues them exactly. With ``AsyncCheckpointIO`` the file is still being written
  then: such checkpoints are recorded without a manifest. Otherwise the wrapper declares the save
  as it starts (``rh.checkpoint_saving``), so it is timed to its record: the preemption budget's
  ``T_save``.
- Resume: ``trainer.ckpt_path`` set at ``on_train_start`` (Lightning restored the checkpoint's
  model, optimizer, scheduler, scaler and this callback's state before it).
- Directives: after each window, ``rh.should_stop()``; a rollback stops the trainer there
  (``trainer.should_stop``), on every rank at the same step, and ``rh.directive`` says what to
  restore.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

try:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.plugins.precision import Precision
    from torch.amp.grad_scaler import OptState
except ImportError as exc:  # pragma: no cover - exercised by the no-lightning check
    raise ImportError("collectors.lightning needs lightning: pip install 'runhealth[lightning]'") from exc

from collectors.checkpoints import checkpoint_location
from collectors.guard import guarded
from collectors.hook import RunHealth

log = logging.getLogger("runhealth.collectors")


class RunHealthCallback(Callback):
    """Attach ``RunHealth`` to a Lightning ``Trainer``, on every rank.

    ``rh``: a hook to use (the caller closes it); by default one is made from the environment,
    closed when training ends and made anew for another ``fit`` (a new incarnation).
    ``labels_from(batch)``: the batch's labels, for the token count (``HookConfig`` says how they
    are shifted and masked). ``reduction``: ``"mean"`` when ``training_step`` returns a mean over
    supervised tokens, ``"sum"`` when a sum. ``sample_ids(batch)``: the batch's sample ids;
    recorded without gradient accumulation only, since the hook takes a window's ids when it
    opens. ``manifests``: hash each written checkpoint for its manifest (rank 0, off the training thread).

    Every event is ``guarded``: an exception is counted and logged once, never raised into
    training.
    """

    def __init__(
        self,
        rh: RunHealth | None = None,
        *,
        labels_from: Callable[[Any], Any] | None = None,
        sample_ids: Callable[[Any], Any] | None = None,
        reduction: Literal["mean", "sum"] = "mean",
        manifests: bool = True,
    ) -> None:
        self.rh = rh if rh is not None else RunHealth()  # cheap: attaches at on_train_start
        self.faults = self.rh.faults  # what ``guarded`` records into
        self._owned = rh is None
        self._closed = False
        self._labels_from = labels_from
        self._sample_ids = sample_ids
        self._reduction: Literal["mean", "sum"] = reduction
        self._manifests = manifests
        self._open = self._stepped = False
        self._idle_since: float | None = None  # when Lightning last finished its own work
        self._restored: dict[str, Any] = {}
        self._save: tuple[Any, Any] | None = None  # (the trainer, its wrapped save_checkpoint)
        self._clip: tuple[Any, Any] | None = None  # (the precision plugin, its observed clip)

    # Attaching and detaching.

    @guarded
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._owned and self._closed:  # another fit after one ended: a new incarnation
            self.rh, self._closed = RunHealth(), False
            self.faults = self.rh.faults
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        self.rh.watch(
            model=pl_module,
            optimizer=list(trainer.optimizers),
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            scheduler=schedulers[0] if schedulers else None,
        )
        # Microbatches per update (for the service's batch arithmetic on resume); Lightning's
        # microbatch size is its dataloader's, which the trainer may not expose: not guessed.
        self.rh.declare_batch(accumulation=int(trainer.accumulate_grad_batches))
        self.rh.start()
        self._wrap_save(trainer)
        self._observe_clipping(trainer)
        if trainer.ckpt_path is not None:
            self._resumed(trainer)
        if self._sample_ids is not None and trainer.accumulate_grad_batches > 1:
            log.warning("runhealth: sample ids are not recorded with gradient accumulation")
        self._idle_since = time.perf_counter()

    @guarded
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._detach("completed")

    @guarded
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._detach("failed")

    def _detach(self, status: Literal["completed", "failed"]) -> None:
        if self._open:
            self._open = False
            self.rh.window_end()
        self._unwrap_save()
        self._unobserve_clipping()
        if self._owned:
            stopped = status == "completed" and self.rh.directive is not None
            self.rh.close("stopped" if stopped else status)
            self._closed = True

    # The window.

    @guarded
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._open:  # a later microbatch of the open window
            return
        ids = None
        if self._sample_ids is not None and trainer.accumulate_grad_batches == 1:
            ids = self._sample_ids(batch)
        since = self._idle_since
        self.rh.window_start(
            sample_ids=ids, data_wait_s=None if since is None else time.perf_counter() - since
        )
        self._open, self._stepped = True, False

    @guarded
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._stepped = True

    # The grad norm, from Lightning's own clipping.

    def _observe_clipping(self, trainer: Trainer) -> None:
        """Keep the norm ``clip_grad_by_norm`` computes, on this trainer's plugin only (an
        attribute of the instance). A plugin that clips its own way is left alone."""
        plugin = trainer.precision_plugin
        if self._clip is not None:
            return
        if type(plugin).clip_grad_by_norm is not Precision.clip_grad_by_norm:
            log.info("runhealth: %s clips its own way: no grad norm is recorded", type(plugin).__name__)
            return

        def clip_grad_by_norm(optimizer: Any, clip_val: Any) -> None:
            # Lightning's own body (Precision.clip_grad_by_norm), with the norm kept.
            norm = torch.nn.utils.clip_grad_norm_(plugin.main_params(optimizer), clip_val)
            self._clipped(norm, optimizer, getattr(plugin, "scaler", None))

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
        self._clip = (plugin, clip_grad_by_norm)

    def _unobserve_clipping(self) -> None:
        observed, self._clip = self._clip, None
        if observed is not None and vars(observed[0]).get("clip_grad_by_norm") is observed[1]:
            del observed[0].clip_grad_by_norm  # the class's method again

    @guarded
    def _clipped(self, norm: Any, optimizer: Any, scaler: Any) -> None:
        self.rh.grad_norm(unscaled_norm(norm, optimizer, scaler))

    @guarded
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            if pl_module.automatic_optimization:
                loss = loss * trainer.accumulate_grad_batches  # undo Lightning's division, on the device
            labels = self._labels_from(batch) if self._labels_from is not None else None
            self.rh.loss(loss, labels=labels, reduction=self._reduction)
        if self._stepped or not pl_module.automatic_optimization:
            self._open = False
            self.rh.window_end()
            if self.rh.should_stop():  # a rollback directive, at the step every rank agreed on
                trainer.should_stop = True
        self._idle_since = time.perf_counter()

    @guarded
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._idle_since = time.perf_counter()  # validation time is not data wait

    # Checkpoints and resumes.

    def state_dict(self) -> dict[str, Any]:
        """The hook's counters at this checkpoint (saved inside it by Lightning): what a resume
        continues from, and the step and consumed count the checkpoint record names. Nothing
        when the hook counted no window (not attached: its counters would mean nothing)."""
        progress = self.rh.progress
        return dict(progress) if progress["attempt"] else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)

    def _resumed(self, trainer: Trainer) -> None:
        restored = self._restored  # empty when the checkpoint was saved without this callback
        self.rh.resumed(
            checkpoint_path=checkpoint_key(trainer.ckpt_path),
            checkpoint_step=restored.get("step"),
            consumed=restored.get("consumed"),
            extra={"global_step": trainer.global_step},
        )

    def _wrap_save(self, trainer: Trainer) -> None:
        """Act right after each ``trainer.save_checkpoint`` returns, on this trainer only (an
        attribute of the instance); undone when training ends."""
        if self._save is not None:
            return
        save = trainer.save_checkpoint

        def save_checkpoint(filepath: Any, weights_only: Any = None, storage_options: Any = None) -> None:
            # Timed from here to its record (the preemption budget's T_save), unless Lightning
            # writes it on a thread of its own (AsyncCheckpointIO), whose end is not seen here.
            timed = not isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO)
            if timed:
                self.rh.checkpoint_saving()
            try:
                save(filepath, weights_only, storage_options)
            except BaseException:
                if timed:
                    self.rh.checkpoint_failed()
                raise
            self._saved(trainer, filepath)

        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
        self._save = (trainer, save_checkpoint)

    def _unwrap_save(self) -> None:
        wrapped, self._save = self._save, None
        if wrapped is not None and vars(wrapped[0]).get("save_checkpoint") is wrapped[1]:
            del wrapped[0].save_checkpoint  # the class's method again

    @guarded
    def _saved(self, trainer: Trainer, filepath: Any) -> None:
        """A checkpoint was written and every rank passed the trainer's barrier."""
        path = checkpoint_key(filepath)
        if path is None:
            return
        progress = self.rh.progress  # what state_dict put into this checkpoint
        step, consumed = int(progress["step"] or 0), progress["consumed"]
        asynchronous = isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO)
        # Returns at once: the manifest is built off this thread (see the module docstring).
        self.rh.checkpoint_saved(
            step, path, consumed=consumed, hash_files=self._manifests and not asynchronous
        )
        self._idle_since = time.perf_counter()


def unscaled_norm(norm: Any, optimizer: Any, scaler: Any) -> Any:
    """The norm of the true gradients: divided by the GradScaler's scale (on the device) when the
    optimizer's gradients were not unscaled yet, as under manual optimization's clipping."""
    if scaler is None or not scaler.is_enabled():
        return norm
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    # GradScaler's own bookkeeping (private, stable since torch 1.6): whether unscale_ ran on this
    # optimizer since the last update (no entry: it did not). ``get`` creates no entry.
    state = scaler._per_optimizer_states.get(id(optimizer))
    scale = getattr(scaler, "_scale", None)  # None before the first scaled backward
    if (state is not None and state["stage"] is OptState.UNSCALED) or scale is None:
        return norm
    return norm / scale


def checkpoint_key(path: Any) -> str | None:
    """A checkpoint's path as both the save and the resume name it (``checkpoint_location``:
    absolute when local)."""
    return None if path is None else checkpoint_location(path)
