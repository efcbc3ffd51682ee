"""Reading training values without a host-device synchronization.

A value is either a host number, a CPU tensor (host memory: reading it waits for no device), or
a tensor on an accelerator, which stays there until the ring brings it over. Nothing here calls
``.item()`` on a device tensor; what must be snapshotted on the device is cloned there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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


def local_value(value: Any, device: torch.device) -> Any:
    """A grad norm as this rank has it: a DTensor's local shard (no collective), a tensor on
    another device moved to the hook's (device to device: async)."""
    if value is None or isinstance(value, int | float):
        return value
    value = value.to_local() if hasattr(value, "to_local") else value
    if not value.is_cpu and value.device != device:
        value = value.to(device, non_blocking=True)
    return value.detach() if value.requires_grad else value
