"""The policy registry: every default policy speaks the one protocol, computes what its rule
computes, and the per-rank nonfinite attribution (moved out of the engine) names its ranks."""

from __future__ import annotations

import math

import numpy as np

from policies import registry
from policies.canary import CanaryConfig, CanaryResult, CanaryRound, KernelResult, compare_round
from policies.devices import DeviceChange, DeviceReading, DevicesConfig, PeerRates, XidEvent, device_findings
from policies.peers import RankWindow
from policies.rank_loss import RankLossConfig, RankLossState, observe_rank_loss
from policies.rank_nonfinite import RankNonfiniteConfig, RankNonfinitePolicy
from policies.stragglers import StragglerConfig

DEVICES = DevicesConfig()


def window(loss_sum: list[float], tokens: float = 100.0, step: int = 7) -> RankWindow:
    size = len(loss_sum)
    return RankWindow(
        step=step,
        attempt=step,
        incarnation="i",
        ranks=np.arange(size, dtype=np.int64),
        groups=np.zeros(size, dtype=np.int64),
        loss_sum=np.array(loss_sum, dtype=np.float64),
        tokens=np.full(size, tokens),
        phases={},
        nodes=tuple(f"node{r}" for r in range(size)),
        devices=tuple(f"GPU-{r}" for r in range(size)),
        sample_ids=tuple([f"b{r}"] for r in range(size)),
    )


def default_rank_policies() -> tuple[registry.RankPolicy, ...]:
    return registry.rank_policies(RankNonfiniteConfig(), RankLossConfig(), StragglerConfig())


def test_the_engines_rank_policies_in_the_order_their_findings_are_recorded() -> None:
    policies = default_rank_policies()
    assert [(p.name, p.late, p.device_evidence) for p in policies] == [
        ("rank_nonfinite", True, False),
        ("rank_loss", True, False),
        ("stragglers", False, True),
    ]


def test_every_list_names_each_policy_once() -> None:
    lists: list[tuple[registry.Policy[object, object, object], ...]] = [
        default_rank_policies(),
        registry.device_policies(DEVICES),
        registry.link_policies(DEVICES),
        registry.peer_policies(DEVICES),
        (registry.canary_policy(CanaryConfig()),),
    ]
    names = [p.name for policies in lists for p in policies]
    assert len(names) == len(set(names)), names


def test_a_rank_policy_threads_its_state_as_its_rule_does() -> None:
    (_, rank_loss, _) = default_rank_policies()
    state = rank_loss.start()
    assert state == RankLossState.empty(RankLossConfig())
    windows = [window([2.0 * 100, 2.1 * 100, 1.9 * 100, 2.0 * 100], step=s) for s in range(1, 30)]
    expected = RankLossState.empty(RankLossConfig())
    for each in windows:
        state, found = rank_loss.judge(state, each)
        expected, wanted = observe_rank_loss(expected, each, RankLossConfig())
        assert found == wanted
    assert len(state.spread) == len(expected.spread) == 29


def test_a_nan_on_one_rank_names_that_rank_its_device_and_batch() -> None:
    _, found = RankNonfinitePolicy().judge(None, window([200.0, math.nan, 210.0]))
    assert [(f.kind, f.rank, f.device, f.message.split(":")[0]) for f in found] == [
        ("nonfinite", 1, "GPU-1", "rank 1")
    ]
    assert found[0].evidence == {"sample_ids": ["b1"]}


def test_a_nan_on_more_ranks_than_named_is_one_counted_finding() -> None:
    everywhere = window([math.nan] * 9)
    _, found = RankNonfinitePolicy().judge(None, everywhere)
    assert [(f.rank, f.evidence) for f in found] == [(None, {"ranks": 9})]
    _, named = RankNonfinitePolicy(RankNonfiniteConfig(max_named_ranks=9)).judge(None, everywhere)
    assert [f.rank for f in named] == list(range(9))


def test_device_and_canary_policies_give_what_their_rules_give() -> None:
    reading = DeviceReading(node="n", device="GPU-0", seq=1, time=1.0, rank=0, xids=(XidEvent(79, 1.0),))
    (rules,) = registry.device_policies(DEVICES)
    _, found = rules.judge(None, DeviceChange(None, reading, step=5))
    assert found == device_findings(None, reading, DEVICES, step=5)
    assert [f.kind for f in found] == ["device_xid"]
    (peers,) = registry.peer_policies(DEVICES)
    assert peers.judge(None, PeerRates((), (), step=5)) == (None, ())
    results = [
        CanaryResult(rank=r, node="n", device=f"GPU-{r}", stack="s", step=3, kernels={"k": KernelResult(f)})
        for r, f in enumerate(("a", "a", "a", "b"))
    ]
    comparison = registry.canary_policy(CanaryConfig())
    _, verdict = comparison.judge(None, CanaryRound(results, {}))
    assert verdict == compare_round(results, {}, CanaryConfig())
    assert verdict.rerun_wanted == (3,)
