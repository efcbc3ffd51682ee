"""Silent data corruption: canary fingerprints compared bitwise among devices of one stack.

Every rank runs the same canary suite at the same step, from the same seeded inputs, with the
same numerics flags. On one stack (device model, SM count, MIG mode, driver, CUDA, cuBLAS and
torch versions, numerics flags) deterministic kernels must give identical bytes, so a
fingerprint that differs from its stack's reference is a fault, not noise. The reference is
the golden fingerprint the service keeps for the stack once a quorum of devices agreed, or
this round's quorum while there is none. A mismatch is re-run on the same device at once:
it reproduces -> persistent; it does not -> transient. Both are findings; persistent is
critical.

A tolerance, in ULPs of a kernel's summary values, is used only where bitwise equality cannot
hold: kernels marked non-deterministic, and a device alone on its stack compared with another
stack's reference.
"""

from __future__ import annotations

import math
import struct
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from policies.types import Finding, Severity


@dataclass(frozen=True)
class KernelResult:
    fingerprint: str
    summary: tuple[float, ...] = ()
    deterministic: bool = True


@dataclass(frozen=True)
class CanaryResult:
    rank: int
    node: str | None
    device: str | None
    stack: str
    step: int
    kernels: Mapping[str, KernelResult]
    rerun: Mapping[str, KernelResult] | None = None
    """The immediate re-run on the same device, when the first run missed its golden."""
    incarnation: str = ""


@dataclass(frozen=True)
class CanaryConfig:
    """When fingerprints agree enough to become a reference, and the tolerances.

    - ``quorum`` 3 devices and ``quorum_fraction`` 2/3 of the stack's devices in the round:
      one faulty device in three cannot outvote two healthy ones, and a published rate of
      about one faulty device per thousand makes two faulty devices agreeing bit for bit
      negligible.
    - ``nondeterministic_ulps`` 64: float32 ULPs of a summary value for kernels whose
      reduction order may vary between runs (atomics); a flipped bit above the low mantissa
      moves a summary by far more.
    - ``cross_stack_ulps`` 4096: a device alone on its stack against another stack's
      reference: different cuBLAS versions choose different kernels and reduction orders, so
      low bits differ; 4096 ULPs (~2.4e-4 relative in float32) still catches an exponent or
      high-mantissa flip in any summarized output.
    """

    quorum: int = 3
    quorum_fraction: float = 2 / 3
    nondeterministic_ulps: int = 64
    cross_stack_ulps: int = 4096

    def __post_init__(self) -> None:
        if self.quorum < 2 or not 0.5 < self.quorum_fraction <= 1:
            raise ValueError("CanaryConfig: quorum >= 2, 0.5 < quorum_fraction <= 1")
        if self.nondeterministic_ulps < 0 or self.cross_stack_ulps < 0:
            raise ValueError("CanaryConfig: tolerances must be >= 0")


@dataclass(frozen=True)
class RoundVerdict:
    findings: tuple[Finding, ...]
    new_golden: Mapping[tuple[str, str], str]
    """(stack, kernel) -> fingerprint agreed by a quorum this round, where none was kept."""
    rerun_wanted: tuple[int, ...] = ()
    """Ranks that missed this round's reference without a re-run (no golden was known to
    them): the service asks them to re-run."""
    checked: tuple[int, ...] = field(default_factory=tuple)


FLOAT32_MAX = 3.4028234663852886e38


def float32_ulps(a: float, b: float) -> int:
    """Distance in float32 units in the last place (sign-aware, monotone ordering)."""
    if math.isnan(a) or math.isnan(b):
        return 0 if math.isnan(a) and math.isnan(b) else 2**32
    if a == b:
        return 0

    def ordered(x: float) -> int:
        if abs(x) > FLOAT32_MAX:  # summaries are float64: past float32's range is its infinity
            x = math.copysign(math.inf, x)
        bits: int = struct.unpack("<i", struct.pack("<f", x))[0]
        return bits if bits >= 0 else -(bits & 0x7FFFFFFF)

    return abs(ordered(a) - ordered(b))


def _within(a: KernelResult, b: KernelResult, ulps: int) -> bool:
    if len(a.summary) != len(b.summary) or not a.summary:
        return False
    return all(float32_ulps(x, y) <= ulps for x, y in zip(a.summary, b.summary, strict=True))


def _agrees(result: KernelResult, reference: KernelResult, config: CanaryConfig) -> bool:
    if result.fingerprint == reference.fingerprint:
        return True
    return not result.deterministic and _within(result, reference, config.nondeterministic_ulps)


def _references(
    group: Sequence[CanaryResult], golden: Mapping[tuple[str, str], KernelResult], config: CanaryConfig
) -> tuple[dict[str, KernelResult], dict[tuple[str, str], str]]:
    """Per kernel: the golden reference, else this round's quorum (which becomes golden)."""
    references, new_golden = {}, {}
    stack = group[0].stack
    for name in sorted({k for r in group for k in r.kernels}):
        if (stack, name) in golden:
            references[name] = golden[(stack, name)]
            continue
        votes = Counter(r.kernels[name].fingerprint for r in group if name in r.kernels)
        if not votes:
            continue
        fingerprint, count = votes.most_common(1)[0]
        if count >= config.quorum and count >= config.quorum_fraction * sum(votes.values()):
            sample = next(
                r.kernels[name]
                for r in group
                if name in r.kernels and r.kernels[name].fingerprint == fingerprint
            )
            references[name] = sample
            new_golden[(stack, name)] = fingerprint
    return references, new_golden


def compare_round(
    results: Sequence[CanaryResult],
    golden: Mapping[tuple[str, str], KernelResult],
    config: CanaryConfig,
) -> RoundVerdict:
    """Judge one canary round (every rank's result at one step)."""
    by_stack: dict[str, list[CanaryResult]] = defaultdict(list)
    for result in results:
        by_stack[result.stack].append(result)
    findings: list[Finding] = []
    new_golden: dict[tuple[str, str], str] = {}
    rerun_wanted: list[int] = []
    references_by_stack: dict[str, dict[str, KernelResult]] = {}
    for stack, group in by_stack.items():
        references, agreed = _references(group, golden, config)
        references_by_stack[stack] = references
        new_golden.update(agreed)
    for stack, group in by_stack.items():
        references = references_by_stack[stack]
        tolerance = None
        if not references:  # alone on its stack: compare with another stack, within a tolerance
            references = next((refs for s, refs in references_by_stack.items() if s != stack and refs), {})
            tolerance = config.cross_stack_ulps
        for result in group:
            missed = _missed(result.kernels, references, config, tolerance)
            if not missed:
                continue
            if result.rerun is None:
                rerun_wanted.append(result.rank)
                continue
            repeated = _missed(result.rerun, references, config, tolerance)
            findings.append(
                _finding(result, missed, persistent=bool(set(repeated) & set(missed)), tolerance=tolerance)
            )
    return RoundVerdict(
        findings=tuple(findings),
        new_golden=new_golden,
        rerun_wanted=tuple(sorted(rerun_wanted)),
        checked=tuple(sorted(r.rank for r in results)),
    )


def _missed(
    kernels: Mapping[str, KernelResult],
    references: Mapping[str, KernelResult],
    config: CanaryConfig,
    tolerance: int | None,
) -> list[str]:
    missed = []
    for name, reference in references.items():
        result = kernels.get(name)
        if result is None:
            continue
        ok = (
            _within(result, reference, tolerance)
            if tolerance is not None
            else _agrees(result, reference, config)
        )
        if not ok:
            missed.append(name)
    return missed


def where(result: CanaryResult) -> str:
    """The device and node as an operator reads them; a CPU rank has no device UUID."""
    node = result.node or "unknown node"
    return f"device {result.device} on {node}" if result.device else node


def _finding(result: CanaryResult, missed: list[str], persistent: bool, tolerance: int | None) -> Finding:
    how = (
        "persistent (the immediate re-run on the same device missed again)"
        if persistent
        else ("transient (the immediate re-run matched)")
    )
    basis = f"within {tolerance} ULPs of another stack's reference" if tolerance is not None else "bitwise"
    return Finding(
        step=result.step,
        kind="canary_mismatch",
        severity=Severity.CRITICAL if persistent else Severity.WARNING,
        signal="canary",
        value=float(len(missed)),
        threshold=0.0,
        message=(
            f"canary on rank {result.rank} ({where(result)}) does not match its "
            f"stack's reference ({basis}) in {', '.join(missed)}: {how}"
        ),
        incarnation=result.incarnation,
        rank=result.rank,
        node=result.node,
        device=result.device,
        evidence={
            "kernels": missed,
            "persistent": persistent,
            "stack": result.stack,
            "fingerprints": {k: result.kernels[k].fingerprint for k in missed},
        },
    )


@dataclass(frozen=True)
class ScheduleConfig:
    """How often canaries run: as often as the budget allows, and at least every 6 hours.

    ``budget_fraction`` 0.5% of training time (the issue's default cap; published practice
    keeps SDC screening far below 1%). ``max_interval_s`` 6 h: every device is checked well
    within a day. ``min_interval_s`` 60 s: no tighter than a minute however cheap the suite.
    """

    budget_fraction: float = 0.005
    min_interval_s: float = 60.0
    max_interval_s: float = 6 * 3600.0

    def __post_init__(self) -> None:
        if not 0 < self.budget_fraction < 1 or not 0 < self.min_interval_s <= self.max_interval_s:
            raise ValueError("ScheduleConfig: 0 < budget_fraction < 1, 0 < min_interval_s <= max_interval_s")


def canary_interval_s(suite_seconds: float, config: ScheduleConfig) -> float:
    """The interval at which a suite of this cost spends exactly the budget (clamped)."""
    if suite_seconds <= 0:
        return config.min_interval_s
    return min(config.max_interval_s, max(config.min_interval_s, suite_seconds / config.budget_fraction))


def spent_fraction(canary_seconds: float, training_seconds: float) -> float:
    return canary_seconds / training_seconds if training_seconds > 0 else 0.0


@dataclass(frozen=True)
class CanaryRound:
    """Every rank's canary result at one step, and the golden fingerprints known for them."""

    results: Sequence[CanaryResult]
    golden: Mapping[tuple[str, str], KernelResult]


@dataclass(frozen=True)
class RoundComparison:
    """``policies.registry`` canary policy: ``compare_round``."""

    config: CanaryConfig
    name: str = "round_comparison"

    def start(self) -> None:
        return None

    def judge(self, state: None, observed: CanaryRound) -> tuple[None, RoundVerdict]:
        return None, compare_round(observed.results, observed.golden, self.config)
