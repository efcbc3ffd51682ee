"""The whole-run signals of one step, judged once per step, in step order."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.incidents import GroupingConfig
from policies.nonfinite import NonfiniteConfig, nonfinite_findings
from policies.spike import SpikeConfig, SpikeState, observe_spike
from policies.types import Finding, StepPoint


@dataclass(frozen=True)
class SeriesConfig:
    """Every step-level policy's config, nested; each documents its own defaults."""

    nonfinite: NonfiniteConfig = field(default_factory=NonfiniteConfig)
    loss_spike: SpikeConfig = field(default_factory=SpikeConfig)
    grouping: GroupingConfig = field(default_factory=GroupingConfig)


@dataclass(frozen=True)
class SeriesState:
    loss_spike: SpikeState

    @classmethod
    def empty(cls, config: SeriesConfig) -> SeriesState:
        return cls(loss_spike=SpikeState.empty(config.loss_spike))


def observe_step(
    state: SeriesState, point: StepPoint, config: SeriesConfig
) -> tuple[SeriesState, tuple[Finding, ...]]:
    """Judge one step of the run; return the new state and what was found."""
    findings = nonfinite_findings(point, config.nonfinite)
    loss_spike, spikes = observe_spike(state.loss_spike, point, "loss", config.loss_spike)
    return SeriesState(loss_spike=loss_spike), findings + spikes
