"""Restart drills' verdicts: what a drill measured in, one check per question out.

The reference text's "Rehearse the restart before the long run" asks four drills of a trainer
before its long run (``monitor/drills`` runs them). Each comparison here is pure: arrays named
by what they hold (``model.0.weight``, ``optimizer.0.weight.exp_avg``), learning rates, sample
ids and checkpoint progress in; a ``Check`` out that says which values differ and by how much.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.setting_error import ConfigError


@dataclass(frozen=True)
class DrillConfig:
    """Tolerances and budgets of the restart drills.

    - ``atol`` 1e-6 and ``rtol`` 1e-5: a value matches when ``|resumed - reference| <= atol +
      rtol * |reference|`` ("within floating-point tolerance", the reference text). The example
      trainer (float32 on the CPU, the same kernels in both runs) resumed bitwise equal in every
      drill run on it, 2 to 4 ranks; the tolerance leaves room for a changed reduction order
      (a few float32 ulps per update over ten updates), while a lost Adam moment or a restarted
      warm-up moves weights by about the learning rate (1e-3 to 1e-2) at the first update.
    - ``margin_s`` 5.0: T_margin of the preemption budget ``T_warning >= T_window + T_save +
      T_margin`` (the reference text: it "absorbs network and disk jitter", with no number),
      the service's own budget's default (``RUNHEALTH_POLICIES__PREEMPTION__MARGIN_S``); on the
      2-core development machine at load 10-14 a small model's save and exit varied by seconds.
    - ``short_warning_fraction`` 0.25: the warning that does not fit is a quarter of one
      window: the window in flight cannot finish, let alone the save.
    - ``restore_memory_budget_mib`` 0: no budget, the peak restore memory is measured and
      reported; above 0 a rank whose peak resident memory during the restore exceeds it fails.
    """

    atol: float = 1e-6
    rtol: float = 1e-5
    margin_s: float = 5.0
    short_warning_fraction: float = 0.25
    restore_memory_budget_mib: float = 0.0

    def __post_init__(self) -> None:
        if self.atol < 0 or self.rtol < 0:
            raise ConfigError("DrillConfig: atol and rtol must be >= 0")
        if self.margin_s < 0 or not 0 < self.short_warning_fraction < 1:
            raise ConfigError("DrillConfig: margin_s >= 0 and 0 < short_warning_fraction < 1")
        if self.restore_memory_budget_mib < 0:
            raise ConfigError("DrillConfig: restore_memory_budget_mib >= 0 (0: no budget)")


@dataclass(frozen=True)
class Check:
    """One question of a drill and its answer. ``measured``: the numbers behind ``detail``."""

    name: str
    passed: bool
    detail: str
    measured: Mapping[str, Any] = field(default_factory=dict)

    def document(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "detail": self.detail,
            "measured": dict(self.measured),
        }


def verdict(checks: Iterable[Check]) -> str:
    """``pass`` when every check passed, else ``fail`` (a drill with no check did not run)."""
    results = [check.passed for check in checks]
    return "pass" if results and all(results) else "fail"


def compare_arrays(
    name: str,
    what: str,
    reference: Mapping[str, np.ndarray],
    resumed: Mapping[str, np.ndarray],
    config: DrillConfig,
) -> Check:
    """Every array of ``reference`` against the one of the same name in ``resumed``."""
    missing = sorted(set(reference) - set(resumed))
    if not reference:
        return Check(name, False, f"no {what} in the reference checkpoint", {})
    differing: dict[str, float] = {}
    worst_name, worst = "", 0.0
    for key in sorted(set(reference) & set(resumed)):
        ref, got = np.asarray(reference[key], dtype=np.float64), np.asarray(resumed[key], dtype=np.float64)
        if ref.shape != got.shape:
            differing[key] = float("inf")
            worst_name, worst = key, float("inf")
            continue
        gap = np.abs(got - ref)
        gap = np.where(np.isnan(ref) & np.isnan(got), 0.0, gap)  # NaN where both are NaN agrees
        beyond = gap > config.atol + config.rtol * np.abs(ref)
        largest = float(np.nanmax(gap)) if gap.size and not np.isnan(gap).all() else 0.0
        if np.isnan(gap).any():
            largest = float("inf")
        if beyond.any() or np.isnan(gap).any():
            differing[key] = largest
        if largest > worst or not worst_name:
            worst_name, worst = key, largest
    measured = {
        "compared": len(set(reference) & set(resumed)),
        "differing": sorted(differing),
        "missing": missing,
        "max_abs_diff": worst,
        "worst": worst_name,
        "atol": config.atol,
        "rtol": config.rtol,
    }
    tolerance = f"|diff| <= {config.atol:g} + {config.rtol:g} x |reference|"
    if missing:
        listed = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        return Check(name, False, f"{len(missing)} of {len(reference)} {what} missing: {listed}", measured)
    if differing:
        return Check(
            name,
            False,
            f"{len(differing)} of {len(reference)} {what} differ, largest |diff| {worst:.3g} "
            f"in {worst_name} ({tolerance})",
            measured,
        )
    return Check(
        name, True, f"{len(reference)} {what} match, largest |diff| {worst:.3g} ({tolerance})", measured
    )


def compare_numbers(
    name: str, what: str, reference: Sequence[float], resumed: Sequence[float], config: DrillConfig
) -> Check:
    """Scalars (learning rates per parameter group) within the same tolerance."""
    arrays = {f"{what}[{i}]": np.asarray(v) for i, v in enumerate(reference)}
    check = compare_arrays(
        name, what, arrays, {f"{what}[{i}]": np.asarray(v) for i, v in enumerate(resumed)}, config
    )
    numbers = {"reference": list(reference), "resumed": list(resumed)}
    if len(reference) != len(resumed):
        return Check(name, False, f"{len(resumed)} {what} against {len(reference)} in the reference", numbers)
    return Check(
        check.name,
        check.passed,
        f"{check.detail}: {_short(resumed)} against {_short(reference)}",
        {**check.measured, **numbers},
    )


def compare_ids(
    name: str, reference: Mapping[int, Sequence[int]], resumed: Mapping[int, Sequence[int]]
) -> Check:
    """Each rank's next sample ids, exactly."""
    differing = [
        rank
        for rank in sorted(set(reference) | set(resumed))
        if list(reference.get(rank, ())) != list(resumed.get(rank, ()))
    ]
    measured = {"differing_ranks": differing, "reference": {str(r): list(v) for r, v in reference.items()}}
    if differing:
        rank = differing[0]
        return Check(
            name,
            False,
            f"rank {rank} reads {_short(resumed.get(rank, []))} next, the uninterrupted run "
            f"{_short(reference.get(rank, []))}",
            {**measured, "resumed": {str(r): list(v) for r, v in resumed.items()}},
        )
    count = sum(len(v) for v in reference.values())
    return Check(name, True, f"the same {count} sample ids next on {len(reference)} rank(s)", measured)


def partition(name: str, saved: Mapping[int, Sequence[int]], restored: Mapping[int, Sequence[int]]) -> Check:
    """After a topology change: the new ranks' next ids are disjoint and together are the
    examples the saved layout would have read next (nothing dropped, nothing read twice)."""
    before = [i for rank in sorted(saved) for i in saved[rank]]
    after = [i for rank in sorted(restored) for i in restored[rank]]
    repeated = sorted({i for i in after if after.count(i) > 1})
    dropped, added = sorted(set(before) - set(after)), sorted(set(after) - set(before))
    measured = {
        "saved_ranks": len(saved),
        "restored_ranks": len(restored),
        "per_rank": {str(rank): len(ids) for rank, ids in restored.items()},
        "repeated": repeated,
        "dropped": dropped,
        "added": added,
    }
    if repeated or dropped or added:
        return Check(
            name,
            False,
            f"{len(restored)} ranks read next: {len(repeated)} ids twice, {len(dropped)} of the saved "
            f"layout's next ids by no rank, {len(added)} it would not have read",
            measured,
        )
    return Check(
        name,
        True,
        f"the {len(before)} examples {len(saved)} ranks would read next are split over {len(restored)} "
        f"ranks, each once ({', '.join(str(len(restored[r])) for r in sorted(restored))} per rank)",
        measured,
    )


def boundary(name: str, step: int, consumed: int, examples_per_update: int) -> Check:
    """A checkpoint at a completed update: its data cursor is whole updates, not a half window."""
    measured = {"step": step, "consumed": consumed, "examples_per_update": examples_per_update}
    if consumed != step * examples_per_update:
        return Check(
            name,
            False,
            f"step {step} with {consumed} examples consumed: not {step} x {examples_per_update} "
            f"(a cursor {consumed - step * examples_per_update:+d} examples off an update boundary)",
            measured,
        )
    return Check(
        name, True, f"step {step}, {consumed} examples consumed = {step} x {examples_per_update}", measured
    )


def budget(window_s: float, save_s: float, margin_s: float) -> float:
    """T_window + T_save + T_margin: the shortest warning that fits the measured path."""
    return window_s + save_s + margin_s


def memory(name: str, peaks_mib: Mapping[int, float], budget_mib: float) -> Check:
    """Each restoring rank's peak resident memory, against a budget when one is set."""
    if not peaks_mib:
        return Check(name, False, "no restoring rank's memory could be read", {})
    worst_rank = max(peaks_mib, key=lambda r: peaks_mib[r])
    worst = peaks_mib[worst_rank]
    measured = {
        "peak_mib": {str(r): round(v, 1) for r, v in peaks_mib.items()},
        "budget_mib": budget_mib or None,
    }
    if budget_mib and worst > budget_mib:
        return Check(
            name,
            False,
            f"rank {worst_rank} peaked at {worst:.0f} MiB, over the {budget_mib:g} MiB budget",
            measured,
        )
    said = f"within the {budget_mib:g} MiB budget" if budget_mib else "no budget set"
    return Check(name, True, f"peak restore memory {worst:.0f} MiB (rank {worst_rank}), {said}", measured)


def _short(values: Sequence[Any], shown: int = 4) -> str:
    items = [f"{v:.6g}" if isinstance(v, float) else str(v) for v in list(values)[:shown]]
    return "[" + ", ".join(items) + (", ...]" if len(values) > shown else "]")
