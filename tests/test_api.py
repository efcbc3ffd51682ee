"""The HTTP API: every bad input gets its status and leaves the store exactly as it was;
good batches of every kind are stored once; NaN and infinities round-trip as data."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from monitor import service as service_module
from monitor.api.routes import create_app
from monitor.config import IngestConfig, ServiceConfig
from monitor.ingest.batches import KEYED_TABLES
from monitor.ingest.schemas import RECORD_KINDS
from monitor.service import Service
from monitor.settings import service_config
from monitor.store import models, queries
from tests.support import (
    ADMIN_TOKEN,
    INCARNATION,
    RunHandle,
    batch,
    both_backends,
    count_rows,
    make_run,
    record_of_each_kind,
    snapshot,
    step_record,
    steps,
)

STEP = models.StepRecord.__table__
SUMMARY = models.StepSummary.__table__

Body = dict[str, Any] | bytes | Iterator[bytes]


class Response(Protocol):
    """What the tests read of a TestClient response (httpx or httpx2, as starlette picks)."""

    @property
    def status_code(self) -> int: ...

    @property
    def content(self) -> bytes: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


def post(client: TestClient, run: RunHandle, body: Body, headers: dict[str, str] | None = None) -> Response:
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    return client.post(
        run.records_path,
        content=content,
        headers={
            "content-type": "application/json",
            **(run.headers if headers is None else headers),
        },
    )


def strict_json(response: Response) -> Any:
    """The body as standard JSON: a bare NaN or Infinity token fails the test."""

    def refuse(token: str) -> Any:
        raise AssertionError(f"bare {token} in a response")

    return json.loads(response.content, parse_constant=refuse)


def assert_rejected(
    response: Response, status: int, error: str, store: Engine, before: Any
) -> dict[str, Any]:
    """The status and error code, and nothing of the batch in the store."""
    assert response.status_code == status, response.text
    body: dict[str, Any] = strict_json(response)
    assert body["error"] == error
    assert snapshot(store) == before
    return body


def assert_problem(body: dict[str, Any], index: int | None, field: str | None) -> None:
    first = body["problems"][0]
    assert (first["index"], first["field"]) == (index, field), body
    assert field is None or repr(field) in body["message"]


# --- malformed and invalid batches -----------------------------------------------------------


@pytest.mark.parametrize("raw", [b'{"records": [', b"records=1", b"", b'{"records": [{"kind": "step",}]}'])
def test_malformed_json_is_400(client: TestClient, store: Engine, run: RunHandle, raw: bytes) -> None:
    before = snapshot(store)
    assert_rejected(post(client, run, raw), 400, "malformed_json", store, before)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("loss_sum", "2.5"),  # a string for a float
        ("grad_norm", "nan"),  # only the exact names NaN, Infinity, -Infinity are floats
        ("tokens", 1.5),  # a fraction for an int (a whole 2.0 is 2: see below)
        ("rank", "0"),
        ("skipped", 1),
        ("tokens", -1),
        ("sample_ids", "batch-7"),
        ("time", None),
    ],
)
def test_wrong_type_is_422_naming_index_and_field(
    client: TestClient, store: Engine, run: RunHandle, field: str, value: Any
) -> None:
    before = snapshot(store)
    records = [*steps(2), step_record(attempt=2, **{field: value})]
    body = assert_rejected(post(client, run, batch(*records)), 422, "invalid_record", store, before)
    assert_problem(body, 2, field)


def test_an_integer_past_64_bits_in_a_free_form_document_is_kept_as_a_float(
    client: TestClient, store: Engine, run: RunHandle
) -> None:
    """The store's JSON writer takes integers of 64 bits; a wider one in a document (a config,
    a sample's counters) was a 500 that refused the whole batch."""
    start = next(r for r in record_of_each_kind(run.directive_id) if r["kind"] == "run_start")
    config = {"seed": 2**70, "nested": [{"n": -(2**64)}], "widest": 2**64 - 1, "flag": True}
    assert post(client, run, batch({**start, "config": config})).status_code == 200
    with store.connect() as connection:
        stored = connection.execute(sa.select(models.Incarnation.__table__.c.config)).scalar_one()
    assert stored == {
        "seed": float(2**70),
        "nested": [{"n": float(-(2**64))}],
        "widest": 2**64 - 1,
        "flag": True,
    }


def test_a_whole_float_for_an_int_is_that_int(client: TestClient, store: Engine, run: RunHandle) -> None:
    """JSON Schema's ``integer`` (the OpenAPI document's) is any number with no fraction: ``2.0``
    for ``tokens`` is stored as the integer 2, and sent again as ``2`` it is a duplicate."""
    assert post(client, run, batch(step_record(tokens=2.0, rank=1.0))).json()["accepted"] == 1
    with store.connect() as connection:
        assert connection.execute(sa.select(STEP.c.tokens, STEP.c.rank)).one() == (2, 1)
    assert post(client, run, batch(step_record(tokens=2, rank=1))).json()["duplicates"] == 1


@both_backends
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rank", 2**31),
        ("rank", 10_000_000),  # past the protocol's 2^20 ranks
        ("rank", 2**70),
        ("step", 2**31),
        ("tokens", 2**63),
        ("consumed", 2**64),
    ],
)
def test_integers_past_what_the_store_holds_are_422_naming_the_field(
    client: TestClient, store: Engine, run: RunHandle, field: str, value: Any
) -> None:
    """Refused by name before anything is stored or judged (they were 500s, and a rank of
    2^31 made the engine allocate per-rank vectors of that length)."""
    before = snapshot(store)
    body = assert_rejected(
        post(client, run, batch(*steps(2), step_record(attempt=2, **{field: value}))),
        422,
        "invalid_record",
        store,
        before,
    )
    assert_problem(body, 2, field)


def test_an_attempt_or_a_sample_id_past_64_bits_is_422(
    client: TestClient, store: Engine, run: RunHandle
) -> None:
    before = snapshot(store)
    wide_attempt = {**step_record(attempt=2), "attempt": 2**70}
    body = assert_rejected(post(client, run, batch(wide_attempt)), 422, "invalid_record", store, before)
    assert_problem(body, 0, "attempt")
    body = assert_rejected(
        post(client, run, batch(step_record(attempt=2, sample_ids=[2**100]))),
        422,
        "invalid_record",
        store,
        before,
    )
    assert body["problems"][0]["field"].startswith("sample_ids.0")


def test_a_rank_past_the_declared_world_size_is_422(
    client: TestClient, store: Engine, run: RunHandle
) -> None:
    start = next(r for r in record_of_each_kind(run.directive_id) if r["kind"] == "run_start")
    assert post(client, run, batch({**start, "world_size": 4})).status_code == 200
    before = snapshot(store)
    body = assert_rejected(
        post(client, run, batch(*steps(2), step_record(rank=4, attempt=2))),
        422,
        "inconsistent_record",
        store,
        before,
    )
    assert_problem(body, 2, "rank")
    assert post(client, run, batch(step_record(rank=3, attempt=2))).status_code == 200


@pytest.mark.parametrize("field", ["incarnation", "rank", "attempt", "step", "time"])
def test_missing_required_field_is_422(client: TestClient, store: Engine, run: RunHandle, field: str) -> None:
    before = snapshot(store)
    incomplete = step_record(attempt=1)
    del incomplete[field]
    body = assert_rejected(
        post(client, run, batch(step_record(), incomplete)), 422, "invalid_record", store, before
    )
    assert_problem(body, 1, field)
    assert body["problems"][0]["message"] == "Field required"


@pytest.mark.parametrize("kind", ["stepp", "", None, 3])
def test_unknown_kind_is_422_on_field_kind(
    client: TestClient, store: Engine, run: RunHandle, kind: Any
) -> None:
    before = snapshot(store)
    record = {**step_record(attempt=1), "kind": kind}
    body = assert_rejected(
        post(client, run, batch(step_record(), record)), 422, "invalid_record", store, before
    )
    assert_problem(body, 1, "kind")


def test_record_without_kind_is_422_on_field_kind(client: TestClient, store: Engine, run: RunHandle) -> None:
    before = snapshot(store)
    record = step_record()
    del record["kind"]
    body = assert_rejected(post(client, run, batch(record)), 422, "invalid_record", store, before)
    assert_problem(body, 0, "kind")


def test_unknown_field_is_422(client: TestClient, store: Engine, run: RunHandle) -> None:
    before = snapshot(store)
    body = assert_rejected(
        post(client, run, batch(step_record(los_sum=1.0))), 422, "invalid_record", store, before
    )
    assert_problem(body, 0, "los_sum")


def test_nested_field_is_named_by_its_path(client: TestClient, store: Engine, run: RunHandle) -> None:
    before = snapshot(store)
    checkpoint = record_of_each_kind(run.directive_id)[6]
    checkpoint["manifest"]["files"][0]["sha256"] = "not-a-digest"
    body = assert_rejected(post(client, run, batch(checkpoint)), 422, "invalid_record", store, before)
    assert_problem(body, 0, "manifest.files.0.sha256")


@pytest.mark.parametrize("document", [{}, {"records": {}}, {"records": [], "extra": 1}])
def test_batch_that_is_not_a_batch_is_422(
    client: TestClient, store: Engine, run: RunHandle, document: dict[str, Any]
) -> None:
    before = snapshot(store)
    body = assert_rejected(post(client, run, document), 422, "invalid_record", store, before)
    assert body["problems"][0]["index"] is None


@both_backends
def test_one_bad_record_rejects_the_whole_batch(client: TestClient, store: Engine, run: RunHandle) -> None:
    before = snapshot(store)
    records = [*record_of_each_kind(run.directive_id)[1:], *steps(3, ranks=2)]
    assert records[5]["kind"] == "checkpoint"
    records[5] = {**records[5], "step": "seven"}
    body = assert_rejected(post(client, run, batch(*records)), 422, "invalid_record", store, before)
    assert len(body["problems"]) == 1
    assert_problem(body, 5, "step")


# --- size limits -----------------------------------------------------------------------------

SMALL_BYTES = ServiceConfig(admin_token=ADMIN_TOKEN, ingest=IngestConfig(max_batch_bytes=2048))
FEW_RECORDS = ServiceConfig(admin_token=ADMIN_TOKEN, ingest=IngestConfig(max_batch_records=3))


@pytest.mark.parametrize("service_config", [SMALL_BYTES])
def test_batch_over_the_byte_limit_is_413(client: TestClient, store: Engine, run: RunHandle) -> None:
    small, large = batch(*steps(2)), batch(*steps(20))
    assert len(json.dumps(small)) < 2048 < len(json.dumps(large))
    before = snapshot(store)
    assert_rejected(post(client, run, large), 413, "too_large", store, before)
    assert post(client, run, small).status_code == 200


@pytest.mark.parametrize("service_config", [SMALL_BYTES])
def test_streamed_batch_over_the_byte_limit_is_413(client: TestClient, store: Engine, run: RunHandle) -> None:
    """No Content-Length to check up front: the limit holds while the body is read."""
    raw = json.dumps(batch(*steps(20))).encode()
    chunks = iter([raw[i : i + 512] for i in range(0, len(raw), 512)])
    before = snapshot(store)
    assert_rejected(post(client, run, chunks), 413, "too_large", store, before)


@pytest.mark.parametrize("service_config", [FEW_RECORDS])
def test_batch_over_the_record_limit_is_413(client: TestClient, store: Engine, run: RunHandle) -> None:
    before = snapshot(store)
    assert_rejected(post(client, run, batch(*steps(4))), 413, "too_large", store, before)
    assert post(client, run, batch(*steps(3))).status_code == 200
    assert count_rows(store, STEP) == 3


# --- tokens ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer "}, 401),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, 401),
        ({"Authorization": "Bearer rh_run_not-the-token"}, 403),
    ],
)
def test_missing_or_wrong_token_is_refused(
    client: TestClient, store: Engine, run: RunHandle, headers: dict[str, str], status: int
) -> None:
    before = snapshot(store)
    error = "unauthorized" if status == 401 else "forbidden"
    assert_rejected(post(client, run, batch(step_record()), headers), status, error, store, before)


def test_one_runs_token_cannot_write_another_run(client: TestClient, store: Engine, run: RunHandle) -> None:
    other = make_run(store, "run-b")
    before = snapshot(store)
    response = post(client, run, batch(step_record()), other.headers)
    assert_rejected(response, 403, "forbidden", store, before)
    assert post(client, other, batch(step_record())).status_code == 200
    with store.connect() as connection:
        assert connection.execute(sa.select(STEP.c.run_id)).scalars().all() == [other.id]


def test_admin_token_may_write_any_run(
    client: TestClient, store: Engine, run: RunHandle, admin_headers: dict[str, str]
) -> None:
    assert post(client, run, batch(step_record()), admin_headers).status_code == 200
    assert count_rows(store, STEP) == 1


def test_a_renewed_run_token_replaces_the_old_one(
    client: TestClient, store: Engine, run: RunHandle, admin_headers: dict[str, str]
) -> None:
    """A restarted job's embedded service renews the run's token (only its digest is kept):
    the new token writes the run, the old one is refused; only the admin may renew."""
    assert client.post(f"/v1/runs/{run.name}/token", headers=run.headers).status_code == 403
    assert client.post("/v1/runs/no-such-run/token", headers=admin_headers).status_code == 404
    renewed = client.post(f"/v1/runs/{run.name}/token", headers=admin_headers)
    assert renewed.status_code == 200 and renewed.json()["token"] != run.token
    before = snapshot(store)
    assert_rejected(post(client, run, batch(step_record())), 403, "forbidden", store, before)
    new = RunHandle(name=run.name, id=run.id, token=renewed.json()["token"], directive_id=run.directive_id)
    assert post(client, new, batch(step_record())).status_code == 200


def test_a_run_token_known_to_this_replica_is_refused_once_renewed(
    client: TestClient,
    store: Engine,
    run: RunHandle,
    admin_headers: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A token read from the store is trusted a while without reading it again: renewed
    through this service it is refused at once; renewed through another replica (the store
    alone), once ``TOKEN_TRUST_S`` has passed."""
    monkeypatch.setattr(service_module, "TOKEN_TRUST_S", 3600.0)
    assert post(client, run, batch(step_record())).status_code == 200  # the token is now known
    renewed = client.post(f"/v1/runs/{run.name}/token", headers=admin_headers).json()["token"]
    assert post(client, run, batch(step_record())).status_code == 403
    new = RunHandle(name=run.name, id=run.id, token=renewed, directive_id=run.directive_id)
    assert post(client, new, batch(step_record())).status_code == 200
    with store.begin() as connection:  # another replica renews it
        queries.renew_run_token(connection, run.name)
    assert post(client, new, batch(step_record())).status_code == 200  # trusted a while yet
    monkeypatch.setattr(service_module, "TOKEN_TRUST_S", 0.0)
    assert post(client, new, batch(step_record())).status_code == 403


def test_an_unknown_run_answers_a_run_token_as_an_existing_one_does(
    client: TestClient, store: Engine, run: RunHandle, admin_headers: dict[str, str]
) -> None:
    """403 for a token that may not access the run, whether it exists or not (a 404 let a token
    holder enumerate run names); the admin learns that it does not exist."""
    missing = RunHandle(name="no-such-run", id=0, token=run.token, directive_id=0)
    other = make_run(store, "run-b")
    before = snapshot(store)
    unknown = assert_rejected(post(client, missing, batch(step_record())), 403, "forbidden", store, before)
    existing = assert_rejected(
        post(client, other, batch(step_record()), run.headers), 403, "forbidden", store, before
    )
    assert unknown["message"].replace("no-such-run", "X") == existing["message"].replace("run-b", "X")
    assert post(client, missing, batch(step_record()), admin_headers).status_code == 404


# --- duplicates and conflicts ----------------------------------------------------------------


@both_backends
def test_resent_batch_is_stored_once(client: TestClient, store: Engine, run: RunHandle) -> None:
    first = post(client, run, batch(*steps(4, ranks=2)))
    assert first.json() == {"accepted": 8, "duplicates": 0, "by_kind": {"step": 8}}
    before = snapshot(store)
    again = post(client, run, batch(*steps(4, ranks=2)))
    assert again.status_code == 200
    assert again.json() == {"accepted": 0, "duplicates": 8, "by_kind": {"step": 0}}
    assert snapshot(store) == before
    assert count_rows(store, STEP) == 8


@both_backends
def test_partly_resent_batch_stores_only_the_new_records(
    client: TestClient, store: Engine, run: RunHandle
) -> None:
    post(client, run, batch(*steps(3)))
    response = post(client, run, batch(*steps(5)))
    assert response.json()["accepted"] == 2 and response.json()["duplicates"] == 3
    assert count_rows(store, STEP) == 5 and count_rows(store, SUMMARY) == 5


@both_backends
def test_conflicting_duplicate_is_409_and_stores_nothing_of_its_batch(
    client: TestClient, store: Engine, run: RunHandle, service: Service
) -> None:
    assert post(client, run, batch(*steps(3))).status_code == 200
    before = snapshot(store)
    fresh_sample = record_of_each_kind(run.directive_id)[4]
    records = [step_record(attempt=3), fresh_sample, step_record(attempt=1, loss_sum=99.0)]
    body = assert_rejected(post(client, run, batch(*records)), 409, "conflict", store, before)
    assert body["index"] == 2
    assert body["key"] == {"incarnation": INCARNATION, "rank": 0, "attempt": 1}
    assert service.counters[(run.name, "rejected")] == 1


@both_backends
def test_new_steps_beside_a_conflicting_run_start_store_nothing_and_are_judged_when_resent(
    client: TestClient, store: Engine, run: RunHandle
) -> None:
    """A run start already stored with other content refuses its batch: the ten new step
    records of that batch (another table, written first) are not stored either, so sending them
    again alone stores and summarizes them (on SQLite the driver used to commit them at the
    first savepoint's release)."""
    start = next(r for r in record_of_each_kind(run.directive_id) if r["kind"] == "run_start")
    assert post(client, run, batch(start)).status_code == 200
    before = snapshot(store)
    changed = {**start, "world_size": start.get("world_size", 1) + 7}
    body = assert_rejected(post(client, run, batch(*steps(10), changed)), 409, "conflict", store, before)
    assert body["index"] == 10
    resent = post(client, run, batch(*steps(10)))
    assert resent.status_code == 200 and strict_json(resent)["duplicates"] == 0
    assert count_rows(store, STEP) == 10 and count_rows(store, models.StepSummary) == 10


def test_conflict_inside_one_batch_is_409(client: TestClient, store: Engine, run: RunHandle) -> None:
    before = snapshot(store)
    records = [step_record(), step_record(rank=1), step_record(grad_norm=7.0)]
    body = assert_rejected(post(client, run, batch(*records)), 409, "conflict", store, before)
    assert body["index"] == 2


# --- every kind, and heartbeats ---------------------------------------------------------------


@both_backends
def test_every_kind_is_accepted_and_idempotent(client: TestClient, store: Engine, run: RunHandle) -> None:
    first = post(client, run, batch(*record_of_each_kind(run.directive_id)))
    assert first.status_code == 200, first.text
    assert first.json()["by_kind"] == dict.fromkeys(RECORD_KINDS, 1)
    before = snapshot(store)
    again = post(client, run, batch(*record_of_each_kind(run.directive_id)))
    assert again.status_code == 200
    assert again.json()["duplicates"] == len(RECORD_KINDS) - 1  # a heartbeat just refreshes
    assert snapshot(store) == before
    for table in models.Base.metadata.sorted_tables:
        # the tables the records land in; the rest are the service's own (decisions, audit)
        if table.name in {str(spec.table.name) for spec in KEYED_TABLES.values()} | {
            "heartbeats",
            "incarnations",
        }:
            assert count_rows(store, table) == 1, table.name


@both_backends
def test_checkpoint_manifest_and_nonfinite_metrics_are_kept(
    client: TestClient, store: Engine, run: RunHandle
) -> None:
    checkpoint = {**record_of_each_kind(run.directive_id)[6], "metrics": {"loss": "NaN", "grad_norm": 1.5}}
    assert post(client, run, batch(checkpoint)).status_code == 200
    with store.connect() as connection:
        row = connection.execute(sa.select(models.CheckpointEvent.__table__)).mappings().one()
    assert row["manifest"] == checkpoint["manifest"]
    assert row["metrics"] == {"loss": "NaN", "grad_norm": 1.5}  # JSON columns keep the name
    assert (row["step"], row["consumed"], row["tags"]) == (0, 64, ["periodic"])


def heartbeat(time: float, phase: str) -> dict[str, Any]:
    return {
        "kind": "heartbeat",
        "incarnation": INCARNATION,
        "rank": 0,
        "phase": phase,
        "phase_since": time,
        "time": time,
    }


def test_newer_heartbeat_wins_and_a_late_older_one_is_ignored(
    client: TestClient, store: Engine, run: RunHandle
) -> None:
    for time, phase in [(10.0, "forward"), (20.0, "backward"), (15.0, "data")]:
        assert post(client, run, batch(heartbeat(time, phase))).status_code == 200
    with store.connect() as connection:
        rows = connection.execute(sa.select(models.Heartbeat.__table__)).mappings().all()
    assert [(row["time"], row["phase"]) for row in rows] == [(20.0, "backward")]


# --- NaN and infinities ----------------------------------------------------------------------


def with_bare_tokens(document: dict[str, Any]) -> bytes:
    """``document`` as Python's ``json`` would write it: NaN and Infinity as bare tokens."""
    raw = json.dumps(document)
    for name in ("NaN", "Infinity", "-Infinity"):
        raw = raw.replace(f'"{name}"', name)
    return raw.encode()


BARE_TOKENS = with_bare_tokens(
    batch(step_record(attempt=1, loss_sum="NaN", grad_norm="Infinity", lr="-Infinity"))
)


def test_bare_tokens_are_really_bare() -> None:
    assert b": NaN," in BARE_TOKENS and b": -Infinity," in BARE_TOKENS
    assert b'"NaN"' not in BARE_TOKENS and b"Infinity" in BARE_TOKENS


def post_nonfinite(client: TestClient, run: RunHandle) -> None:
    named = step_record(loss_sum="NaN", grad_norm="Infinity", loss_scale="-Infinity")
    assert post(client, run, batch(named)).status_code == 200
    assert post(client, run, BARE_TOKENS).status_code == 200


@both_backends
def test_nonfinite_values_are_stored_as_floats(client: TestClient, store: Engine, run: RunHandle) -> None:
    post_nonfinite(client, run)
    with Session(store) as session:
        records = session.scalars(sa.select(models.StepRecord).order_by(models.StepRecord.attempt)).all()
    assert [math.isnan(r.loss_sum or 0.0) for r in records] == [True, True]
    assert [r.grad_norm for r in records] == [math.inf, math.inf]
    assert (records[0].loss_scale, records[1].lr) == (-math.inf, -math.inf)
    with store.connect() as connection:
        assert (
            connection.execute(sa.select(sa.func.count()).where(STEP.c.loss_sum.is_(None))).scalar_one() == 0
        )  # a NaN must never become NULL
        sums = connection.execute(sa.select(SUMMARY.c.loss_sum).order_by(SUMMARY.c.attempt))
        assert all(math.isnan(value) for value in sums.scalars())


@both_backends
def test_nonfinite_values_are_served_as_names(client: TestClient, store: Engine, run: RunHandle) -> None:
    post_nonfinite(client, run)
    response = client.get(f"/v1/runs/{run.name}/steps", headers=run.headers)
    assert response.status_code == 200
    served = strict_json(response)["steps"]
    assert [(s["attempt"], s["loss"], s["grad_norm"]) for s in served] == [
        (0, "NaN", "Infinity"),
        (1, "NaN", "Infinity"),
    ]
    assert (served[0]["loss_scale"], served[1]["lr"]) == ("-Infinity", "-Infinity")


@both_backends
def test_nonfinite_loss_opens_a_nonfinite_incident(client: TestClient, store: Engine, run: RunHandle) -> None:
    post_nonfinite(client, run)
    response = client.get(f"/v1/runs/{run.name}/incidents", headers=run.headers)
    incidents = strict_json(response)["incidents"]
    nonfinite = [i for i in incidents if i["kind"] == "nonfinite"]
    assert [(i["severity"], i["status"]) for i in nonfinite] == [("critical", "open")]
    assert (nonfinite[0]["first_step"], nonfinite[0]["last_step"]) == (0, 1)
    findings = strict_json(client.get(f"/v1/runs/{run.name}/findings", headers=run.headers))
    signals = {(f["step"], f["signal"], f["value"]) for f in findings["findings"]}
    assert signals >= {(0, "loss", "NaN"), (0, "grad_norm", "Infinity"),
                       (1, "loss", "NaN"), (1, "grad_norm", "Infinity")}  # fmt: skip


@both_backends
def test_nonfinite_record_resent_is_a_duplicate(client: TestClient, store: Engine, run: RunHandle) -> None:
    post_nonfinite(client, run)
    before = snapshot(store)
    response = post(client, run, BARE_TOKENS)
    assert response.json()["duplicates"] == 1
    assert repr(snapshot(store)) == repr(before)  # repr: NaN never equals itself


# --- reads -----------------------------------------------------------------------------------


def test_healthz(client: TestClient) -> None:
    response = client.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_healthz_is_503_when_the_store_is_down() -> None:
    unreachable = sa.create_engine("sqlite:////nonexistent-dir/for/sure/store.db")
    with TestClient(create_app(Service(unreachable, ServiceConfig()))) as client:
        response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json()["status"] == "error"


def test_runs_list_is_admin_only(client: TestClient, run: RunHandle, admin_headers: dict[str, str]) -> None:
    post(client, run, batch(*steps(3)))
    assert client.get("/v1/runs").status_code == 401
    assert client.get("/v1/runs", headers=run.headers).status_code == 403
    response = client.get("/v1/runs", headers=admin_headers)
    assert response.status_code == 200
    [listed] = response.json()["runs"]
    assert (listed["name"], listed["latest_step"], listed["windows"]) == (run.name, 2, 3)
    assert listed["open_incidents"] == 0


def test_admin_creates_a_run_whose_token_writes_it(
    client: TestClient, store: Engine, admin_headers: dict[str, str]
) -> None:
    created = client.post("/v1/runs", json={"name": "run-new"}, headers=admin_headers)
    assert created.status_code == 201
    token = created.json()["token"]
    new_run = RunHandle(name="run-new", id=0, token=token, directive_id=0)
    assert post(client, new_run, batch(step_record())).status_code == 200
    again = client.post("/v1/runs", json={"name": "run-new"}, headers=admin_headers)
    assert again.status_code == 409
    refused = client.post("/v1/runs", json={"name": "x"}, headers=new_run.headers)
    assert refused.status_code == 403
    invalid = client.post("/v1/runs", json={"name": "has space"}, headers=admin_headers)
    assert invalid.status_code == 422
    assert count_rows(store, models.Run.__table__) == 1


def test_steps_are_whole_run_windows_filtered_by_step(client: TestClient, run: RunHandle) -> None:
    post(client, run, batch(*steps(4, ranks=2)))
    response = client.get(f"/v1/runs/{run.name}/steps", headers=run.headers)
    served = response.json()["steps"]
    assert [(s["step"], s["ranks"], s["tokens"], s["loss"]) for s in served] == [
        (step, 2, 2048, 2.0) for step in range(4)
    ]
    window = client.get(f"/v1/runs/{run.name}/steps?start=1&end=2", headers=run.headers)
    assert [s["step"] for s in window.json()["steps"]] == [1, 2]


def test_clean_run_has_no_findings_or_incidents(client: TestClient, run: RunHandle) -> None:
    post(client, run, batch(*steps(10)))
    findings = client.get(f"/v1/runs/{run.name}/findings", headers=run.headers)
    incidents = client.get(f"/v1/runs/{run.name}/incidents", headers=run.headers)
    assert findings.json() == {"run": run.name, "findings": []}
    assert incidents.json() == {"run": run.name, "incidents": []}


@pytest.mark.parametrize("what", ["steps", "findings", "incidents"])
def test_reads_need_the_runs_own_token(client: TestClient, store: Engine, run: RunHandle, what: str) -> None:
    other = make_run(store, "run-b")
    assert client.get(f"/v1/runs/{run.name}/{what}").status_code == 401
    assert client.get(f"/v1/runs/{run.name}/{what}", headers=other.headers).status_code == 403
    assert client.get(f"/v1/runs/{run.name}/{what}", headers=run.headers).status_code == 200


def test_service_config_reads_hang_timing_from_the_environment() -> None:
    from monitor.config import ConfigError

    config = service_config({"RUNHEALTH_HANG_MIN_TIMEOUT_S": "12.5", "RUNHEALTH_HEARTBEAT_S": "0.5"})
    assert config.engine.hangs.min_timeout_s == 12.5
    assert config.engine.hangs.heartbeat_interval_s == 0.5
    assert service_config({}).engine == ServiceConfig().engine
    with pytest.raises(ConfigError, match="RUNHEALTH_HANG_MIN_TIMEOUT_S must be a number"):
        service_config({"RUNHEALTH_HANG_MIN_TIMEOUT_S": "soon"})


@pytest.mark.parametrize(
    "path",
    [
        "steps?limit=-1",
        "steps?limit=0",
        "steps?limit=1180591620717411303424",
        "steps?start=-5",
        "directives?incarnation=i&rank=1180591620717411303424",
        "directives?incarnation=i&rank=-1",
    ],
)
def test_list_parameters_out_of_their_range_are_422_naming_them(
    client: TestClient, run: RunHandle, path: str
) -> None:
    """``limit=-1`` lifted the cap; integers past the store's were 500s."""
    response = client.get(f"/v1/runs/{run.name}/{path}", headers=run.headers)
    assert response.status_code == 422, response.text
    body = strict_json(response)
    assert body["error"] == "invalid" and path.split("?")[1].split("=")[-2].split("&")[-1] in body["message"]


@pytest.mark.parametrize("fault", ["deleted", "replaced"])
def test_a_store_file_deleted_or_replaced_under_the_service_is_503_not_an_acknowledgement(
    client: TestClient, store: Engine, run: RunHandle, tmp_path: Path, fault: str
) -> None:
    """SQLite writes on into a deleted file's inode: the batches were answered 200 and were
    gone at the next start, with /healthz saying ok throughout."""
    assert post(client, run, batch(*steps(2))).status_code == 200
    path = tmp_path / "store.db"
    if fault == "deleted":
        path.unlink()
    else:
        path.rename(tmp_path / "moved.db")
        path.write_bytes((tmp_path / "moved.db").read_bytes())
    response = post(client, run, batch(step_record(attempt=2)))
    assert response.status_code == 503 and strict_json(response)["error"] == "store_unavailable"
    assert fault in strict_json(response)["message"]
    health = client.get("/healthz")
    assert health.status_code == 503 and fault in health.json()["message"]
