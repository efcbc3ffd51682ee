"""The whole-run signals of one step, judged once per step, in step order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from policies.confirm import Held, confirm_grad_spikes
from policies.continuity import (
    ContinuityConfig,
    ContinuityState,
    after_findings,
    at_restart,
    level_at,
    level_shift_at_restart,
    lost_weights_detected,
    observe_continuity,
)
from policies.incidents import GroupingConfig
from policies.normalization import NormalizationConfig, normalization_findings
from policies.numerics import NumericsConfig, NumericsState, observe_numerics
from policies.spike import SpikeConfig, SpikeState, observe_spike
from policies.stats import median
from policies.types import Finding, StepPoint


@dataclass(frozen=True)
class SeriesConfig:
    """Every step-level policy's config, nested; each documents its own defaults."""

    loss_spike: SpikeConfig = field(default_factory=SpikeConfig)
    grad_norm_spike: SpikeConfig = field(default_factory=SpikeConfig.grad_norm)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    normalization: NormalizationConfig = field(default_factory=NormalizationConfig)
    continuity: ContinuityConfig = field(default_factory=ContinuityConfig)
    grouping: GroupingConfig = field(default_factory=GroupingConfig)


@dataclass(frozen=True)
class SeriesState:
    loss_spike: SpikeState
    grad_norm_spike: SpikeState
    numerics: NumericsState = field(default_factory=NumericsState)
    continuity: ContinuityState = field(default_factory=ContinuityState)
    held_grad: Held = ()
    """Grad-norm spikes waiting for the loss to follow (``policies.confirm``)."""

    @classmethod
    def empty(cls, config: SeriesConfig) -> SeriesState:
        return cls(
            loss_spike=SpikeState.empty(config.loss_spike),
            grad_norm_spike=SpikeState.empty(config.grad_norm_spike),
        )


def observe_step(
    state: SeriesState, point: StepPoint, config: SeriesConfig
) -> tuple[SeriesState, tuple[Finding, ...]]:
    """Judge one step of the run; return the new state and what was found."""
    noise = 0.0
    if point.restart:
        before = state.loss_spike.window
        noise = before.step_mad() if len(before) >= 10 else 0.0
        state = rewound(state, point.step)
    window = state.loss_spike.window
    level_before = window.median() if len(window) else level_at(state.continuity, point.step)
    recent = median(window.values[-5:]) if len(window) else None
    continuity, resumed = observe_continuity(
        state.continuity, point, level_before, config.continuity, recent, noise
    )
    loss_spike, spikes = observe_spike(state.loss_spike, point, "loss", config.loss_spike)
    if lost_weights_detected(resumed):
        # The jump is explained (the weights were not restored) and the old normal no longer
        # describes this run: judge what follows against itself.
        loss_spike, spikes = SpikeState.empty(config.loss_spike), ()
    spikes = tuple(_named_at_restart(f, continuity, config) for f in spikes)
    grad_norm_spike, grad_spikes = observe_spike(
        state.grad_norm_spike, point, "grad_norm", config.grad_norm_spike
    )
    numerics, numeric = observe_numerics(state.numerics, point, config.numerics)
    followed = tuple(f for f in numeric + resumed + spikes if f.signal in ("loss", "grad_norm"))
    held, grad_spikes = confirm_grad_spikes(
        state.held_grad, grad_spikes, followed, point.step, config.grad_norm_spike.confirm_rows
    )
    findings = grad_spikes + numeric + resumed + spikes + normalization_findings(point, config.normalization)
    continuity = after_findings(continuity, findings)
    return SeriesState(loss_spike, grad_norm_spike, numerics, continuity, held), findings


def noted(state: SeriesState, findings: Sequence[Finding]) -> SeriesState:
    """The series after other policies' findings about its newest step (the per-rank ones): a
    rank's spike or NaN is as much a reason for a rollback as the run's
    (``policies.continuity.after_findings``)."""
    return replace(state, continuity=after_findings(state.continuity, findings))


def _named_at_restart(finding: Finding, continuity: ContinuityState, config: SeriesConfig) -> Finding:
    """A loss level shift that began at a restart is a broken resume."""
    if finding.kind != "loss_level_shift":
        return finding
    restart = at_restart(continuity, finding.step, config.continuity)
    return finding if restart is None else level_shift_at_restart(finding, restart)


def rewound(state: SeriesState, step: int) -> SeriesState:
    """The series as it stood before ``step``: a resume from an earlier checkpoint (a rollback)
    returns to a higher loss than the abandoned steps reached, and that is not a spike."""
    return replace(
        state,
        loss_spike=SpikeState(
            window=state.loss_spike.window.before(step), tail=state.loss_spike.tail.before(step)
        ),
        grad_norm_spike=SpikeState(
            window=state.grad_norm_spike.window.before(step), tail=state.grad_norm_spike.tail.before(step)
        ),
    )
