"""Load shedding at ingest: past the bound of batches in flight a batch is answered 429 with
Retry-After, before its body is read; nothing of it is stored, and /metrics counts it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from monitor.config import ConfigError, IngestConfig, ServiceConfig
from monitor.ingest.admission import IngestAdmission, SheddingConfig
from monitor.service import Service
from monitor.settings import service_config as read_service_config
from tests.support import ADMIN_TOKEN, RunHandle, both_backends, record_of_each_kind, snapshot, steps

SMALL = 8192  # the default exempt size, in bytes


@pytest.fixture
def service_config() -> ServiceConfig:
    """One batch in flight at most."""
    shedding = SheddingConfig(max_in_flight_batches=1, retry_after_s=3)
    return ServiceConfig(admin_token=ADMIN_TOKEN, ingest=IngestConfig(shedding=shedding))


def test_a_batch_past_the_bound_is_shed_and_counted() -> None:
    admission = IngestAdmission(SheddingConfig(max_in_flight_batches=2, exempt_bytes=100))
    assert admission.admit(5000) and admission.admit(None)
    assert not admission.admit(5000)  # the third large one
    assert not admission.admit(None)  # a body of unknown length is not taken for small
    assert admission.admit(100)  # a heartbeat's size is never shed, and counts as in flight
    assert (admission.state().in_flight, admission.state().shed) == (3, 2)
    admission.release()
    admission.release()
    assert admission.admit(5000)
    assert (admission.state().in_flight, admission.state().shed) == (2, 2)


@pytest.mark.parametrize("fields", [{"max_in_flight_batches": 0}, {"retry_after_s": 0}, {"exempt_bytes": -1}])
def test_a_bound_that_cannot_work_is_refused(fields: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match=next(iter(fields))):
        SheddingConfig(**fields)


def test_the_bounds_are_settings() -> None:
    config = read_service_config(
        {
            "RUNHEALTH_INGEST__SHEDDING__MAX_IN_FLIGHT_BATCHES": "8",
            "RUNHEALTH_INGEST__SHEDDING__RETRY_AFTER_S": "5",
            "RUNHEALTH_INGEST__SHEDDING__EXEMPT_BYTES": "0",
        }
    )
    assert config.ingest.shedding == SheddingConfig(max_in_flight_batches=8, retry_after_s=5, exempt_bytes=0)


def body_of(records: list[dict[str, object]]) -> bytes:
    return json.dumps({"records": records}).encode()


def metric(client: TestClient, name: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not exported")


@both_backends
def test_a_shed_batch_is_answered_429_with_retry_after_and_nothing_is_stored(
    client: TestClient, service: Service, run: RunHandle
) -> None:
    large = body_of(steps(60))
    assert len(large) > SMALL
    before = snapshot(service.engine)
    assert service.admission.admit(None)  # another batch holds the one place
    answer = client.post(run.records_path, content=large, headers=run.headers)
    assert answer.status_code == 429
    assert answer.headers["retry-after"] == "3"
    assert answer.json()["error"] == "overloaded" and "1 batches in flight" in answer.json()["message"]
    assert snapshot(service.engine) == before
    assert metric(client, "runhealth_ingest_shed_batches_total") == 1.0
    assert metric(client, "runhealth_ingest_batches_in_flight") == 1.0
    heartbeat = record_of_each_kind()[1]
    assert heartbeat["kind"] == "heartbeat"
    assert client.post(run.records_path, content=body_of([heartbeat]), headers=run.headers).status_code == 200
    service.admission.release()
    accepted = client.post(run.records_path, content=large, headers=run.headers)
    assert accepted.status_code == 200 and accepted.json()["accepted"] == 60
    assert service.admission.state().in_flight == 0


def test_a_refused_batch_leaves_its_place_free(client: TestClient, service: Service, run: RunHandle) -> None:
    """The place is given back however the batch ends: invalid, conflicting, or a bad token."""
    invalid = body_of([*steps(59), {**steps(1, first_attempt=59)[0], "tokens": -1}])
    assert client.post(run.records_path, content=invalid, headers=run.headers).status_code == 422
    assert client.post(run.records_path, content=b"{", headers=run.headers).status_code == 400
    bad_token = {"Authorization": "Bearer rh_run_nope"}
    assert client.post(run.records_path, content=body_of(steps(60)), headers=bad_token).status_code == 403
    assert service.admission.state().in_flight == 0
    assert client.post(run.records_path, content=body_of(steps(60)), headers=run.headers).status_code == 200


def test_shedding_comes_before_the_token_is_checked(
    client: TestClient, service: Service, run: RunHandle
) -> None:
    """A full queue answers at once: the token's check is a store read that would wait in it."""
    assert service.admission.admit(None)
    unknown = replace(run, name="no-such-run", token="rh_run_nope")
    answer = client.post(unknown.records_path, content=body_of(steps(60)), headers=unknown.headers)
    assert answer.status_code == 429 and answer.headers["retry-after"] == "3"
    service.admission.release()
