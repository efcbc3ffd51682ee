"""Per-rank policies: loss per token and stragglers, judged within data-parallel groups."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monitor.judge.readings import rank_window
from policies.numerics import nonfinite_findings
from policies.rank_loss import RankLossConfig, RankLossState, observe_rank_loss
from policies.rank_nonfinite import RankNonfiniteConfig, rank_nonfinite_findings
from policies.stragglers import (
    StragglerConfig,
    StragglerState,
    _Nearest,
    observe_stragglers,
    straggler_scores,
)
from policies.types import StepPoint


def records(
    step: int,
    ranks: int = 4,
    loss: dict[int, float] | None = None,
    slow: dict[int, float] | None = None,
    tp: int = 1,
) -> list[dict]:
    loss, slow = loss or {}, slow or {}
    jitter = [1.0, 1.01, 0.99, 1.005, 0.995, 1.0, 1.002, 0.998]
    out = []
    for rank in range(ranks):
        factor = slow.get(rank, 1.0) * jitter[(rank + step) % len(jitter)]
        out.append(
            {
                "rank": rank,
                "step": step,
                "attempt": step,
                "incarnation": "i",
                "tp_rank": rank % tp,
                "loss_sum": 100 * loss.get(rank, 2.0 + 0.02 * jitter[(rank * 3 + step) % 8]),
                "tokens": 100,
                "data_wait_s": 0.001,
                "forward_s": 0.010 * factor,
                "backward_s": 0.020,
                "optimizer_s": 0.005 * factor,
                "node": f"n{rank}",
                "device_uuid": f"GPU-{rank}",
                "sample_ids": [step * 10 + rank],
            }
        )
    return out


def test_groups_are_replicas_of_one_shard() -> None:
    window = rank_window(records(1, ranks=8, tp=2))
    groups = [sorted(window.ranks[m].tolist()) for m in window.peer_groups()]
    assert groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert list(rank_window(records(1, ranks=2)).peer_groups()) == []


def run_rank_loss(windows: list[list[dict]], config: RankLossConfig | None = None) -> list[list]:
    config = config or RankLossConfig()
    state, out = RankLossState.empty(config), []
    for w in windows:
        state, found = observe_rank_loss(state, rank_window(w), config)
        out.append(found)
    return out


def test_one_ranks_corrupted_batch_is_named_with_its_batch() -> None:
    windows = [records(s) for s in range(1, 40)] + [records(40, loss={2: 7.0})]
    found = run_rank_loss(windows)
    assert all(f == () for f in found[:-1])
    (finding,) = found[-1]
    assert (finding.rank, finding.node, finding.device, finding.step) == (2, "n2", "GPU-2", 40)
    assert finding.evidence["sample_ids"] == [402]


def test_a_rank_below_twice_its_peers_loss_is_noise() -> None:
    # +90% sits above the healthy per-rank noise this toy world learns, below the floor.
    found = run_rank_loss([records(s) for s in range(1, 60)] + [records(60, loss={2: 3.8})])
    assert found[-1] == ()
    found = run_rank_loss([records(s) for s in range(1, 60)] + [records(60, loss={2: 4.2})])
    assert [f.rank for f in found[-1]] == [2]


def test_rank_loss_waits_for_warm_up_and_ignores_zero_token_ranks() -> None:
    found = run_rank_loss([records(1, loss={2: 7.0})])
    assert found == [()]
    window = records(30, loss={2: 7.0})
    window[2]["tokens"] = 0
    found = run_rank_loss([records(s) for s in range(1, 30)] + [window])
    assert found[-1] == ()


def test_two_ranks_cannot_tell_which_is_off() -> None:
    found = run_rank_loss([records(s, ranks=2) for s in range(1, 30)] + [records(30, ranks=2, loss={1: 9.0})])
    assert all(f == () for f in found)


def run_stragglers(windows: list[list[dict]], config: StragglerConfig | None = None):
    config = config or StragglerConfig()
    state, out = StragglerState(), []
    for w in windows:
        state, found = observe_stragglers(state, rank_window(w), config)
        out.append(found)
    return state, out


@pytest.mark.parametrize("slowdown", [1.10, 1.15, 1.30])
def test_a_slow_rank_is_flagged_once_within_fifty_windows(slowdown: float) -> None:
    _state, found = run_stragglers([records(s, slow={3: slowdown}) for s in range(1, 80)])
    flagged = [(i + 1, f.rank) for i, fs in enumerate(found) for f in fs]
    assert len(flagged) == 1
    step, rank = flagged[0]
    assert rank == 3 and step <= 50
    (finding,) = found[step - 1]
    assert finding.node == "n3" and finding.signal in ("forward_s", "optimizer_s")
    # the smoothed ratio at detection: past the threshold, not yet at the full slowdown
    assert StragglerConfig().slow_ratio <= finding.value <= slowdown * 1.02


def test_the_state_holds_the_ranks_seen_not_every_id_below_the_largest() -> None:
    """Rank ids 0, 1, 2 and 999,999: four entries per array, and the slow one named by its id
    (arrays indexed by id grew the service by 127 MB for one record of rank 1,000,000)."""
    renamed = {3: 999_999}
    windows = [
        [{**r, "rank": renamed.get(r["rank"], r["rank"])} for r in records(s, slow={3: 1.3})]
        for s in range(1, 80)
    ]
    state, found = run_stragglers(windows)
    assert list(state.rank_ids) == [0, 1, 2, 999_999] and len(state.observed) == 4
    assert all(len(values) == 4 for values in state.smoothed.values())
    assert [f.rank for fs in found for f in fs] == [999_999] and state.flagged == {999_999}


def test_healthy_ranks_with_jitter_are_not_stragglers() -> None:
    state, found = run_stragglers([records(s) for s in range(1, 200)])
    assert all(f == () for f in found)
    assert max(s.ratio for s in straggler_scores(state, StragglerConfig())) < 1.03


def test_a_single_pause_does_not_make_a_straggler() -> None:
    windows = [records(s) for s in range(1, 100)]
    windows[60][1]["forward_s"] = 5.0  # a 500x stall, once
    _, found = run_stragglers(windows)
    assert all(f == () for f in found)


def test_a_phase_under_two_milliseconds_is_not_judged_on_its_own() -> None:
    """A data wait of tens of microseconds is scheduler noise: 10x its peers' is no straggler
    (the issue's false warnings on 4-rank CPU runs were nearly all in a 40-66 us data wait)."""
    windows = [records(s) for s in range(1, 80)]
    for w in windows:
        for record in w:
            record["data_wait_s"] = 0.00005
        w[0]["data_wait_s"] = 0.0005  # 10x, under the floor
    _, found = run_stragglers(windows)
    assert all(f == () for f in found)


def test_a_phase_under_two_percent_of_the_step_is_not_judged_on_its_own() -> None:
    windows = [records(s) for s in range(1, 80)]
    for w in windows:
        for record in w:
            record["backward_s"] = 0.3  # the step is ~0.32 s: a 3 ms data wait is under 1%
            record["data_wait_s"] = 0.003
        w[0]["data_wait_s"] = 0.03
    _, found = run_stragglers(windows)
    assert all(f == () for f in found)


def test_a_slow_data_wait_over_the_floor_is_judged() -> None:
    windows = [records(s) for s in range(1, 80)]
    for w in windows:
        for record in w:
            record["data_wait_s"] = 0.003  # ~8% of the step
        w[0]["data_wait_s"] = 0.006
    _, found = run_stragglers(windows)
    flagged = [f for fs in found for f in fs]
    assert [(f.rank, f.signal) for f in flagged] == [(0, "data_wait_s")]


# The backward's wall time beyond its CPU time on a loaded 4-rank CPU run: the all-reduce and
# the wait for a core (measured: 10 ms against 0.65 ms of CPU), so the time outside the
# backward is ~22% of the step, as there.
BACKWARD_WAIT_S = 0.033
STEP_S = 0.0351 + BACKWARD_WAIT_S


def waiting(step: int, wait: dict[int, float], ranks: int = 4) -> list[dict]:
    """A CPU window of ranks whose phases are thread CPU time, with their wall times: a rank
    that sleeps ``wait[rank]`` seconds in its forward uses no more CPU, and under DDP its
    peers wait that long in their backward (the gradient all-reduce)."""
    out = records(step, ranks)
    longest = max(wait.values(), default=0.0)
    for record in out:
        slept = wait.get(record["rank"], 0.0)
        record["data_wait_s"] = 0.0001
        record["forward_wall_s"] = record["forward_s"] + slept
        record["backward_wall_s"] = record["backward_s"] + BACKWARD_WAIT_S + longest - slept
        record["optimizer_wall_s"] = record["optimizer_s"]
    return out


@pytest.mark.parametrize(("slowdown", "within"), [(0.30, 20), (0.10, 50)])
def test_a_rank_that_waits_is_named_by_its_wall_time(slowdown: float, within: int) -> None:
    """Sleeping ``slowdown`` of its step changes no thread CPU time, and the whole step's
    wall time is alike on every rank (the peers wait for it): the wall time outside the
    backward names it."""
    windows = [waiting(s, {}) for s in range(1, 40)]
    windows += [waiting(s, {2: slowdown * STEP_S}) for s in range(40, 140)]
    _, found = run_stragglers(windows)
    flagged = [(i + 1, f) for i, fs in enumerate(found) for f in fs]
    assert len(flagged) == 1
    step, finding = flagged[0]
    assert finding.rank == 2 and finding.signal == "own_wall_s" and step - 40 <= within
    assert "wall time outside its backward" in finding.message and finding.threshold == 1.35


def test_a_cpu_ranks_thread_time_is_judged_against_the_host_thresholds() -> None:
    """Ranks that send wall times share a host: 21% more CPU time in the forward (as a healthy
    rank of the nanoGPT-style test trainer reached on the 2-core CI machine) is no straggler;
    40% is, at the host threshold."""
    for slowdown, named in ((1.21, []), (1.40, [(3, "forward_s", 1.3)])):
        windows = [waiting(s, {}) for s in range(1, 120)]
        for w in windows:
            w[3]["forward_s"] *= slowdown
            w[3]["forward_wall_s"] = w[3]["forward_s"]  # and its wall time with it
        _, found = run_stragglers(windows)
        assert [(f.rank, f.signal, f.threshold) for fs in found for f in fs] == named


def test_a_rank_wavering_at_the_threshold_is_one_episode() -> None:
    """Slow stretches with short normal ones between them: one straggler, not one per stretch
    (it recovers only after staying below the lower threshold for ``recover_windows``)."""
    windows = []
    for cycle in range(4):
        start = 1 + cycle * 45
        windows += [records(s, slow={1: 1.12}) for s in range(start, start + 30)]
        windows += [records(s) for s in range(start + 30, start + 45)]
    _, found = run_stragglers(windows)
    assert [f.kind for fs in found for f in fs] == ["straggler"]
    _, found = run_stragglers(windows, StragglerConfig(recover_windows=1))
    assert [f.kind for fs in found for f in fs][:3] == ["straggler", "straggler_recovered", "straggler"]


def test_a_recovered_rank_can_be_flagged_again() -> None:
    windows = [records(s, slow={1: 1.5}) for s in range(1, 60)]
    windows += [records(s) for s in range(60, 260)]
    windows += [records(s, slow={1: 1.5}) for s in range(260, 320)]
    _, found = run_stragglers(windows)
    kinds = [f.kind for window in found for f in window]
    assert kinds == ["straggler", "straggler_recovered", "straggler"]


def test_straggler_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        StragglerConfig(slow_ratio=0.9)
    with pytest.raises(ValueError):
        StragglerConfig(phases=("compile",))
    with pytest.raises(ValueError, match="recover_windows"):
        StragglerConfig(recover_windows=0)
    with pytest.raises(ValueError, match="min_phase_s"):
        StragglerConfig(min_phase_s=-1)
    with pytest.raises(ValueError, match="wall_recover_ratio"):
        StragglerConfig(wall_slow_ratio=1.2, wall_recover_ratio=1.3)
    with pytest.raises(ValueError, match="host_slow_ratio"):
        StragglerConfig(host_slow_ratio=1.0)
    with pytest.raises(ValueError):
        RankLossConfig(min_peers=2)


def test_missing_timings_are_skipped() -> None:
    windows = [records(s) for s in range(1, 40)]
    for w in windows:
        w[2]["forward_s"] = None
    state, found = run_stragglers(windows)
    assert all(f == () for f in found)
    assert not math.isnan(float(np.sum(state.smoothed["forward"])))


rank_values = st.sampled_from(
    [None, 0.0, -0.0, 1.0, 250.0, -3.0, math.nan, math.inf, -math.inf, 1e308, 1e-308]
)


@settings(database=None)
@given(st.lists(st.tuples(rank_values, rank_values), min_size=1, max_size=12))
def test_the_nonfinite_ranks_are_those_the_rule_names_rank_by_rank(values: list[tuple]) -> None:
    """Only the ranks whose loss may be nonfinite are put to the rule: the same ranks as when
    every rank's own loss is put to it."""
    rows = [
        {"rank": r, "step": 3, "attempt": 3, "incarnation": "i", "loss_sum": loss_sum, "tokens": tokens}
        for r, (loss_sum, tokens) in enumerate(values)
    ]
    named = {f.rank for f in rank_nonfinite_findings(rank_window(rows), RankNonfiniteConfig(100))}
    expected = set()
    for rank, (loss_sum, tokens) in enumerate(values):
        if loss_sum is None:
            continue  # no loss logged on this rank: nothing to call nonfinite
        total, count = (math.nan if v is None else v for v in (loss_sum, tokens))
        loss = total / count if count > 0 else (total if not math.isfinite(total) else None)
        if nonfinite_findings(StepPoint(step=3, loss=loss)):
            expected.add(rank)
    assert named == expected


def test_a_window_closed_by_a_crash_before_its_loss_is_no_nan() -> None:
    """A trainer that raised inside a window (before ``rh.loss``) closes it at exit with no loss
    and no tokens: not logged, not a NaN. A NaN it did log is named."""
    crashed = {"rank": 0, "step": 30, "attempt": 31, "incarnation": "i", "loss_sum": None, "tokens": None}
    assert rank_nonfinite_findings(rank_window([crashed]), RankNonfiniteConfig()) == []
    logged = [{**crashed, "rank": 1, "loss_sum": math.nan}, crashed]
    assert [f.rank for f in rank_nonfinite_findings(rank_window(logged), RankNonfiniteConfig())] == [1]


def test_a_rank_is_over_its_threshold_by_its_ratio_not_its_log() -> None:
    """A rank's worst phase is compared with its threshold as a ratio (exp of the smoothed
    log), also where the log lies within rounding of the threshold's log."""
    limits = {"forward": (1.09, 1.05), "own_wall": (1.35, 1.2)}
    edge = math.log(1.09)
    logs = [float(np.nextafter(edge, -1)), edge, float(np.nextafter(edge, 1)), edge - 1e-12, edge + 1e-12]
    logs += [0.0, 0.5, -0.2]
    smoothed = {"forward": np.array(logs), "own_wall": np.full(len(logs), math.log(1.35) - 0.01)}
    observed = np.array([20.0] * (len(logs) - 1) + [19.0])  # the last not judged yet
    nearest = _Nearest.of(smoothed, observed, limits, 20, np.arange(100, 100 + len(logs)))
    expected = {i for i, v in enumerate(logs[:-1]) if math.exp(v) >= 1.09}
    assert nearest.over() == expected
    assert nearest.score(5).phase == "own_wall" and nearest.score(6).phase == "forward"
    assert nearest.score(6).rank == 106 and not nearest.judged(len(logs) - 1)
