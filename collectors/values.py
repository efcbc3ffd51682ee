"""Reading training values without a host-device synchronization.

A value is either a host number, a CPU tensor (host memory: reading it waits for no device), or
a tensor on an accelerator, which stays there until the ring brings it over. Nothing here calls
``.item()`` on a device tensor; what must be snapshotted on the device is cloned there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def on_device(value: Any) -> bool:
    """A tensor on an accelerator: reading it on the host would synchronize."""
    return not getattr(value, "is_cpu", True)


def host_float(value: Any) -> float:
    """A host number or a CPU tensor's value (no device involved). A DTensor's local shard:
    its ``item()`` could start a collective."""
    if not hasattr(value, "item"):
        return float(value)
    if hasattr(value, "to_local"):
        value = value.to_local()
    return float(value.item())


def learning_rate(optimizer: Any) -> Any:
    """The first parameter group's rate. A tensor rate (capturable schedules) changes in place,
    so a device one is cloned (a device op, no sync) and a CPU one read."""
    lr = optimizer.param_groups[0]["lr"]
    if type(lr) is float or not hasattr(lr, "detach"):
        return lr
    return float(lr.item()) if lr.is_cpu else lr.detach().clone()


def loss_scale(scaler: Any) -> Any:
    """The scale a window's loss is multiplied by, taken at the window's start.

    ``scaler.get_scale()`` would ``.item()`` the scale tensor. Instead a device clone
    (``update()`` at the window's end changes the tensor in place); a CPU scale is simply read.
    Before the first ``scaler.scale()`` the tensor does not exist yet and will start at
    ``init_scale``.
    """
    if not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    if scale is None:
        return float(scaler._init_scale)
    return float(scale.item()) if scale.is_cpu else scale.detach().clone()


def scale_reader(scaler: Any) -> Callable[[], Any]:
    """How each window reads its loss scale from what the trainer passed as ``scaler``.

    A torch ``GradScaler`` (or FSDP's ``ShardedGradScaler``, accelerate's and Lightning's):
    ``loss_scale``. Megatron-LM's mixed-precision optimizers: ``get_loss_scale()``, a device
    tensor. DeepSpeed's fp16 and ZeRO optimizers: the ``loss_scale`` property (or
    ``cur_scale``), a number. Anything else that is callable: its return value. Each is read
    without a sync (``scale_value``). Anything else is refused here, at attach, naming what is
    accepted, rather than failing at every window.
    """
    if callable(getattr(scaler, "is_enabled", None)) and hasattr(scaler, "_init_scale"):
        return lambda: loss_scale(scaler)
    if callable(getattr(scaler, "get_loss_scale", None)):
        return lambda: scale_value(scaler.get_loss_scale())
    for name in ("loss_scale", "cur_scale"):
        value = getattr(scaler, name, None)
        if isinstance(value, int | float) or hasattr(value, "is_cpu"):  # a number or a tensor
            return functools.partial(_attribute_scale, scaler, name)
    if callable(scaler):
        return lambda: scale_value(scaler())
    raise TypeError(
        f"scaler: a {type(scaler).__name__} is not a loss scaler; pass a torch GradScaler, an "
        "optimizer with get_loss_scale() (Megatron-LM) or loss_scale (DeepSpeed), or a function "
        "that returns the current scale"
    )


def _attribute_scale(scaler: Any, name: str) -> Any:
    return scale_value(getattr(scaler, name))


def scale_value(value: Any) -> Any:
    """A scale as a window keeps it: a number as a float, a CPU tensor read, a device tensor
    cloned on its device (the trainer's scaler may change it in place before the window ends),
    None as None."""
    if value is None or isinstance(value, int | float):
        return None if value is None else float(value)
    return float(value.item()) if value.is_cpu else value.detach().clone()


def local_value(value: Any) -> Any:
    """A device value as this rank has it, before it is summed or stacked: a DTensor's local
    tensor (no collective: a grad norm under FSDP2, a loss under tensor parallelism's
    ``loss_parallel``; a DTensor cannot be stacked into, or copied to, a plain tensor, and this
    rank's part is what ``host_float`` reads on the host too), a one-element tensor (a loss of
    shape ``[1]``, as a gathered or concatenated loss is) as 0-dim, detached. Views, no device
    op; anything that is not a tensor (a number, numpy's, None) as it is."""
    if not hasattr(value, "detach"):
        return value
    if hasattr(value, "to_local"):
        value = value.to_local()
    if value.ndim and value.numel() == 1:
        value = value.reshape(())
    return value.detach() if value.requires_grad else value
