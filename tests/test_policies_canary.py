import dataclasses
import math

import pytest

from policies.canary import (
    CanaryConfig,
    CanaryResult,
    KernelResult,
    ScheduleConfig,
    canary_interval_s,
    compare_round,
    float32_ulps,
    spent_fraction,
)
from policies.types import Severity

CONFIG = CanaryConfig()
GOOD = {"gemm_fp32": KernelResult("aaa", (1.0,)), "softmax": KernelResult("bbb", (2.0,))}


def result(
    rank: int, kernels: dict | None = None, rerun: dict | None = None, stack: str = "H100/cuda12"
) -> CanaryResult:
    return CanaryResult(
        rank=rank,
        node=f"n{rank}",
        device=f"GPU-{rank}",
        stack=stack,
        step=100,
        kernels=kernels or GOOD,
        rerun=rerun,
    )


BAD = {**GOOD, "gemm_fp32": KernelResult("zzz", (1.5,))}


def test_a_healthy_round_sets_golden_once_a_quorum_agrees() -> None:
    verdict = compare_round([result(r) for r in range(4)], {}, CONFIG)
    assert verdict.findings == () and verdict.rerun_wanted == ()
    assert verdict.new_golden == {("H100/cuda12", "gemm_fp32"): "aaa", ("H100/cuda12", "softmax"): "bbb"}
    assert compare_round([result(r) for r in range(2)], {}, CONFIG).new_golden == {}  # two is no quorum


def test_a_mismatch_without_a_rerun_asks_for_one() -> None:
    verdict = compare_round([result(0), result(1), result(2), result(3, BAD)], {}, CONFIG)
    assert verdict.findings == () and verdict.rerun_wanted == (3,)


def test_persistent_and_transient_mismatches_against_golden() -> None:
    golden = {("H100/cuda12", k): v for k, v in GOOD.items()}
    persistent = compare_round([result(0), result(1, BAD, rerun=BAD)], golden, CONFIG)
    (finding,) = persistent.findings
    assert (finding.severity, finding.rank, finding.device) == (Severity.CRITICAL, 1, "GPU-1")
    assert finding.evidence["kernels"] == ["gemm_fp32"] and finding.evidence["persistent"] is True
    assert "rank 1 (device GPU-1 on n1)" in finding.message
    cpu_rank = dataclasses.replace(result(1, BAD, rerun=BAD), device=None)
    (finding,) = compare_round([result(0), cpu_rank], golden, CONFIG).findings
    assert "rank 1 (n1)" in finding.message  # a CPU rank has no device to name
    transient = compare_round([result(0), result(1, BAD, rerun=GOOD)], golden, CONFIG)
    (finding,) = transient.findings
    assert finding.severity is Severity.WARNING and "transient" in finding.message


def test_a_faulty_device_cannot_outvote_healthy_ones() -> None:
    verdict = compare_round([result(0, BAD, rerun=BAD), result(1), result(2), result(3)], {}, CONFIG)
    assert verdict.new_golden[("H100/cuda12", "gemm_fp32")] == "aaa"
    assert verdict.rerun_wanted == () and [f.rank for f in verdict.findings] == [0]


def test_nondeterministic_kernels_use_the_ulp_tolerance() -> None:
    golden = {("s", "sum"): KernelResult("x", (1.0,), deterministic=False)}
    close = {"sum": KernelResult("y", (1.0 + 30 * 2**-23,), deterministic=False)}
    far = {"sum": KernelResult("y", (1.0 + 100 * 2**-23,), deterministic=False)}
    assert compare_round([result(0, close, stack="s")], golden, CONFIG).findings == ()
    assert compare_round([result(0, far, rerun=far, stack="s")], golden, CONFIG).findings != ()


def test_a_lone_stack_is_compared_with_another_stack_within_a_tolerance() -> None:
    others = [result(r) for r in range(3)]
    slightly = {k: KernelResult("other", tuple(x * (1 + 1e-6) for x in v.summary)) for k, v in GOOD.items()}
    assert compare_round([*others, result(9, slightly, stack="A100")], {}, CONFIG).findings == ()
    flipped = {k: KernelResult("other", tuple(-x for x in v.summary)) for k, v in GOOD.items()}
    verdict = compare_round([*others, result(9, flipped, rerun=flipped, stack="A100")], {}, CONFIG)
    assert [f.rank for f in verdict.findings] == [9] and "ULPs" in verdict.findings[0].message


def test_float32_ulps() -> None:
    assert float32_ulps(1.0, 1.0) == 0
    assert float32_ulps(1.0, 1.0 + 2**-23) == 1
    assert float32_ulps(-0.0, 0.0) == 0
    assert float32_ulps(1.0, -1.0) > 2**29
    # float64 summaries past float32's range compare as its infinity instead of failing
    assert float32_ulps(1e300, 1e300) == 0
    assert float32_ulps(1e39, math.inf) == 0
    assert float32_ulps(1.0, 1e300) > 2**29


@pytest.mark.parametrize(("suite", "expected"), [(0.5, 100.0), (0.01, 60.0), (1000.0, 21600.0), (0.0, 60.0)])
def test_the_interval_spends_the_budget(suite: float, expected: float) -> None:
    assert canary_interval_s(suite, ScheduleConfig()) == pytest.approx(expected)
    assert spent_fraction(0.5, 100.0) == 0.005
