"""Fixtures: a real store (SQLite file, or a database on the session's PostgreSQL server),
the service over it, an HTTP client, and a run with its token."""

from __future__ import annotations

import os
import time
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


class MigratedStores:
    """Stores migrated to the newest schema revision, once per session, for ``store`` to copy.
    Running the migrations for each of the suite's ~400 tests that take ``store`` cost 0.15 s
    (SQLite) to 0.45 s (PostgreSQL) each on an idle machine, and 0.3-0.9 s in ``make test``: a
    copy of the file, or ``CREATE DATABASE ... TEMPLATE``, is the same schema for a fraction.
    PostgreSQL's are made again each UTC day: its migration partitions the time-keyed tables
    from the day it runs on."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._sqlite: Path | None = None
        self._postgres: dict[int, str] = {}

    def sqlite_copy(self, path: Path) -> None:
        if self._sqlite is None:
            self._sqlite = self.root / "store.db"
            _migrate(URL.create("sqlite", database=str(self._sqlite)))
        # Owner-only, as create_store_engine makes a new store's file.
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as copy:
            copy.write(self._sqlite.read_bytes())

    def postgres_copy(self, server: PostgresServer) -> URL:
        day = int(time.time() // 86_400)
        if day not in self._postgres:
            template = server.create_database("migrated")
            _migrate(template)
            self._postgres[day] = str(template.database)
        return server.create_database(template=self._postgres[day])


def _migrate(url: URL) -> None:
    engine = create_store_engine(url)
    try:
        migrate.upgrade(engine)
        assert migrate.is_current(engine)
    finally:
        engine.dispose()  # no connection left: a template must have none, a file no -wal


@pytest.fixture(scope="session")
def migrated_stores(tmp_path_factory: pytest.TempPathFactory) -> MigratedStores:
    return MigratedStores(tmp_path_factory.mktemp("migrated"))


MIGRATED = pytest.StashKey[bool]()
"""Set on a test whose ``store_url`` is already a copy of a migrated store."""


@pytest.fixture
def store_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> URL:
    """The test's own database: empty, or, for a test that takes ``store`` (known from its
    signature), a copy of the session's migrated one."""
    migrated = "store" in request.node.fixturenames
    request.node.stash[MIGRATED] = migrated
    copies: MigratedStores | None = request.getfixturevalue("migrated_stores") if migrated else None
    if backend == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        return server.create_database() if copies is None else copies.postgres_copy(server)
    assert backend == "sqlite", backend
    path = tmp_path / "store.db"
    if copies is not None:
        copies.sqlite_copy(path)
    return URL.create("sqlite", database=str(path))


@pytest.fixture
def empty_store(store_url: URL) -> Iterator[Engine]:
    """A store with no schema yet."""
    engine = create_store_engine(store_url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def store(empty_store: Engine, request: pytest.FixtureRequest) -> Engine:
    """A store at the newest schema revision."""
    if not request.node.stash.get(MIGRATED, False):
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
