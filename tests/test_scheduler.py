import threading

import pytest
from sqlalchemy.engine import Engine

from monitor.config import SchedulerConfig
from monitor.scheduler import start_scheduler
from monitor.service import Service


def test_jobs_run_on_their_period_and_a_failing_job_keeps_its_schedule(
    service: Service, store: Engine
) -> None:
    ran = threading.Event()
    calls = []

    def failing_check(among: object = None) -> list[int]:
        calls.append(1)
        if len(calls) >= 2:
            ran.set()
        raise RuntimeError("the store blinked")

    service.hangs.check = failing_check  # type: ignore[method-assign]
    scheduler = start_scheduler(service, SchedulerConfig(hang_check_s=0.05, peer_compare_s=60))
    try:
        assert ran.wait(timeout=10)
        assert {job.id for job in scheduler.get_jobs()} == {
            "hang_check",
            "judge_waiting",
            "hold_timeouts",
            "peer_compare",
            "canary_schedule",
            "canary_rounds",
            "store_retention",
        }
    finally:
        scheduler.shutdown(wait=True)


def test_config_rejects_nonpositive_periods() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(hang_check_s=0)
