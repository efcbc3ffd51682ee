"""The store's status columns hold only their lifecycle's statuses: the CHECK constraints the
models declare come from the enums in ``policies``, the migrations build the same ones, and the
ingest API accepts exactly the acknowledgement statuses the lifecycle knows."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from monitor.store import migrate, models
from policies.directive_lifecycle import AckStatus, DirectiveStatus
from policies.proposal_lifecycle import ProposalStatus
from tests.support import INCARNATION, RunHandle, batch, both_backends

LIFECYCLES = {"proposals": ProposalStatus, "directives": DirectiveStatus, "directive_acks": AckStatus}


def allowed(sqltext: str) -> set[str]:
    """The quoted values of a ``status IN (...)`` check, however the backend renders it
    (PostgreSQL reflects ``status::text = ANY (ARRAY['a'::character varying, ...])``)."""
    assert "status" in sqltext, sqltext
    return set(re.findall(r"'([^']*)'", sqltext))


def status_checks(engine: Engine, table: str) -> dict[str, set[str]]:
    checks = sa.inspect(engine).get_check_constraints(table)
    return {str(c["name"]): allowed(c["sqltext"]) for c in checks}


def test_the_models_checks_come_from_the_enums() -> None:
    for table, statuses in LIFECYCLES.items():
        (check,) = [
            c for c in models.Base.metadata.tables[table].constraints if isinstance(c, sa.CheckConstraint)
        ]
        assert allowed(str(check.sqltext)) == {s.value for s in statuses}


@both_backends
def test_the_migrated_store_has_each_check_the_models_declare(store: Engine) -> None:
    for table, statuses in LIFECYCLES.items():
        assert status_checks(store, table) == {f"ck_{table}_status": {s.value for s in statuses}}


@both_backends
def test_a_status_outside_the_lifecycle_is_refused(store: Engine, run: RunHandle) -> None:
    directives = models.table_of(models.Directive)
    with pytest.raises(sa.exc.IntegrityError), store.begin() as connection:
        connection.execute(
            directives.update().where(directives.c.id == run.directive_id).values(status="lost")
        )
    acks = models.table_of(models.DirectiveAck)
    row = {
        "run_id": run.id,
        "directive_id": run.directive_id,
        "incarnation": INCARNATION,
        "rank": 0,
        "step": 1,
        "detail": None,
        "time": 1.0,
        "received_at": 1.0,
        "content_hash": "0" * 32,
    }
    with pytest.raises(sa.exc.IntegrityError), store.begin() as connection:
        connection.execute(acks.insert(), {**row, "status": "maybe"})
    with store.begin() as connection:  # the same row with a real status is stored
        connection.execute(acks.insert(), {**row, "status": AckStatus.MISSED.value})


def test_downgrading_past_0006_removes_the_checks(store: Engine) -> None:
    migrate.downgrade(store, "0005")
    assert all(status_checks(store, table) == {} for table in LIFECYCLES)
    migrate.upgrade(store)
    assert status_checks(store, "proposals") == {"ck_proposals_status": {s.value for s in ProposalStatus}}


def test_the_ingest_api_accepts_exactly_the_ack_statuses(client: TestClient, run: RunHandle) -> None:
    def post(rank: int, status: str) -> int:
        ack = {
            "kind": "directive_ack",
            "directive_id": run.directive_id,
            "incarnation": INCARNATION,
            "rank": rank,
            "time": 1.0,
            "status": status,
        }
        return client.post(run.records_path, json=batch(ack), headers=run.headers).status_code

    assert [post(rank, s.value) for rank, s in enumerate(AckStatus)] == [200, 200, 200]
    assert post(9, "maybe") == 422
