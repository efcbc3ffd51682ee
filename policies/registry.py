"""How a policy plugs into the service: one protocol, and the lists of policies each judge
runs.

A policy is a frozen value with a ``name``, its ``config``, the state it keeps per run
(``start``; ``None`` for a rule without memory) and a pure ``judge`` of one typed observation:
a window's ranks, a device's or a port's new sample, a period's counter rates against peers,
a canary round. The service's judges (``monitor.judge.engine``, ``fleet``, ``canaries``) are
handed their list and run every policy in it, in order, keeping each one's state by name; none
of them names a policy. A new policy is its module (the rule, its config and its ``Policy``),
its place in a list below and its test.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from policies.canary import CanaryConfig, CanaryRound, RoundComparison, RoundVerdict
from policies.devices import (
    DeviceChange,
    DeviceRules,
    DevicesConfig,
    LinkChange,
    LinkRules,
    PeerRates,
    PeerRules,
)
from policies.peers import RankWindow
from policies.rank_loss import RankLossConfig, RankLossPolicy
from policies.rank_nonfinite import RankNonfiniteConfig, RankNonfinitePolicy
from policies.stragglers import StragglerConfig, StragglerPolicy
from policies.types import Finding

State = TypeVar("State")
Observed = TypeVar("Observed", contravariant=True)
Verdict = TypeVar("Verdict", covariant=True)


class Policy(Protocol[State, Observed, Verdict]):
    @property
    def name(self) -> str:
        """Unique within its list: the key of the state the service keeps for it."""
        ...

    @property
    def config(self) -> object: ...

    def start(self) -> State:
        """Its state for a run it has not judged yet."""
        ...

    def judge(self, state: State, observed: Observed) -> tuple[State, Verdict]: ...


class RankPolicy(Policy[Any, RankWindow, Sequence[Finding]], Protocol):
    """A policy over one window's ranks, compared with each other."""

    @property
    def late(self) -> bool:
        """Also judges records that reached the service after their window was judged (with
        the state as it stands, which a late record does not move)."""
        ...

    @property
    def device_evidence(self) -> bool:
        """Its findings are about a slow device: the service adds the device's clock-event
        reasons and its node's link errors to them."""
        ...


DevicePolicy = Policy[None, DeviceChange, Sequence[Finding]]
LinkPolicy = Policy[None, LinkChange, Sequence[Finding]]
PeerPolicy = Policy[None, PeerRates, Sequence[Finding]]
CanaryPolicy = Policy[None, CanaryRound, RoundVerdict]


def rank_policies(
    nonfinite: RankNonfiniteConfig, rank_loss: RankLossConfig, stragglers: StragglerConfig
) -> tuple[RankPolicy, ...]:
    """The engine's per-rank policies, in the order their findings are recorded."""
    return (RankNonfinitePolicy(nonfinite), RankLossPolicy(rank_loss), StragglerPolicy(stragglers))


def device_policies(config: DevicesConfig) -> tuple[DevicePolicy, ...]:
    return (DeviceRules(config),)


def link_policies(config: DevicesConfig) -> tuple[LinkPolicy, ...]:
    return (LinkRules(config),)


def peer_policies(config: DevicesConfig) -> tuple[PeerPolicy, ...]:
    return (PeerRules(config),)


def canary_policy(config: CanaryConfig) -> CanaryPolicy:
    """The round comparison: its verdict also names the golden fingerprints to keep and the
    ranks to re-run, which the canary watch acts on."""
    return RoundComparison(config)
