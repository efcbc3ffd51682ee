import pytest

from policies.hangs import Beat, HangConfig, PhaseTimeouts, hang_finding, learned_timeouts, stuck_beats

CONFIG = HangConfig(min_timeout_s=10.0, heartbeat_interval_s=1.0, min_silence_s=0.0)
TEN = PhaseTimeouts(10.0, 10.0, 10.0)


def beat(rank: int, phase: str = "forward", since: float = 95.0, heard: float = 99.5, step: int = 7) -> Beat:
    return Beat(rank=rank, node=f"n{rank}", step=step, phase=phase, phase_since=since, received_at=heard)


def test_timeouts_are_learned_from_step_times_with_a_floor_per_phase() -> None:
    quick = learned_timeouts([0.04] * 100, HangConfig())
    assert quick == PhaseTimeouts(training=9.0, between=60.0, saving=1800.0)
    slow = learned_timeouts([2.0] * 100, HangConfig())
    assert (slow.training, slow.between) == (pytest.approx(20.0), 60.0)
    assert learned_timeouts([2.0, 3.0], HangConfig()) == PhaseTimeouts(
        60.0, 60.0, 1800.0
    )  # too few to learn from
    assert quick.of("backward") == 9.0 and quick.of("data") == quick.of("idle") == 60.0
    assert quick.of("saving") == 1800.0


def test_a_save_as_long_as_one_the_run_already_survived_is_no_hang() -> None:
    """A 5-minute save between two windows of 40 ms steps: named when it is the run's first
    that long, not when the run had one before (its longest window, 320 s)."""
    first = learned_timeouts([0.04] * 100, HangConfig())
    again = learned_timeouts([0.04] * 100, HangConfig(), longest_s=320.0)
    assert again.between == pytest.approx(480.0) and again.training == 9.0
    saving = [beat(0, "data", since=-200.0), beat(1, "data", since=-200.0)]  # 300 s between windows
    assert hang_finding(saving, 2, 100.0, first, "i", HangConfig()) is not None
    assert hang_finding(saving, 2, 100.0, again, "i", HangConfig()) is None


def test_a_declared_save_longer_than_any_step_is_no_hang_but_a_stuck_step_is() -> None:
    timeouts = learned_timeouts([0.04] * 100, HangConfig())
    declared = [beat(0, "saving", since=-200.0), beat(1, "saving", since=-200.0)]  # 300 s saving
    assert hang_finding(declared, 2, 100.0, timeouts, "i", HangConfig()) is None
    stuck = [beat(0, "backward", since=90.0), beat(1, "data", since=90.0)]  # 10 s in one phase
    finding = hang_finding(stuck, 2, 100.0, timeouts, "i", HangConfig())
    assert finding is not None and [s["rank"] for s in finding.evidence["stuck"]] == [0]
    assert finding.threshold == 9.0 and "timeout 9 s" in finding.message


def test_all_ranks_moving_is_no_hang() -> None:
    assert (
        hang_finding([beat(r) for r in range(4)], 4, now=100.0, timeouts=TEN, incarnation="i", config=CONFIG)
        is None
    )


def test_just_under_and_just_over_the_timeout() -> None:
    beats = [beat(0, since=90.5), beat(1)]
    assert hang_finding(beats, 2, now=100.0, timeouts=TEN, incarnation="i", config=CONFIG) is None
    beats = [beat(0, since=89.5), beat(1)]
    finding = hang_finding(beats, 2, now=100.0, timeouts=TEN, incarnation="i", config=CONFIG)
    assert finding is not None and [s["rank"] for s in finding.evidence["stuck"]] == [0]


def test_a_held_rank_waits_on_purpose_but_a_silent_one_is_still_missing() -> None:
    held = [beat(r, "held", since=10.0) for r in range(4)]  # paused by a hold for 90 s
    assert hang_finding(held, 4, now=100.0, timeouts=TEN, incarnation="i", config=CONFIG) is None
    held[3] = beat(3, "held", since=10.0, heard=90.0)
    finding = hang_finding(held, 4, now=100.0, timeouts=TEN, incarnation="i", config=CONFIG)
    assert finding is not None and finding.evidence["stuck"] == [] and len(finding.evidence["missing"]) == 1


def test_the_rank_in_another_phase_is_the_suspect() -> None:
    beats = [
        beat(0, "backward", since=50.0),
        beat(1, "backward", since=50.0),
        beat(2, "forward", since=50.0),
        beat(3, "backward", since=50.0),
    ]
    finding = hang_finding(beats, 4, now=100.0, timeouts=TEN, incarnation="i", config=CONFIG)
    assert finding is not None
    assert finding.evidence["suspects"] == [2] and finding.rank == 2
    assert finding.evidence["wants"] == "stack_dumps"
    assert "stuck" in finding.message and "rank 2 in forward" in finding.message


def test_a_silent_rank_and_a_never_seen_rank_are_missing() -> None:
    beats = [beat(0), beat(1, heard=90.0, step=5)]
    finding = hang_finding(beats, 3, now=100.0, timeouts=TEN, incarnation="i", config=CONFIG)
    assert finding is not None
    assert [m["rank"] for m in finding.evidence["missing"]] == [1, 2]
    assert finding.step == 5
    assert finding.evidence["suspects"] == [1]


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        HangConfig(min_timeout_s=0)


def test_silence_uses_the_runs_stated_heartbeat_with_a_floor() -> None:
    config = HangConfig(heartbeat_interval_s=5.0, min_silence_s=10.0)
    assert config.silence_s() == 15.0
    assert config.silence_s(1.0) == 10.0  # three quick beats late is not silence yet
    assert config.silence_s(20.0) == 60.0
    beats = [beat(0), beat(1, heard=88.0)]  # 12 s since rank 1 was heard
    assert (
        hang_finding(beats, 2, 100.0, PhaseTimeouts(30.0, 30.0, 30.0), "i", config, stated_heartbeat_s=1.0)
        is not None
    )
    assert (
        hang_finding(beats, 2, 100.0, PhaseTimeouts(30.0, 30.0, 30.0), "i", config, stated_heartbeat_s=5.0)
        is None
    )


def test_a_rank_not_yet_heard_at_start_up_is_not_missing_until_the_timeout() -> None:
    beats = [beat(0), beat(1)]
    assert (
        hang_finding(beats, 3, now=100.0, timeouts=TEN, incarnation="i", config=CONFIG, started_at=95.0)
        is None
    )
    late = hang_finding(beats, 3, now=100.0, timeouts=TEN, incarnation="i", config=CONFIG, started_at=85.0)
    assert late is not None and [m["rank"] for m in late.evidence["missing"]] == [2]


def test_a_rank_that_moved_on_since_its_newest_beat_is_not_stuck_but_the_others_still_are() -> None:
    """``stuck_beats`` names the beats past their timeout; a rank the caller found a newer
    window of (``moved_on``) drops out of the finding, the rest stay in it."""
    beats = [beat(0, since=80.0), beat(1, since=80.0), beat(2)]
    assert [b.rank for b in stuck_beats(beats, 100.0, TEN, CONFIG)] == [0, 1]
    finding = hang_finding(beats, 3, 100.0, TEN, "i", CONFIG, moved_on=[0])
    assert finding is not None and [s["rank"] for s in finding.evidence["stuck"]] == [1]
    assert hang_finding(beats, 3, 100.0, TEN, "i", CONFIG, moved_on=[0, 1]) is None


def test_a_five_minute_compile_is_no_hang_but_a_forward_that_long_is() -> None:
    """Heartbeats say ``compiling`` while ``torch.compile`` works (``collectors.compiles``): timed
    as a declared save, not as the training phase it interrupted."""
    timeouts = learned_timeouts([0.04] * 100, HangConfig())
    assert timeouts.of("compiling") == timeouts.of("saving") == 1800.0
    compiling = [beat(0, "compiling", since=-200.0), beat(1, "compiling", since=-200.0)]  # 300 s
    assert hang_finding(compiling, 2, 100.0, timeouts, "i", HangConfig()) is None
    forward = [beat(0, "forward", since=-200.0), beat(1, "compiling", since=-200.0)]
    finding = hang_finding(forward, 2, 100.0, timeouts, "i", HangConfig())
    assert finding is not None and [s["rank"] for s in finding.evidence["stuck"]] == [0]


def compiling(rank: int, busy_at: float | None, since: float = -200.0) -> Beat:
    return Beat(rank, f"n{rank}", 7, "compiling", since, 99.5, cpu_busy_at=busy_at)


def test_a_compile_whose_processes_use_no_cpu_for_two_minutes_is_stuck() -> None:
    """300 s compiling (under the 30-minute floor). Busy 119 s ago: still compiling; 121 s ago:
    a compile that itself hangs, named with how long its processes have been idle."""
    timeouts = learned_timeouts([0.04] * 100, HangConfig())
    working = [compiling(0, busy_at=-19.0), compiling(1, busy_at=-19.0)]
    assert hang_finding(working, 2, 100.0, timeouts, "i", HangConfig()) is None
    idle = [compiling(0, busy_at=-21.0), compiling(1, busy_at=-21.0)]
    finding = hang_finding(idle, 2, 100.0, timeouts, "i", HangConfig())
    assert finding is not None and [s["rank"] for s in finding.evidence["stuck"]] == [0, 1]
    assert finding.threshold == 120.0 and "timeout 120 s" in finding.message
    assert "rank 0 in compiling for 300 s, its processes using no CPU for 121 s" in finding.message
    assert finding.evidence["stuck"][0]["cpu_idle_s"] == 121.0


def test_an_idle_compile_waiting_on_a_busy_peers_compile_is_not_stuck() -> None:
    """Rank 1 waits for rank 0's compile (a shared cache's lock, a compiler collective): no CPU
    of its own, but the run's compiler is at work. Once rank 0 is idle too, both are named."""
    timeouts = learned_timeouts([0.04] * 100, HangConfig())
    waiting = [compiling(0, busy_at=95.0), compiling(1, busy_at=-150.0)]
    assert stuck_beats(waiting, 100.0, timeouts, HangConfig()) == []
    both = [compiling(0, busy_at=-50.0), compiling(1, busy_at=-150.0)]
    assert [b.rank for b in stuck_beats(both, 100.0, timeouts, HangConfig())] == [0, 1]


def test_a_compile_heartbeat_without_cpu_use_keeps_the_thirty_minutes() -> None:
    """A hook that cannot read CPU use (not Linux, an older hook) sends no ``cpu_busy_at``."""
    timeouts = learned_timeouts([0.04] * 100, HangConfig())
    silent = [compiling(0, busy_at=None), compiling(1, busy_at=None)]
    assert hang_finding(silent, 2, 100.0, timeouts, "i", HangConfig()) is None
    long = [compiling(0, busy_at=None, since=-1701.0), compiling(1, busy_at=None, since=-1701.0)]
    finding = hang_finding(long, 2, 100.0, timeouts, "i", HangConfig())
    assert finding is not None and finding.threshold == 1800.0
