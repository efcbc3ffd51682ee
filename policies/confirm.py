"""A warning-size grad-norm spike waits for the loss before it is an incident.

A grad norm's jump matters for what it does to the training: the labelled BigScience spikes
whose grad norm jumped first (tr8-104B at steps 11,447 and 8,740) had the loss follow one
logged step later, and a bigger jump (tr11-176B, 31,217) is critical at once. A clean run's
grad norm also jumps for one step with the loss untouched: llm.c's GPT-2 124M run (the
held-out set) went to 15x its median at step 8,715 with the loss up 3%, one false incident.
So a grad-norm spike below critical is held for ``SpikeConfig.confirm_rows`` rows and raised
when the loss follows (any loss finding) or the grad norm stays flagged; otherwise it is kept
as an ``info`` finding: evidence in the store, no incident.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from policies.types import Finding, Severity

Held = tuple[tuple[Finding, int], ...]
"""Grad-norm findings waiting for the loss, each with the rows it has waited."""


def confirm_grad_spikes(
    held: Held, grad: Sequence[Finding], loss: Sequence[Finding], step: int, rows: int
) -> tuple[Held, tuple[Finding, ...]]:
    """(what stays held, what is raised now) after one row whose grad-norm findings are
    ``grad`` and whose loss findings are ``loss``; ``rows`` 0 raises everything at once."""
    if rows == 0:
        return (), (*(finding for finding, _ in held), *grad)
    followed = bool(loss) or bool(grad)  # the loss moved, or the grad norm is still up
    raised: list[Finding] = []
    waiting: list[tuple[Finding, int]] = []
    for finding, waited in held:
        if followed:
            raised.append(_confirmed(finding, step))
        elif waited + 1 >= rows:
            raised.append(_noted(finding, waited + 1))
        else:
            waiting.append((finding, waited + 1))
    for finding in grad:
        if finding.severity is Severity.WARNING and finding.kind == "grad_norm_spike" and not loss:
            waiting.append((finding, 0))
        else:
            raised.append(finding)
    return tuple(waiting), tuple(raised)


def _confirmed(finding: Finding, step: int) -> Finding:
    return replace(finding, evidence={**finding.evidence, "confirmed_at": step})


def _noted(finding: Finding, rows: int) -> Finding:
    return replace(
        finding,
        severity=Severity.INFO,
        message=(
            f"{finding.message}; the loss did not follow within {rows} logged "
            f"step{'s' if rows > 1 else ''}: noted, no incident"
        ),
        evidence={**finding.evidence, "unconfirmed_rows": rows},
    )
