"""The judging stage's settings: the engine's and the canary watch's configs, composed of the
policies' own (each policy's thresholds and where their defaults come from stay with it).

Kept apart from the engine so that reading the configuration imports no store code."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.batch_size import BatchConfig
from policies.canary import CanaryConfig, ScheduleConfig
from policies.checkpoint_interval import IntervalConfig
from policies.hangs import HangConfig
from policies.preemption import PreemptionConfig
from policies.rank_loss import RankLossConfig
from policies.rank_nonfinite import RankNonfiniteConfig
from policies.readiness import ReadinessConfig
from policies.restart_loop import RestartLoopConfig
from policies.series import SeriesConfig
from policies.stragglers import StragglerConfig


@dataclass(frozen=True)
class EngineConfig:
    """How the engine decides a window is ready to judge (``readiness``: the watermarks, see
    ``policies.readiness.ReadinessConfig``), and every policy's config.

    ``cached_windows``: rank records of unjudged windows kept in memory per run, so judging
    does not read back what ingest just wrote (1,024 windows; beyond that, read from the store).
    ``late_windows_kept`` and ``late_rows_kept``: the newest judged windows kept in memory per
    run, at most that many windows and that many rank records, for the records that arrive
    after their window was judged (late), so their window is not read back from the store per
    look. fleet.py --ranks 1024 sent 9,569 of 13,910 step records after their window at load 8,
    about ten windows behind: 32 windows cover that three times over. 32,768 records are 32
    windows of 1,024 ranks, two of 16,384; a record kept is about 1.1 KB, so at most about
    36 MB for a run that large, and 32 windows of a 4-rank run about 140 KB. Older windows are
    read from the store.
    ``judge_chunk``: windows judged per store transaction (256: about a tenth of a second of
    work, so a backlog never holds SQLite's write lock near its 10 s busy timeout).
    """

    series: SeriesConfig = field(default_factory=SeriesConfig)
    rank_nonfinite: RankNonfiniteConfig = field(default_factory=RankNonfiniteConfig)
    rank_loss: RankLossConfig = field(default_factory=RankLossConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    hangs: HangConfig = field(default_factory=HangConfig)
    readiness: ReadinessConfig = field(default_factory=ReadinessConfig)
    restart_loop: RestartLoopConfig = field(default_factory=RestartLoopConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    checkpoint_interval: IntervalConfig = field(default_factory=IntervalConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    cached_windows: int = 1024
    late_windows_kept: int = 32
    late_rows_kept: int = 32_768
    judge_chunk: int = 256

    def __post_init__(self) -> None:
        if self.cached_windows < 1 or self.judge_chunk < 1:
            raise ValueError("EngineConfig: cached_windows and judge_chunk must be >= 1")
        if self.late_rows_kept < 0 or self.late_windows_kept < 0:
            raise ValueError("EngineConfig: late_windows_kept and late_rows_kept must be >= 0")


@dataclass(frozen=True)
class CanaryServiceConfig:
    """``round_wait_s`` 120: a round missing ranks is judged with those it has after two
    minutes (a rank that died mid-round must not stall the verdict on the others)."""

    comparison: CanaryConfig = field(default_factory=CanaryConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    round_wait_s: float = 120.0
    poll_interval_s: float = 2.0
