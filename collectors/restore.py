"""What a restart restored, read from the live objects right after loading a checkpoint.

This runs once, at resume, not per step: reading device values here (``.item()``, norms of the
Adam moments) synchronizes with the device, which is fine at that point, and it is the evidence
that the optimizer moments, step counters, learning rate and schedule phase came back.
"""

from __future__ import annotations

import math
from typing import Any

MOMENTS = ("exp_avg", "exp_avg_sq")

# Parameter states whose moments are normed: lost moments are zero (or absent) in every state, so
# a few tell, and reading a few tensors keeps a resume of a large model quick.
MOMENT_SAMPLE = 16


def optimizer_state(optimizer: Any) -> dict[str, Any]:
    """How many parameters have state against how many the optimizer steps, step counters, and
    the L2 norms of Adam's moments (``exp_avg``, ``exp_avg_sq``) over the first
    ``MOMENT_SAMPLE`` parameter states."""
    steps: list[float] = []
    squares = dict.fromkeys(MOMENTS, 0.0)
    found = dict.fromkeys(MOMENTS, False)
    for index, state in enumerate(optimizer.state.values()):
        if "step" in state:
            steps.append(_number(state["step"]))
        for name in MOMENTS:
            if name in state and index < MOMENT_SAMPLE:
                # A sync per tensor: acceptable at resume, never on the step path.
                squares[name] += float(state[name].detach().float().norm()) ** 2
                found[name] = True
    restored: dict[str, Any] = {
        "param_states": len(optimizer.state),
        "trainable_params": trainable_parameters(optimizer),
        "lr": [_number(group["lr"]) for group in optimizer.param_groups],
    }
    if steps:
        restored["optimizer_step_min"] = min(steps)
        restored["optimizer_step_max"] = max(steps)
    for name in MOMENTS:
        if found[name]:
            restored[f"{name}_norm"] = math.sqrt(squares[name])
    return restored


def trainable_parameters(optimizer: Any) -> int:
    """The parameters of the optimizer's groups that take gradients and keep state: each has
    state once it was stepped. A group that keeps none (plain SGD) is not counted, so restoring
    such an optimizer is not a lost state."""
    return sum(
        1
        for group in optimizer.param_groups
        if keeps_state(optimizer, group)
        for p in group["params"]
        if getattr(p, "requires_grad", True)
    )


def keeps_state(optimizer: Any, group: dict[str, Any]) -> bool:
    """False for a group of ``torch.optim.SGD`` (or a subclass) without momentum, its default:
    it stores a momentum buffer only when ``momentum`` is not 0, and nothing else. Found with
    the DDP tutorial's trainer (SGD, lr 1e-3, a snapshot of the model alone): every restart
    opened a critical ``optimizer_state_lost`` for state it never had."""
    plain_sgd = any(
        cls.__name__ == "SGD" and cls.__module__.startswith("torch.optim") for cls in type(optimizer).__mro__
    )
    return not (plain_sgd and not group.get("momentum"))


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    """The schedule's phase: ``last_epoch`` counts the scheduler's steps (updates, if stepped
    only after real optimizer steps), and the learning rates it will hand out next."""
    restored: dict[str, Any] = {"last_epoch": int(scheduler.last_epoch)}
    if hasattr(scheduler, "get_last_lr"):
        restored["last_lr"] = [_number(lr) for lr in scheduler.get_last_lr()]
    return restored


def scaler_state(scaler: Any) -> dict[str, Any]:
    if not scaler.is_enabled():
        return {"enabled": False}
    state = scaler.state_dict()  # reads the scale tensor: a sync, fine at resume
    return {
        "enabled": True,
        "scale": float(state.get("scale", math.nan)),
        "growth_tracker": int(state.get("_growth_tracker", 0)),
    }


def model_state(model: Any) -> dict[str, Any]:
    """The parameter count and global L2 norm: enough to tell restored weights from fresh."""
    squares, count = 0.0, 0
    for parameter in model.parameters():
        squares += float(parameter.detach().float().norm()) ** 2
        count += parameter.numel()
    return {"parameters": count, "param_norm": math.sqrt(squares)}


def gather_restored(
    *, model: Any = None, optimizer: Any = None, scheduler: Any = None, scaler: Any = None
) -> dict[str, Any]:
    """Everything the handed objects can tell, under one key each."""
    restored: dict[str, Any] = {}
    if model is not None:
        restored["model"] = model_state(model)
    if optimizer is not None:
        restored["optimizer"] = optimizer_state(optimizer)
    if scheduler is not None:
        restored["scheduler"] = scheduler_state(scheduler)
    if scaler is not None:
        restored["scaler"] = scaler_state(scaler)
    return restored


def _number(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)
