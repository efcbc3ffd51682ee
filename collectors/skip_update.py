"""Skipping the update of a nonfinite window on the device (``nonfinite_response="skip_update"``).

A window whose gradients hold a NaN or an infinity would write it into every weight and optimizer
moment it updates, and the run would train on NaN until someone stops it. As OLMo-core's
``SkipStepOptimizer`` does, the step is skipped instead, and the decision never reaches the
host: a step pre-hook computes a found-inf flag on the gradients' device from the window's
gradient norm (what ``rh.grad_norm`` was given, else the norm of the optimizer's gradients,
computed on the device) and hands it to the optimizer the way a GradScaler hands its own
(``optimizer.found_inf``). Optimizers that take that flag into their kernel (``fused=True``
Adam, AdamW, SGD, Adagrad: ``_step_supports_amp_scaling``) leave every parameter, moment and
step counter as they were when it is set; the accounting's step post-hook reads the same flag
to count the attempt as a skipped update, as it does a GradScaler's.

The gradient norm, not the loss, decides: after the data-parallel all-reduce every rank holds
the same gradients, so every replica skips the same steps and the replicas stay equal; a NaN
loss on one rank reaches the others through its gradients. With a GradScaler the scaler's own
flag already covers nonfinite gradients and is left alone. Any other optimizer would need a host
read of the flag before its step (a sync every step), so it is not skipped and that is logged
once: pass ``fused=True``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("runhealth.collectors")


class NonfiniteSkip:
    """Installed on each watched optimizer when the hook's config asks for it.
    ``grad_norm``: the current window's gradient norm as the trainer gave it (or None)."""

    def __init__(self, grad_norm: Callable[[], Any]) -> None:
        self._grad_norm = grad_norm
        self._flagged: set[int] = set()  # optimizers whose found_inf this hook set for a step
        self._refused: set[int] = set()

    def install(self, optimizer: Any) -> list[Any]:
        """The hooks' handles. Registered after the accounting's own: the post-hook that clears
        the flag runs after the one that counts it."""
        return [
            optimizer.register_step_pre_hook(self.before_step),
            optimizer.register_step_post_hook(self.after_step),
        ]

    def before_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if getattr(optimizer, "found_inf", None) is not None:
            return  # a GradScaler's flag, set for this step: it already covers nonfinite grads
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            self._refuse(optimizer)
            return
        norm = self._grad_norm()
        if norm is None:
            norm = _device_norm(optimizer)
            if norm is None:
                return  # no gradient at all: nothing would be updated
        # Sync: none. The flag is computed and stays on the norm's device; the fused kernel
        # reads it there (and moves it to each parameter's device without blocking).
        optimizer.found_inf = _nonfinite_flag(norm)
        self._flagged.add(id(optimizer))

    def after_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if id(optimizer) in self._flagged:
            self._flagged.discard(id(optimizer))
            del optimizer.found_inf  # the next step decides afresh (a GradScaler expects none)

    def _refuse(self, optimizer: Any) -> None:
        if id(optimizer) not in self._refused:
            self._refused.add(id(optimizer))
            log.error(
                "runhealth: nonfinite_response=skip_update needs an optimizer that skips on a device "
                "flag (fused=True) or a GradScaler; %s is neither, so its nonfinite updates are NOT "
                "skipped (reading the flag on the host would sync every step)",
                type(optimizer).__name__,
            )


def _nonfinite_flag(norm: Any) -> Any:
    """1.0 where the norm is NaN or infinite, else 0.0: a float32 tensor on the norm's device."""
    import torch

    if not isinstance(norm, torch.Tensor):
        return torch.tensor(0.0 if _finite_float(norm) else 1.0)
    return torch.logical_not(torch.isfinite(norm.detach())).to(torch.float32).reshape(())


def _finite_float(value: Any) -> bool:
    number = float(value)
    return number - number == 0.0  # NaN and infinities are not


def _device_norm(optimizer: Any) -> Any:
    """The total 2-norm of the optimizer's gradients, computed on their device (no sync)."""
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    return torch.nn.utils.get_total_norm(grads, foreach=None)
