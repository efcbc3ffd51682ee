"""The API as its OpenAPI document describes it.

schemathesis (every check, a fixed seed, a bounded number of cases per operation) runs against a
real ``runhealth serve`` in two passes: with a run's, an operator's and the admin token, each
operation taking the one its security names (the run's own name in most cases, so batches reach
the store); then with the admin token alone, on any run name (runs created, unknown ones).
Besides: the document itself (bearer schemes on every operation, every answer described), and a
bad token answered alike for an existing and an unknown run on every operation that names one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import URL, Engine

from monitor.api import document
from monitor.store import audit
from monitor.store.db import create_store_engine
from monitor.store.operators import add_operator
from tests.collectors_support import ADMIN, ServeProcess, child_environ, serving
from tests.support import INCARNATION, RunHandle, checkpoint, make_run, require_module, spiky_windows

SEED = 20240917
EXAMPLES = 12
"""Cases per operation in each drawn phase (fuzzing, stateful); the coverage phase's boundary
cases are on top. The two passes: 2,015 and 247 cases, 25-28 s and 8-12 s on 2 cores that other
work kept at a load average of 5 to 8 (about 30 s of CPU in all, schemathesis's and the service's)."""
RUN = "run-a"
SPARE = "run-spare"


@dataclass(frozen=True)
class Served:
    serve: ServeProcess
    run_token: str
    operator_token: str
    proposal: int
    directive: int


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A serve with run ``run-a`` holding a spiked run (an incident, a pending proposal) and a
    pending directive, and an operator."""
    require_module("schemathesis")
    root = tmp_path_factory.mktemp("api-schema")
    with serving(root) as serve:
        run_token = serve.create_run(RUN)
        serve.create_run(SPARE)
        operator_token = add_operator_to(root / "store.db")
        headers = {"authorization": f"Bearer {run_token}"}
        start = {"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 2}
        for records in (
            [start],
            [checkpoint(root, 20), *spiky_windows(range(1, 65))],
            [*spiky_windows(range(65, 75), spike=65), checkpoint(root, 70)],
        ):
            httpx.post(
                f"{serve.url}/v1/runs/{RUN}/records", json={"records": records}, headers=headers
            ).raise_for_status()
        admin = {"authorization": f"Bearer {ADMIN}"}
        (proposal,) = httpx.get(f"{serve.url}/v1/proposals", headers=admin).json()["proposals"]
        directive = httpx.post(
            f"{serve.url}/v1/runs/{RUN}/directives", json={"kind": "dump_stacks"}, headers=admin
        )
        yield Served(
            serve, run_token, operator_token, int(proposal["id"]), int(directive.json()["directive"])
        )


def add_operator_to(store_file: Path) -> str:
    """An operator's token, added to the serve's store from here (as ``runhealth operators add``
    does, signing the audit entry with the key beside the store)."""
    engine = create_store_engine(URL.create("sqlite", database=str(store_file)))
    try:
        audit.attach(engine, child_environ())
        with engine.begin() as connection:
            return add_operator(connection, "alice", actor="tests", now=time.time())
    finally:
        engine.dispose()


def schemathesis_config(served: Served, admin_only: bool) -> str:
    schemes = {document.ADMIN_TOKEN: ADMIN}
    if not admin_only:
        schemes |= {document.RUN_TOKEN: served.run_token, document.OPERATOR_TOKEN: served.operator_token}
    lines = ['hooks = "tests.api_schema_checks"']
    for scheme, token in schemes.items():
        lines += [f"[auth.openapi.{scheme}]", f'bearer = "{token}"']
    if not admin_only:  # the run's own name and the proposal and directive it has
        lines += [
            "[dictionaries.directives]",
            f"values = [{served.directive}]",
            "[parameters]",
            f'"path.run" = "{RUN}"',
            f'"path.proposal_id" = {served.proposal}',
            '"body.records[*].directive_id" = { dictionary = "directives", probability = 0.8 }',
        ]
        # Renewing run-a's token would lock its token out: renew another run's.
        lines += [
            "[[operations]]",
            'include-path = "/v1/runs/{run}/token"',
            f'parameters = {{ "path.run" = "{SPARE}" }}',
        ]
    # A batch valid by the document may still be inconsistent (tests/api_schema_checks.py).
    lines += [
        "[[operations]]",
        'include-path = "/v1/runs/{run}/records"',
        'include-method = "POST"',
        'checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422"]',
    ]
    return "\n".join(lines) + "\n"


def run_schemathesis(served: Served, root: Path, admin_only: bool) -> dict[str, Any]:
    config = root / "schemathesis.toml"
    config.write_text(schemathesis_config(served, admin_only))
    report = root / "report.json"
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
        f"{served.serve.url}/openapi.json", "--checks", "all", "--max-examples", str(EXAMPLES),
        "--seed", str(SEED), "--workers", "1", "--no-color", "--suppress-health-check", "too_slow",
        # The coverage phase's cases (boundary values, not drawn) are the same in both passes.
        "--phases", "fuzzing,stateful" if admin_only else "examples,coverage,fuzzing,stateful",
        "--report", "json", "--report-json-path", str(report), "--request-timeout", "30",
    ]  # fmt: skip
    finished = subprocess.run(command, env=child_environ(), cwd=root, capture_output=True, text=True)
    assert report.exists(), finished.stdout[-5000:] + finished.stderr[-3000:]
    result: dict[str, Any] = json.loads(report.read_text())
    result["output"] = finished.stdout[-8000:] + finished.stderr[-2000:]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("admin_only", [False, True], ids=["every-token", "admin-token"])
def test_schemathesis_finds_no_failure(served: Served, tmp_path: Path, admin_only: bool) -> None:
    """Every check on every operation, none failing (``positive_data_acceptance`` taking a 422
    from the batch ingest only as ``inconsistent_record``: ``tests/api_schema_checks.py``)."""
    started = time.monotonic()
    result = run_schemathesis(served, tmp_path, admin_only)
    seconds = time.monotonic() - started
    operations, cases = result["operations"], result["test_cases"]
    print(
        f"schemathesis ({'admin token' if admin_only else 'every token'}): {operations['tested']} "
        f"operations, {cases['generated']} cases, {len(result['failures'])} failures, {seconds:.1f} s"
    )
    assert (result["failures"], result["errors"], result["exit_code"]) == ([], [], 0), result["output"]
    spec = httpx.get(f"{served.serve.url}/openapi.json").json()
    assert operations["tested"] == operations["total"] == len(operation_list(spec)), result["output"]


# --- the document itself ----------------------------------------------------------------------


def operation_list(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, item in spec["paths"].items() for method, op in item.items()]


PUBLIC = {("/healthz", "get"), ("/metrics", "get")}


def test_every_operation_names_its_bearer_schemes_and_describes_its_answers(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    schemes = spec["components"]["securitySchemes"]
    assert set(schemes) == {document.RUN_TOKEN, document.OPERATOR_TOKEN, document.ADMIN_TOKEN}
    assert all((scheme["type"], scheme["scheme"]) == ("http", "bearer") for scheme in schemes.values())
    for path, method, op in operation_list(spec):
        answers = op["responses"]
        assert all(answer["content"] and answer["description"] for answer in answers.values()), (path, method)
        assert "HTTPValidationError" not in json.dumps(op), (path, method)  # FastAPI's, never sent
        if (path, method) in PUBLIC:
            assert "security" not in op
            continue
        assert op["security"] and {name for one in op["security"] for name in one} <= set(schemes)
        assert {document.ADMIN_TOKEN} in [set(one) for one in op["security"]], (path, method)
        assert {"401", "403"} <= set(answers), (path, method)
        for status, answer in answers.items():
            if status.startswith("4") and status not in ("404", "409"):
                (schema,) = [media["schema"] for media in answer["content"].values()]
                assert schema == {"$ref": "#/components/schemas/ErrorOut"}, (path, method, status)
        if method == "post" and not path.endswith("/token"):
            assert "requestBody" in op, (path, method)


def test_a_method_a_path_does_not_take_is_405_listing_those_it_does(client: TestClient) -> None:
    for path, allowed in (("/v1/runs", "GET, POST"), (f"/v1/runs/{RUN}/directives", "GET, POST")):
        answer = client.request("OPTIONS", path)
        assert (answer.status_code, answer.headers["allow"]) == (405, allowed)
        assert answer.json()["error"] == "method_not_allowed"
    assert client.delete("/healthz").headers["allow"] == "GET"
    assert client.get("/v1/nothing").json() == {"error": "not_found", "message": "no such path: /v1/nothing"}


# --- a bad token, an existing and an unknown run -----------------------------------------------


@pytest.mark.parametrize("other_runs_token", [False, True], ids=["garbage-token", "other-runs-token"])
def test_a_bad_token_is_answered_alike_for_an_existing_and_an_unknown_run(
    client: TestClient, store: Engine, run: RunHandle, other_runs_token: bool
) -> None:
    """On every operation that names a run, neither the status nor the body tells a token that
    may not use the run whether it exists (a 404 once let a token holder list run names)."""
    token = make_run(store, "run-b").token if other_runs_token else "rh_run_not-a-token"
    headers = {"Authorization": f"Bearer {token}"}
    query = {"incarnation": INCARNATION, "rank": 0}
    operations = [(m, p) for p, m, _ in operation_list(client.get("/openapi.json").json()) if "{run}" in p]
    assert len(operations) == 7
    for method, path in operations:
        body = {"records": []} if path.endswith("/records") else {"kind": "dump_stacks"}
        answers = []
        for name in (run.name, "no-such-run"):
            answer = client.request(
                method.upper(), path.replace("{run}", name), params=query, json=body, headers=headers
            )
            refusal = answer.json()
            answers.append((answer.status_code, refusal["error"], refusal["message"].replace(name, "X")))
        assert answers[0] == answers[1] and answers[0][0] == 403, (method, path, answers)
