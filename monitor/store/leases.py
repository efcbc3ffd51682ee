"""Which replica judges which run, when several ``runhealth serve`` share one PostgreSQL.

Any replica stores any run's records; one at a time judges a run. Its lease is a session-level
advisory lock (``RUN_JUDGE``, the run's id) held on a connection of its own, outside the pool,
named ``runhealth-judge <replica>`` (its ``application_name``). The lock lives exactly as long
as that session, so there is no expiry to renew and no clock to trust:

- a replica killed (SIGKILL, OOM) has its socket closed by its kernel; PostgreSQL ends the
  session and frees its locks at once, and another replica takes the runs at its next look;
- a host that vanishes without closing its sockets is found by TCP keepalives, set on both ends
  of the session to give up after ``dead_peer_s``;
- a replica that stops looking at its leases (stopped, hung, or in a judging pass longer than
  ``dead_peer_s``) has its session ended by PostgreSQL once it is idle that long
  (``idle_session_timeout``), so its runs go to a replica that does look;
- a replica whose own session fails stops judging every run it held (``refresh`` returns them
  as lost) before anyone else can have them for longer than one look.

Runs are shared out evenly: a replica takes runs nobody holds up to its share (runs divided by
the live replicas, rounded up) and gives back what it holds beyond it, so a replica that joins
gets work and none is taken from a replica that holds only its share. Who holds what is in
``pg_locks``, readable from any session (``holders``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.pool import NullPool

from monitor.store.locks import RUN_JUDGE

log = logging.getLogger("runhealth.leases")

APPLICATION_PREFIX = "runhealth-judge "
# PostgreSQL keeps 63 bytes of an application_name.
NAME_LIMIT = 63


@dataclass(frozen=True)
class LeaseChanges:
    gained: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    """Runs this replica no longer judges: given back beyond its share, or its session failed."""


class RunLeases:
    """This replica's leases; ``held`` is safe to read from any thread."""

    def __init__(self, url: URL, replica: str, dead_peer_s: float = 8.0) -> None:
        self.replica = replica
        self._url = url
        self._dead_peer_s = dead_peer_s
        self._engine: Engine | None = None
        self._connection: Connection | None = None
        self._held: frozenset[int] = frozenset()
        self._lock = threading.Lock()

    @property
    def application_name(self) -> str:
        return (APPLICATION_PREFIX + self.replica)[:NAME_LIMIT]

    def held(self) -> frozenset[int]:
        return self._held

    def holds(self, run_id: int) -> bool:
        return run_id in self._held

    def refresh(self, runs: Sequence[int]) -> LeaseChanges:
        """One look: take runs nobody judges up to this replica's share of ``runs``, give back
        the surplus. A failing session loses every lease (the caller stops judging them)."""
        with self._lock:
            try:
                return self._refresh(runs)
            except sa.exc.DBAPIError as exc:
                lost = tuple(sorted(self._held))
                log.warning("lease session failed (%s): stopped judging runs %s", exc.orig, list(lost))
                self._drop_session()
                return LeaseChanges(lost=lost)

    def close(self) -> None:
        """Give every lease back now (a clean stop: the other replicas take over at once)."""
        with self._lock:
            self._drop_session()

    def _refresh(self, runs: Sequence[int]) -> LeaseChanges:
        connection = self._session()
        replicas = connection.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name LIKE :pattern"
            ),
            {"pattern": APPLICATION_PREFIX + "%"},
        ).scalar_one()
        share = math.ceil(len(runs) / max(int(replicas), 1))
        held = set(self._held) & set(runs)
        gone = self._held - held  # deleted runs: nothing to judge, give the lock back too
        surplus = sorted(held)[share:] if len(held) > share else []
        for run_id in [*gone, *surplus]:
            self._unlock(connection, run_id)
            held.discard(run_id)
        gained = []
        for run_id in runs:
            if len(held) >= share:
                break
            if run_id not in held and self._try_lock(connection, run_id):
                held.add(run_id)
                gained.append(run_id)
        self._held = frozenset(held)
        return LeaseChanges(tuple(gained), tuple(sorted([*gone, *surplus])))

    def _try_lock(self, connection: Connection, run_id: int) -> bool:
        statement = sa.text("SELECT pg_try_advisory_lock(:space, :run)")
        return bool(connection.execute(statement, {"space": RUN_JUDGE, "run": run_id}).scalar_one())

    def _unlock(self, connection: Connection, run_id: int) -> None:
        connection.execute(
            sa.text("SELECT pg_advisory_unlock(:space, :run)"), {"space": RUN_JUDGE, "run": run_id}
        )

    def _session(self) -> Connection:
        if self._connection is not None:
            return self._connection
        idle = max(1, int(self._dead_peer_s / 2))
        interval = max(1, int(self._dead_peer_s / 4))
        # Autocommit: the session holds locks, never an open transaction (which would keep
        # PostgreSQL from vacuuming anything newer than it).
        self._engine = sa.create_engine(
            self._url,
            poolclass=NullPool,
            isolation_level="AUTOCOMMIT",
            connect_args={
                "application_name": self.application_name,
                "keepalives": 1,
                "keepalives_idle": idle,
                "keepalives_interval": interval,
                "keepalives_count": 2,
                "connect_timeout": max(1, int(self._dead_peer_s)),
            },
        )
        connection = self._engine.connect()
        # The server's side: a replica host gone silent is dropped, and its locks freed, too.
        for name, value in (("tcp_keepalives_idle", idle), ("tcp_keepalives_interval", interval)):
            connection.execute(sa.text(f"SET {name} = {int(value)}"))
        connection.execute(sa.text("SET tcp_keepalives_count = 2"))
        # And a replica alive but stuck (stopped, hung, its judging pass too long) looks at its
        # leases no more: PostgreSQL ends a session idle this long, and its locks with it.
        connection.execute(sa.text(f"SET idle_session_timeout = {int(self._dead_peer_s * 1000)}"))
        self._connection = connection
        return connection

    def _drop_session(self) -> None:
        connection, engine = self._connection, self._engine
        self._connection, self._engine, self._held = None, None, frozenset()
        if connection is not None:
            try:
                connection.close()  # ends the session: PostgreSQL frees its locks
            except sa.exc.DBAPIError:
                pass  # already gone: so are its locks
        if engine is not None:
            engine.dispose()


def holders(connection: Connection, runs: Iterable[int] | None = None) -> dict[int, str]:
    """Each judged run's replica (its lease session's name without the prefix), as
    PostgreSQL's lock table says now; ``runs`` narrows it."""
    rows = connection.execute(
        sa.text(
            "SELECT l.objid, a.application_name FROM pg_locks l "
            "JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 "
            "AND l.classid = :space AND l.database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())"
        ),
        {"space": RUN_JUDGE},
    ).all()
    wanted = None if runs is None else set(runs)
    return {
        int(objid): str(name).removeprefix(APPLICATION_PREFIX)
        for objid, name in rows
        if wanted is None or int(objid) in wanted
    }


def judges_by_name(connection: Connection) -> dict[str, str]:
    """Each judged run's replica, by run name (``holders``, for listings)."""
    judges = holders(connection)
    if not judges:
        return {}
    names = connection.execute(
        sa.text("SELECT id, name FROM runs WHERE id = ANY(:ids)"), {"ids": sorted(judges)}
    ).all()
    return {str(name): judges[int(run_id)] for run_id, name in names}
