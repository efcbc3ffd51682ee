"""Two judges of one run at once (replicas whose leases overlapped for a moment): the windows go
to the first to claim them, and the incident is opened once."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.config import ServiceConfig
from monitor.service import Service
from monitor.store import models
from monitor.store.db import create_store_engine
from monitor.store.leases import RunLeases
from tests.support import ADMIN_TOKEN, RunHandle, both_backends, post, spiky_windows

INCIDENT = models.table_of(models.Incident)
SUMMARY = models.table_of(models.StepSummary)


@both_backends
def test_windows_judged_by_another_judge_meanwhile_are_not_judged_again(
    store: Engine, run: RunHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ServiceConfig(admin_token=ADMIN_TOKEN)
    storing = Service(store, config)
    storing.replicate(RunLeases(store.url, "storing"))  # holds no lease: stores, judges nothing
    post(storing, run, [*spiky_windows(range(1, 65)), *spiky_windows(range(65, 76), spike=65)])
    first = Service(create_store_engine(store.url), config)
    second = Service(create_store_engine(store.url), config)
    chosen = second.policies._ready

    def first_judges_meanwhile(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        ready = chosen(*args, **kwargs)  # the second judge has chosen its windows...
        first.policies.judge(run.id)  # ...when the first judges and commits them
        return ready

    monkeypatch.setattr(second.policies, "_ready", first_judges_meanwhile)
    assert second.policies.judge(run.id) == []
    with store.connect() as connection:
        incidents = connection.execute(sa.select(INCIDENT.c.kind, INCIDENT.c.first_step)).all()
        unjudged = connection.execute(
            sa.select(sa.func.count()).where(SUMMARY.c.judged.is_(False))
        ).scalar_one()
    assert [tuple(i) for i in incidents] == [("spike", 65)]
    assert unjudged == 0
    # The second judge's state was dropped (it went past windows it did not judge) and is
    # rebuilt from the store at its next pass, which finds nothing left to judge.
    monkeypatch.undo()
    assert second.policies.judge(run.id) == []
    for service in (first, second):
        service.engine.dispose()
