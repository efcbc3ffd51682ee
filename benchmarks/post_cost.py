"""What one POST of records costs the service on PostgreSQL, measured in one process.

A throwaway PostgreSQL (``tests.support.PostgresServer``), a fresh database per shape, and the
real HTTP app (``monitor.api.routes.create_app``) called as ASGI, with no client and no server in
between: each post is a pre-encoded body handed to the app, its answer read back. The service is
a replica (``Service.replicate``, as ``runhealth serve`` on PostgreSQL is), so a post stores and
answers and the run's judge looks separately: one look (``Service.judge_arrivals``) after every
round, a round being one post per group of ranks for the same two steps.

It prints as JSON, per shape (ranks per post): the process's CPU per post and per step record
(every thread: the event loop and the worker threads), the statements SQLAlchemy sent per post
(``before_cursor_execute``), connections checked out and transactions begun per post, the
PostgreSQL server's CPU per step record (its backends' ``/proc/<pid>/stat``), and the same for
the judge's looks.

    python benchmarks/post_cost.py --posts 400 --shapes 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet import Store
from fleet_senders import RankTemplates

from monitor.api.routes import create_app
from monitor.config import ServiceConfig
from monitor.service import Service
from monitor.store import migrate, queries
from monitor.store.db import create_store_engine
from monitor.store.leases import RunLeases

ADMIN_TOKEN = "rh_admin_post_cost"
WORLD = 8


@dataclass
class Tally:
    """What SQLAlchemy did, counted by engine and pool events."""

    statements: int = 0
    checkouts: int = 0
    transactions: int = 0

    def attach(self, engine: sa.Engine) -> None:
        sa.event.listen(engine, "before_cursor_execute", self._statement)
        sa.event.listen(engine, "begin", self._begin)
        sa.event.listen(engine.pool, "checkout", self._checkout)

    def _statement(self, *_args: Any) -> None:
        self.statements += 1

    def _begin(self, *_args: Any) -> None:
        self.transactions += 1

    def _checkout(self, *_args: Any) -> None:
        self.checkouts += 1

    def copy(self) -> Tally:
        return Tally(self.statements, self.checkouts, self.transactions)


@dataclass
class Costs:
    """CPU and counts summed over one kind of work (posts, or the judge's looks)."""

    cpu_s: float = 0.0
    postgres_cpu_s: float = 0.0
    count: int = 0
    tally: Tally = field(default_factory=Tally)

    def add(self, cpu_s: float, postgres_cpu_s: float, before: Tally, after: Tally) -> None:
        self.cpu_s += cpu_s
        self.postgres_cpu_s += postgres_cpu_s
        self.count += 1
        self.tally.statements += after.statements - before.statements
        self.tally.checkouts += after.checkouts - before.checkouts
        self.tally.transactions += after.transactions - before.transactions

    def figures(self, records: int, per: str) -> dict[str, Any]:
        n = max(self.count, 1)
        return {
            f"{per}s": self.count,
            f"cpu_us_per_{per}": round(1e6 * self.cpu_s / n),
            "cpu_us_per_record": round(1e6 * self.cpu_s / records, 1),
            "postgres_cpu_us_per_record": round(1e6 * self.postgres_cpu_s / records, 1),
            f"statements_per_{per}": round(self.tally.statements / n, 2),
            f"checkouts_per_{per}": round(self.tally.checkouts / n, 2),
            f"transactions_per_{per}": round(self.tally.transactions / n, 2),
        }


class Asgi:
    """The app called as ASGI: one request at a time, its status and body read back.

    The event loop runs in a thread of its own under one long-lived task, as a server's does
    (uvicorn's ``serve``): anyio keeps its worker threads for as long as that root task runs.
    Each request its own ``run_until_complete`` made each its own root task, and anyio stopped
    the worker thread when it ended: a thread started and stopped per post that no server pays.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Future[None] = self.loop.create_future()
        self._thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self._serve(),), name="post-cost-loop", daemon=True
        )
        self._thread.start()

    async def _serve(self) -> None:
        await self._stop  # a task, not a bare future: anyio looks among tasks for its root

    def post(self, path: str, query: str, token: str, body: bytes) -> tuple[int, bytes]:
        request = self._request(path, query, token, body)
        return asyncio.run_coroutine_threadsafe(request, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join()
        self.loop.close()

    async def _request(self, path: str, query: str, token: str, body: bytes) -> tuple[int, bytes]:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": [
                (b"authorization", f"Bearer {token}".encode()),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        sent = False
        status, chunks = 0, []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.sleep(3600)
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        return status, b"".join(chunks)


def bodies(incarnation: str, per_post: int, steps: int, rounds: int) -> list[list[tuple[int, bytes]]]:
    """Pre-encoded posts, round by round: each round every group of ``per_post`` ranks posts
    the same ``steps`` steps."""
    templates = [RankTemplates.of(incarnation, rank) for rank in range(WORLD)]
    now = time.time()
    out = []
    for number in range(rounds):
        posts = []
        for first in range(0, WORLD, per_post):
            records = [
                templates[rank].step_record(number * steps + step + 1, WORLD, now + number, False)
                for rank in range(first, first + per_post)
                for step in range(steps)
            ]
            posts.append((first, ('{"records":[' + ",".join(records) + "]}").encode()))
        out.append(posts)
    return out


def measure(url: sa.URL, store: Store, per_post: int, steps: int, posts: int) -> dict[str, Any]:
    config = ServiceConfig(db=url.render_as_string(hide_password=False), admin_token=ADMIN_TOKEN)
    service = Service(create_store_engine(url), config)
    tally = Tally()
    tally.attach(service.engine)
    leases = RunLeases(url, f"post-cost-{os.getpid()}")
    service.replicate(leases)
    app = Asgi(create_app(service))
    name, incarnation = f"cost-{uuid.uuid4().hex[:6]}", str(uuid.uuid4())
    status, answer = app.post("/v1/runs", "", ADMIN_TOKEN, json.dumps({"name": name}).encode())
    assert status == 201, answer
    token = json.loads(answer)["token"]
    start = {"kind": "run_start", "incarnation": incarnation, "time": time.time(), "world_size": WORLD}
    status, answer = app.post(
        f"/v1/runs/{name}/records", "", token, json.dumps({"records": [start]}).encode()
    )
    assert status == 200, answer
    with service.engine.connect() as connection:
        run_id = int(queries.run_row(connection, name).id)
    service.take_over(run_id)
    warmup = max(2, 40 // (WORLD // per_post))
    rounds = warmup + max(1, posts // (WORLD // per_post))
    posted, looked = Costs(), Costs()
    path = f"/v1/runs/{name}/records"
    for number, batch in enumerate(bodies(incarnation, per_post, steps, rounds)):
        counted = number >= warmup
        for first, body in batch:
            ranks = range(first, first + per_post)
            asked = [("rank", first)] if per_post == 1 else [("ranks", rank) for rank in ranks]
            query = urlencode([("incarnation", incarnation), *asked])
            timed(posted if counted else Costs(), store, tally, partial(app.post, path, query, token, body))
        timed(looked if counted else Costs(), store, tally, partial(service.judge_arrivals, run_id))
    app.close()
    leases.close()
    service.engine.dispose()
    records = max(1, posted.count * per_post * steps)
    return {
        "ranks_per_post": per_post,
        "steps_per_rank": steps,
        "post": posted.figures(records, "post"),
        "judge": looked.figures(records, "look"),
    }


def timed(costs: Costs, store: Store, tally: Tally, work: Callable[[], Any]) -> None:
    before, database = tally.copy(), store.database_cpu_s() or 0.0
    cpu = time.process_time()
    answer = work()
    cpu = time.process_time() - cpu
    if isinstance(answer, tuple) and answer[0] != 200:
        raise SystemExit(f"post_cost: a post was answered {answer[0]}: {answer[1][:500]!r}")
    costs.add(cpu, (store.database_cpu_s() or 0.0) - database, before, tally.copy())


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--posts", type=int, default=400, help="posts measured per shape (after a warm-up)")
    parser.add_argument("--shapes", type=int, nargs="+", default=[1, 8], help="ranks per post (divides 8)")
    parser.add_argument("--steps", type=int, default=2, help="step records per rank per post")
    parser.add_argument("--repeat", type=int, default=1, help="measure each shape this many times")
    args = parser.parse_args(argv)
    if any(shape < 1 or WORLD % shape for shape in args.shapes):
        parser.error(f"--shapes: each must divide {WORLD}")
    if args.posts < 1 or args.steps < 1:
        parser.error("--posts and --steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    from tests.support import PostgresServer

    args = parse(argv)
    base = Path(os.environ.get("TMPDIR", tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix="post_cost_", dir=base) as workdir:
        server = PostgresServer(Path(workdir) / "postgres")
        server.start()
        try:
            results = []
            for _ in range(args.repeat):
                for shape in args.shapes:
                    url = server.create_database("cost")
                    engine = create_store_engine(url)
                    migrate.upgrade(engine)
                    engine.dispose()
                    store = Store(url, postgres=server)
                    results.append(measure(url, store, shape, args.steps, args.posts))
            load = os.getloadavg()
            print(json.dumps({"load": [round(x, 2) for x in load], "shapes": results}, indent=2))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
