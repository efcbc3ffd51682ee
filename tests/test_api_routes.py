"""The decide route, ``POST /v1/proposals/{id}/{verb}``: an operator token decides as its
operator; the admin token as the local user the body names (``local:NAME``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from monitor.service import Service
from monitor.store import audit
from monitor.store.operators import add_operator
from tests.support import RunHandle
from tests.test_decisions import spiked_run


def operator_headers(store: Engine, name: str) -> dict[str, str]:
    with store.begin() as connection:
        return {"Authorization": f"Bearer {add_operator(connection, name, actor='tests', now=1.0)}"}


@pytest.mark.parametrize(("body", "decider"), [({"operator": "carol"}, "local:carol"), ({}, "local:admin")])
def test_the_admin_token_decides_as_the_local_user_it_names(
    client: TestClient,
    service: Service,
    run: RunHandle,
    tmp_path: Path,
    admin_headers: dict[str, str],
    body: dict[str, str],
    decider: str,
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    answer = client.post(
        f"/v1/proposals/{proposal['id']}/approve", json={"reason": "go", **body}, headers=admin_headers
    )
    assert answer.status_code == 200
    assert answer.json()["message"] == f"proposal {proposal['id']} approved by {decider}"
    assert answer.json()["proposal"]["decided_by"] == decider
    with service.engine.connect() as connection:
        approved = [e for e in audit.story(connection, proposal["incident"]) if e["action"] == "approved"]
    assert [(e["actor"], e["reason"]) for e in approved] == [(decider, "go")]


def test_an_operator_token_decides_as_its_operator_and_names_nobody_else(
    client: TestClient, service: Service, store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    headers = operator_headers(store, "alice")
    path = f"/v1/proposals/{proposal['id']}/reject"
    named = client.post(path, json={"reason": "bad shard", "operator": "carol"}, headers=headers)
    assert (named.status_code, named.json()["error"]) == (403, "forbidden")
    assert "only the admin token" in named.json()["message"]
    done = client.post(path, json={"reason": "bad shard"}, headers=headers)
    assert (done.status_code, done.json()["proposal"]["decided_by"]) == (200, "alice")


def test_bad_decisions_are_refused_the_same_for_either_token(
    client: TestClient,
    service: Service,
    store: Engine,
    run: RunHandle,
    tmp_path: Path,
    admin_headers: dict[str, str],
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    for headers in (admin_headers, operator_headers(store, "alice")):
        path = f"/v1/proposals/{proposal['id']}"
        assert client.post(f"{path}/reject", json={"reason": " "}, headers=headers).status_code == 422
        assert client.post(f"{path}/undo", json={}, headers=headers).status_code == 404
        unknown = client.post("/v1/proposals/999/approve", json={}, headers=headers)
        assert (unknown.status_code, unknown.json()["message"]) == (404, "no proposal 999")
    refused = client.post(f"/v1/proposals/{proposal['id']}/approve", json={"operator": ""},
                          headers=admin_headers)  # fmt: skip
    assert refused.status_code == 422
    nobody = client.post(
        f"/v1/proposals/{proposal['id']}/approve", json={}, headers={"Authorization": "Bearer x"}
    )
    assert nobody.status_code == 403
