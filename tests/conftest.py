"""Fixtures: a real store (SQLite file, or a database on the session's PostgreSQL server),
the service over it, an HTTP client, and a run with its token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import URL, Engine

from monitor.api.routes import create_app
from monitor.config import ServiceConfig
from monitor.service import Service
from monitor.store import migrate
from monitor.store.db import create_store_engine
from tests.prometheus_support import RULES, PrometheusServer
from tests.scheduling import longest_first
from tests.support import ADMIN_TOKEN, PostgresServer, RunHandle, make_run, require_module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first, for ``make test``'s workers (``tests.scheduling``)."""
    longest_first(items, config.rootpath)


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """One PostgreSQL 15 server for the whole session; each test gets its own database."""
    require_module("psycopg2")
    server = PostgresServer(tmp_path_factory.mktemp("postgres"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def prometheus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    """One Prometheus for the whole session, evaluating deploy/prometheus/rules.yml every
    second; a test points it at its own targets (``set_targets``)."""
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), [RULES])
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def backend() -> str:
    """The store's backend; ``tests.support.both_backends`` parametrizes it."""
    return "sqlite"


@pytest.fixture
def store_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> URL:
    if backend == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        return server.create_database()
    assert backend == "sqlite", backend
    return URL.create("sqlite", database=str(tmp_path / "store.db"))


@pytest.fixture
def empty_store(store_url: URL) -> Iterator[Engine]:
    """A store with no schema yet."""
    engine = create_store_engine(store_url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def store(empty_store: Engine) -> Engine:
    """A store at the newest schema revision."""
    migrate.upgrade(empty_store)
    return empty_store


@pytest.fixture
def service_config() -> ServiceConfig:
    return ServiceConfig(admin_token=ADMIN_TOKEN)


@pytest.fixture
def service(store: Engine, service_config: ServiceConfig) -> Service:
    return Service(store, service_config)


@pytest.fixture
def client(service: Service) -> Iterator[TestClient]:
    with TestClient(create_app(service)) as test_client:
        yield test_client


@pytest.fixture
def run(store: Engine) -> RunHandle:
    return make_run(store, "run-a")


@pytest.fixture
def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}
