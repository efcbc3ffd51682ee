"""A node's pre-flight health check: the canary suite on each local device, before launch.

Each device runs the suite twice. Both runs must give the same fingerprints (the suite is
deterministic on one stack, so a difference is a fault that does not even repeat itself), and
where the fleet has agreed golden fingerprints for the device's stack (``canary_golden`` in the
store, kept by the service from its canary rounds) every kernel must match them. A stack with
no golden yet is compared with itself only, and the result says so. nvidia-resiliency-ext runs
its node health check at the same point: before rendezvous, so a bad node never joins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from collectors.canary import CanaryConfig, describe_stack, run_suite, stack_key

if TYPE_CHECKING:
    import torch

    from collectors.canary import CanaryFaults


@dataclass(frozen=True)
class DeviceCheck:
    device: str
    stack_key: str
    seconds: float
    unstable: tuple[str, ...]
    """Kernels whose two runs gave different fingerprints."""
    missed: tuple[str, ...]
    """Kernels whose fingerprint differs from the stack's golden."""
    compared: int
    """Kernels that had a golden to compare with (0: a stack the fleet has no golden for)."""

    @property
    def ok(self) -> bool:
        return not self.unstable and not self.missed

    def message(self) -> str:
        if self.missed:
            return f"{self.device}: canary kernels {', '.join(self.missed)} miss the golden fingerprints of stack {self.stack_key}"
        if self.unstable:
            return f"{self.device}: canary kernels {', '.join(self.unstable)} gave different fingerprints on two runs"
        against = (
            f"matches the golden of stack {self.stack_key} on {self.compared} kernels"
            if self.compared
            else f"repeats itself; no golden for stack {self.stack_key} yet"
        )
        return f"{self.device}: canary suite {against} ({self.seconds:.2f} s)"


def local_devices() -> list[torch.device]:
    """Every CUDA device this process sees, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def check_device(
    device: torch.device,
    golden_by_stack: Mapping[str, Mapping[str, str]],
    config: CanaryConfig | None = None,
    faults: CanaryFaults | None = None,
) -> DeviceCheck:
    config = config or CanaryConfig()
    key = stack_key(describe_stack(device))
    first, second = run_suite(device, config, faults), run_suite(device, config, faults)
    unstable = tuple(k for k, v in first.kernels.items() if second.kernels[k].fingerprint != v.fingerprint)
    golden = golden_by_stack.get(key, {})
    missed = tuple(k for k, v in first.kernels.items() if k in golden and golden[k] != v.fingerprint)
    compared = sum(1 for k in first.kernels if k in golden)
    return DeviceCheck(str(device), key, first.seconds + second.seconds, unstable, missed, compared)


def check_node(
    golden_by_stack: Mapping[str, Mapping[str, str]],
    devices: Sequence[torch.device] | None = None,
    config: CanaryConfig | None = None,
) -> list[DeviceCheck]:
    return [check_device(device, golden_by_stack, config) for device in (devices or local_devices())]
