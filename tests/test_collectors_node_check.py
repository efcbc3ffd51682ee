"""The node's pre-flight canary check (``collectors.node_check``) on this machine's CPU."""

from __future__ import annotations

import torch

from collectors.canary import KERNELS, CanaryConfig, CanaryFaults
from collectors.node_check import check_device

SMALL = CanaryConfig(cpu_gemm=64, cpu_reduction=1 << 12, cpu_softmax=(4, 256), cpu_elementwise=1 << 10)
CPU = torch.device("cpu")


def test_a_healthy_device_repeats_itself_and_says_there_is_no_golden_yet() -> None:
    check = check_device(CPU, {}, SMALL)
    assert check.ok and check.compared == 0
    assert "no golden for stack" in check.message()


def test_a_device_that_matches_its_stacks_golden_passes_and_one_that_misses_fails() -> None:
    first = check_device(CPU, {}, SMALL)
    golden = {first.stack_key: {kernel: "0" * 64 for kernel in ("gemm_fp32",)}}
    missed = check_device(CPU, golden, SMALL)
    assert not missed.ok and missed.missed == ("gemm_fp32",)
    assert "miss the golden fingerprints" in missed.message()


def test_a_fault_that_does_not_repeat_is_unstable() -> None:
    calls = {"n": 0}

    def flip_once(kernel: str, out: torch.Tensor) -> torch.Tensor:
        if kernel == "softmax_fp32":
            calls["n"] += 1
            if calls["n"] == 2:  # the second run only: a transient fault
                out = out.clone()
                out.view(-1)[0] += 1e-3
        return out

    check = check_device(CPU, {}, SMALL, CanaryFaults(output=flip_once))
    assert check.unstable == ("softmax_fp32",) and not check.ok
    assert set(KERNELS) >= set(check.unstable)
