"""The service's periodic work, on APScheduler 3 in the serving process.

Hang checks run on the service's own clock (a hung run sends no steps that could trigger
them), and device and link error rates are compared with peers over minutes, not samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC

from apscheduler.schedulers.background import BackgroundScheduler

from monitor.service import Service

log = logging.getLogger("runhealth.scheduler")


@dataclass(frozen=True)
class ScheduleConfig:
    """Periods of the service's jobs.

    - ``hang_check_s`` 5: the hook's heartbeat interval, so a hang is seen within one
      heartbeat of its timeout; windows that nothing newer will release are judged as often.
    - ``peer_compare_s`` 300: error rates over five minutes; a single error in one 10 s
      sample interval is not a burst.
    - ``canary_s`` 30: how often due canary schedules are issued and rounds that lost a rank
      are judged; the schedules' own intervals (minutes to hours) are kept in the store.
    """

    hang_check_s: float = 5.0
    peer_compare_s: float = 300.0
    canary_s: float = 30.0

    def __post_init__(self) -> None:
        if self.hang_check_s <= 0 or self.peer_compare_s <= 0 or self.canary_s <= 0:
            raise ValueError("ScheduleConfig: periods must be positive")


def _guarded(name: str, job: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        try:
            job()
        except Exception:  # a failing check must not stop the schedule; the next run retries
            log.exception("scheduled job %s failed", name)

    return run


def start_scheduler(service: Service, config: ScheduleConfig) -> BackgroundScheduler:
    scheduler = BackgroundScheduler(timezone=UTC)
    jobs = {
        "hang_check": (service.check_hangs, config.hang_check_s),
        "judge_waiting": (service.judge_waiting, config.hang_check_s),
        "peer_compare": (service.compare_peers, config.peer_compare_s),
        "canary_schedule": (service.canaries.schedule_due, config.canary_s),
        "canary_rounds": (service.canaries.judge_waiting, config.canary_s),
    }
    for name, (job, seconds) in jobs.items():
        scheduler.add_job(
            _guarded(name, job), "interval", seconds=seconds, id=name, max_instances=1, coalesce=True
        )
    scheduler.start()
    return scheduler
