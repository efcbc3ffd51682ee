"""Goodput and checkpoint interval advice on ``/metrics``: computed at scrape time from the store.

Each exported run's goodput is read anew (``monitor.judge.goodput``: one index range of one
rank's step records per incarnation, and the checkpoints, canary rounds, holds and hangs), so the
cost of a scrape grows with the runs' windows; nothing is kept between scrapes. The ``cause``
label takes the eleven values of ``policies.goodput.Cause`` at most (ten badput causes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.metrics_core import Metric as Family
from sqlalchemy.engine import Connection

from monitor.judge.goodput import RunGoodput, run_goodput
from monitor.observe.metrics import names
from monitor.observe.metrics.families import family
from monitor.observe.metrics.reads import RunState
from policies.checkpoint_interval import IntervalConfig
from policies.goodput import BADPUT
from policies.hangs import HangConfig


def read_goodput(
    connection: Connection, runs: Sequence[RunState], config: IntervalConfig, hangs: HangConfig
) -> list[tuple[str, RunGoodput]]:
    return [(run.name, run_goodput(connection, run.id, config, hangs)) for run in runs]


def goodput_families(found: Sequence[tuple[str, RunGoodput]]) -> Iterator[Family]:
    ratio = family(names.RUN_GOODPUT)
    badput = family(names.RUN_BADPUT)
    current = family(names.RUN_CHECKPOINT_INTERVAL)
    advised = family(names.RUN_CHECKPOINT_INTERVAL_ADVISED)
    for run, report in found:
        result = report.goodput
        if result.ratio is not None:
            ratio.add_metric([run], result.ratio)
        for category in result.categories:
            if category.cause in BADPUT and category.seconds is not None:
                badput.add_metric([run, category.cause.value], category.seconds)
        advice = report.advice
        if advice.current is not None:
            current.add_metric([run], advice.current.interval_s)
        if advice.advised is not None:
            advised.add_metric([run], advice.advised.interval_s)
    yield from (ratio, badput, current, advised)
