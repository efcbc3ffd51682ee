"""A warning-size grad-norm spike waits one row for the loss (``policies/confirm.py``): alone it
is an ``info`` finding and no incident; followed by the loss, or still up, it is a spike
incident at its own step; a critical one is an incident at once."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from monitor.judge.backtest import backtest, load_series, report_json
from policies.confirm import confirm_grad_spikes
from policies.series import SeriesConfig
from policies.spike import SpikeConfig
from policies.types import Finding, Severity

JUMP = 400


def rows(grad: dict[int, float], loss: dict[int, float]) -> list[tuple[int, float, float]]:
    """A trained run's loss near 3 and grad norm near 0.3 with a little noise, and the given
    multiples of them at some steps."""
    rng = random.Random(0)
    return [
        (
            s,
            (3.0 + rng.gauss(0, 0.01)) * loss.get(s, 1.0),
            (0.3 * math.exp(rng.gauss(0, 0.05))) * grad.get(s, 1.0),
        )
        for s in range(1, 600)
    ]


def report(
    tmp_path: Path, series: list[tuple[int, float, float]], config: SeriesConfig | None = None
) -> dict[str, Any]:
    path = tmp_path / "series.csv"
    path.write_text("step,loss,grad_norm\n" + "".join(f"{s},{x:.6f},{g:.6f}\n" for s, x, g in series))
    loaded = load_series(path, {}, None)
    return report_json(backtest(loaded, config or SeriesConfig()), loaded.notes, path)


def incidents(document: dict[str, Any]) -> list[tuple[str, str, int]]:
    return [(i["kind"], i["severity"], i["first_step"]) for i in document["incidents"]]


def test_a_lone_warning_size_grad_norm_jump_is_noted_and_opens_no_incident(tmp_path: Path) -> None:
    """llm.c's shape: the grad norm 15x its median for one step, the loss up 3%."""
    document = report(tmp_path, rows({JUMP: 15.0}, {JUMP: 1.03}))
    assert incidents(document) == []
    (noted,) = [f for f in document["findings"] if f["step"] == JUMP]
    assert (noted["kind"], noted["severity"], noted["incident"]) == ("grad_norm_spike", "info", None)
    assert "the loss did not follow within 1 logged step: noted, no incident" in noted["message"]


def test_the_same_jump_followed_by_the_loss_is_a_spike_from_the_grad_norms_step(tmp_path: Path) -> None:
    """BigScience tr8-104B's shape: the grad norm first, the loss one logged step later."""
    document = report(tmp_path, rows({JUMP: 15.0}, {JUMP + 1: 2.0}))
    assert incidents(document) == [("spike", "critical", JUMP)]
    grad = next(f for f in document["findings"] if f["kind"] == "grad_norm_spike")
    assert (grad["step"], grad["severity"]) == (JUMP, "warning")


def test_a_grad_norm_that_stays_up_is_a_spike_without_the_loss(tmp_path: Path) -> None:
    document = report(tmp_path, rows({JUMP: 15.0, JUMP + 1: 15.0}, {}))
    assert incidents(document) == [("spike", "warning", JUMP)]


def test_a_critical_size_grad_norm_jump_is_an_incident_at_once(tmp_path: Path) -> None:
    """Beyond twice the allowed excess (6x in log space: 36x), nothing waits."""
    document = report(tmp_path, rows({JUMP: 100.0}, {}))
    assert incidents(document) == [("spike", "critical", JUMP)]


def test_confirm_rows_zero_raises_the_lone_jump_as_before(tmp_path: Path) -> None:
    config = SeriesConfig(grad_norm_spike=replace(SpikeConfig.grad_norm(), confirm_rows=0))
    document = report(tmp_path, rows({JUMP: 15.0}, {JUMP: 1.03}), config)
    assert incidents(document) == [("spike", "warning", JUMP)]


def finding(step: int, severity: Severity = Severity.WARNING, kind: str = "grad_norm_spike") -> Finding:
    return Finding(step, kind, severity, "grad_norm", 4.0, 1.0, f"grad_norm at {step}")


def test_a_held_spike_waits_the_configured_rows_then_is_noted() -> None:
    held, raised = confirm_grad_spikes((), [finding(10)], [], 10, rows=2)
    assert raised == () and len(held) == 1
    held, raised = confirm_grad_spikes(held, [], [], 11, rows=2)
    assert raised == () and held[0][1] == 1
    held, raised = confirm_grad_spikes(held, [], [], 12, rows=2)
    assert held == () and [(f.step, f.severity) for f in raised] == [(10, Severity.INFO)]
    assert raised[0].evidence["unconfirmed_rows"] == 2


def test_a_loss_finding_in_the_same_row_raises_the_grad_norm_spike_at_once() -> None:
    loss = finding(10, Severity.CRITICAL, "loss_spike")
    held, raised = confirm_grad_spikes((), [finding(10)], [loss], 10, rows=1)
    assert held == () and [(f.step, f.severity) for f in raised] == [(10, Severity.WARNING)]


def test_a_held_spike_confirmed_later_says_when() -> None:
    held, _ = confirm_grad_spikes((), [finding(10)], [], 10, rows=1)
    _, raised = confirm_grad_spikes(held, [], [finding(11, Severity.CRITICAL, "loss_spike")], 11, rows=1)
    assert [(f.step, f.severity, f.evidence["confirmed_at"]) for f in raised] == [(10, Severity.WARNING, 11)]


def test_confirm_rows_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="confirm_rows"):
        SpikeConfig(confirm_rows=-1)
