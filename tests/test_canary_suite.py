"""The canary suite on the CPU: repeatable fingerprints, numerics restored, faults seen."""

import random

import pytest
import torch

from collectors.canary import (
    KERNELS,
    CanaryConfig,
    CanaryFaults,
    canary_numerics,
    describe_stack,
    run_canary,
    run_suite,
)

CPU = torch.device("cpu")
SMALL = CanaryConfig(cpu_gemm=64, cpu_reduction=1 << 14, cpu_softmax=(4, 1024), cpu_elementwise=1 << 12)


def test_repeated_runs_on_one_device_give_identical_fingerprints() -> None:
    runs = [run_suite(CPU, SMALL) for _ in range(3)]
    assert set(runs[0].kernels) == set(KERNELS)
    assert all(r.kernels == runs[0].kernels for r in runs)


def test_the_trainers_numerics_are_restored() -> None:
    torch.set_float32_matmul_precision("medium")  # a trainer on the legacy API
    try:
        with canary_numerics() as flags:
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
            assert flags["tf32"] is False
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision("highest")


def flip_one_bit(rng: random.Random) -> CanaryFaults:
    def output(kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        if kernel != "gemm_fp32":
            return tensor
        flat = tensor.detach().clone().contiguous().view(-1).view(torch.int32)
        index = rng.randrange(flat.numel())
        flat[index] ^= 1 << rng.randrange(32)
        return flat.view(torch.float32).view(tensor.shape)

    return CanaryFaults(output=output)


def test_a_flipped_output_bit_misses_golden_and_is_re_run_at_once() -> None:
    golden = {k: v.fingerprint for k, v in run_suite(CPU, SMALL).kernels.items()}
    outcome = run_canary(CPU, SMALL, golden=golden, faults=flip_one_bit(random.Random(3)))
    assert outcome.missed == ("gemm_fp32",)
    assert outcome.rerun is not None and outcome.rerun.kernels["gemm_fp32"].fingerprint != golden["gemm_fp32"]
    healthy = run_canary(CPU, SMALL, golden=golden)
    assert healthy.missed == () and healthy.rerun is None


def test_the_stack_names_what_makes_fingerprints_comparable() -> None:
    stack = describe_stack(CPU)
    assert {"torch", "cpu_model", "blas", "threads"} <= stack.keys()
    outcome = run_canary(CPU, SMALL)
    assert outcome.stack_key == run_canary(CPU, SMALL).stack_key
    wire = outcome.as_wire()
    assert set(wire["kernels"]) == set(KERNELS) and wire["rerun"] is None


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        CanaryConfig(cpu_gemm=1)
