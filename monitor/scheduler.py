"""The service's periodic work, on APScheduler 3 in the serving process.

Hang checks run on the service's own clock (a hung run sends no steps that could trigger
them), as are hold timeouts (a held run sends no steps either), and device and link error
rates are compared with peers over minutes, not samples. A replica of several runs each pass
over the runs it judges only (``Service.judged_runs``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC

from apscheduler.schedulers.background import BackgroundScheduler

from monitor.config import SchedulerConfig
from monitor.service import Service
from monitor.store import retention

log = logging.getLogger("runhealth.scheduler")


def _guarded(name: str, job: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        try:
            job()
        except Exception:  # a failing check must not stop the schedule; the next run retries
            log.exception("scheduled job %s failed", name)

    return run


def start_scheduler(service: Service, config: SchedulerConfig) -> BackgroundScheduler:
    scheduler = BackgroundScheduler(timezone=UTC)
    jobs = {
        "hang_check": (service.check_hangs, config.hang_check_s),
        "judge_waiting": (service.judge_waiting, config.hang_check_s),
        "hold_timeouts": (service.expire_holds, config.hang_check_s),
        "peer_compare": (service.compare_peers, config.peer_compare_s),
        "canary_schedule": (service.schedule_canaries, config.canary_s),
        "canary_rounds": (service.judge_canary_rounds, config.canary_s),
        "store_retention": (_retention(service), service.config.retention.check_s),
    }
    for name, (job, seconds) in jobs.items():
        scheduler.add_job(
            _guarded(name, job), "interval", seconds=seconds, id=name, max_instances=1, coalesce=True
        )
    # The days ahead are made at start too (one short transaction): a service down for longer
    # than they cover would otherwise send new records to the default partition until the
    # first retention pass.
    _guarded("partitions_ahead", _partitions_ahead(service))()
    scheduler.start()
    return scheduler


def _retention(service: Service) -> Callable[[], object]:
    return lambda: retention.maintain(service.engine, service.config.retention, service.clock())


def _partitions_ahead(service: Service) -> Callable[[], object]:
    return lambda: retention.create_ahead(service.engine, service.config.retention, service.clock())
