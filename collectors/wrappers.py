"""The objects a framework wraps, unwrapped to the ones the hook reads and hooks into.

Accelerate's ``accelerator.prepare`` returns an ``AcceleratedOptimizer`` and an
``AcceleratedScheduler``, and the README's recipe hands those to ``RunHealth``. Neither is what
the hook needs: the ``AcceleratedOptimizer`` subclasses ``torch.optim.Optimizer`` without
calling its constructor, so it has no step hooks to register (``register_step_pre_hook``
raises), and it steps the inner optimizer only on the updating microbatch, which is what a window
counts; the ``AcceleratedScheduler`` has no ``last_epoch`` of its own. Each holds the real one as
an attribute, found here by duck typing (``collectors`` never imports accelerate).
"""

from __future__ import annotations

from typing import Any


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer whose ``step`` runs the update, under any wrapper that holds it as
    ``.optimizer`` without being an initialized optimizer itself."""
    return _unwrapped(optimizer, "optimizer", own="_optimizer_step_pre_hooks")


def inner_scheduler(scheduler: Any) -> Any:
    """The learning-rate scheduler whose state a resume reads, under any wrapper that holds it
    as ``.scheduler`` without a ``last_epoch`` of its own."""
    return _unwrapped(scheduler, "scheduler", own="last_epoch")


def _unwrapped(wrapped: Any, inner: str, *, own: str) -> Any:
    """What ``wrapped`` holds as ``inner``, through nested wrappers, down to an object that has
    the attribute ``own`` (the real one has it; the wrapper does not)."""
    while wrapped is not None and not hasattr(wrapped, own) and getattr(wrapped, inner, None) is not None:
        wrapped = getattr(wrapped, inner)
    return wrapped
