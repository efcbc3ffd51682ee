"""The recovery stage's settings: the decision workflow's and the quarantine actions' configs.

Kept apart from the workflow so that reading the configuration imports no store code."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.proposals import ProposalConfig
from policies.responses import ResponseConfig
from policies.retries import RetryConfig


@dataclass(frozen=True)
class ActionConfig:
    """How a quarantine is carried out.

    ``command``: a template with ``{node}``, ``{device}``, ``{run}`` and ``{reason}``, e.g.
    ``scontrol update nodename={node} state=drain reason="{reason}"`` or
    ``kubectl cordon {node}``. ``webhook``: a URL that receives the same fields as JSON.
    ``live`` False (the default) records what would be done and does nothing: taking hardware
    out of a cluster is for an operator to switch on deliberately.
    """

    command: str | None = None
    webhook: str | None = None
    live: bool = False
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.command and self.webhook:
            raise ValueError("ActionConfig: configure a command or a webhook, not both")
        if self.timeout_s <= 0:
            raise ValueError("ActionConfig.timeout_s must be positive")


@dataclass(frozen=True)
class DecisionConfig:
    """The workflow's settings.

    ``poll_interval_s`` 2: the hooks poll for directives every 2 s (collectors' default) unless
    their run-start config says otherwise, so a directive's step must be at least that far
    ahead of where the ranks are (the newest reported step moved on by the time since);
    ``margin`` 1.5 adds half an interval for a slow request. Measured with the default
    intervals (``benchmarks/approval_latency.py``): the ranks stopped within two poll intervals
    and one window of the approval, where a margin of 2 from the newest reported step took up
    to 5.6 s. ``responses``: what is done
    automatically while a proposal waits for an operator (``policies.responses``).
    """

    proposals: ProposalConfig = field(default_factory=ProposalConfig)
    retries: RetryConfig = field(default_factory=RetryConfig)
    actions: ActionConfig = field(default_factory=ActionConfig)
    responses: ResponseConfig = field(default_factory=ResponseConfig)
    poll_interval_s: float = 2.0
    margin: float = 1.5
