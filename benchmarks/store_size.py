"""Bytes on disk per 1,000,000 step records, on PostgreSQL (and SQLite with ``--sqlite``).

Writes ``--records`` step records of a run of ``--ranks`` ranks, one window per step, through
the service's own ingest path (``monitor.ingest.batches.ingest_batch`` and the per-window
summaries, one transaction per batch of one window), then reads the size of each table as
``runhealth db usage`` does, after ``VACUUM ANALYZE``. Records are what the hook sends from a
GPU rank: identity and layout (node, device UUID, data/tensor/pipeline ranks), progress,
``--sample-ids`` batch ids per window, token count, losses, grad norm, learning rate, loss
scale and the four phase timings, with values that vary from record to record.

    python benchmarks/store_size.py --postgres [--records 1000000] [--ranks 256] [--sample-ids 8]
    python benchmarks/store_size.py --db postgresql+psycopg2://... (an empty database)

It prints one JSON document: bytes per record and per 1,000,000 records of ``step_records``
(table, indexes and TOAST, summed over its partitions) and of the per-window summaries that
outlive retention, and how long the writes took. ``--retention`` then times one retention pass
that finds every record past the period (PostgreSQL drops their day partitions, SQLite deletes
their rows ``batch_rows`` at a time).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, installed or not

import sqlalchemy as sa  # noqa: E402
from sqlalchemy.engine import Engine, make_url  # noqa: E402

from monitor.ingest.batches import ingest_batch  # noqa: E402
from monitor.ingest.schemas import BatchIn  # noqa: E402
from monitor.judge.summaries import fold_new_steps  # noqa: E402
from monitor.store import migrate  # noqa: E402
from monitor.store.db import create_store_engine  # noqa: E402
from monitor.store.retention import RetentionConfig, maintain  # noqa: E402
from monitor.store.usage import usage  # noqa: E402


def window(incarnation: str, attempt: int, ranks: int, sample_ids: int, now: float, rng: random.Random) -> list[dict[str, Any]]:  # fmt: skip
    """One window's step records, one per rank, as a GPU rank's hook renders them."""
    records = []
    for rank in range(ranks):
        tokens = 4096 * 8 - rng.randrange(64)
        loss = 2.3 + rng.random() * 0.1
        records.append(
            {
                "kind": "step",
                "incarnation": incarnation,
                "rank": rank,
                "attempt": attempt,
                "step": attempt,
                "consumed": (attempt + 1) * 8 * ranks,
                "time": now + rng.random(),
                "node": f"gpu-node-{rank // 8:05d}",
                "device_uuid": f"GPU-{uuid.UUID(int=rank * 7919 + 1)}",
                "dp_rank": rank // 8,
                "tp_rank": rank % 8,
                "pp_rank": 0,
                "microbatches": 8,
                "sample_ids": [
                    attempt * ranks * sample_ids + rank * sample_ids + i for i in range(sample_ids)
                ]
                or None,
                "tokens": tokens,
                "loss_sum": loss * tokens,
                "reported_loss": loss,
                "grad_norm": 0.8 + rng.random(),
                "lr": 3e-4 * (1 - attempt * 1e-6),
                "loss_scale": 65536.0,
                "skipped": False,
                "data_wait_s": rng.random() * 1e-3,
                "forward_s": 0.11 + rng.random() * 1e-3,
                "backward_s": 0.23 + rng.random() * 1e-3,
                "optimizer_s": 0.012 + rng.random() * 1e-4,
            }
        )
    return records


def fill(engine: Engine, records: int, ranks: int, sample_ids: int) -> float:
    """Ingest ``records`` step records; the seconds it took."""
    rng = random.Random(0)
    incarnation = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    with engine.begin() as connection:
        run_id = connection.execute(
            sa.text("INSERT INTO runs (name, token_hash, created_at) VALUES ('size', 'x', 0) RETURNING id")
        ).scalar_one()
    start = time.perf_counter()
    now = time.time()
    for attempt in range(records // ranks):
        parsed = BatchIn.model_validate(
            {"records": window(incarnation, attempt, ranks, sample_ids, now, rng)}
        )
        with engine.begin() as connection:
            result = ingest_batch(connection, run_id, parsed.records, now)
            fold_new_steps(connection, run_id, result.new_rows.get("step", []))
        now += 1.0  # one step a second
    return time.perf_counter() - start


def measure(db: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = create_store_engine(make_url(db))
    try:
        migrate.upgrade(engine)
        seconds = fill(engine, args.records, args.ranks, args.sample_ids)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.exec_driver_sql("VACUUM ANALYZE" if engine.dialect.name == "postgresql" else "VACUUM")
        with engine.connect() as connection:
            found = usage(connection, RetentionConfig())
        passed = retention_pass(engine) if args.retention else None
    finally:
        engine.dispose()
    tables = {t.table: t for t in found.tables}
    stored = (args.records // args.ranks) * args.ranks
    steps, summaries = tables["step_records"], tables["step_summaries"]
    assert steps.bytes is not None and summaries.bytes is not None
    return {
        "backend": found.backend,
        "records": stored,
        "ranks": args.ranks,
        "sample_ids_per_record": args.sample_ids,
        "step_records_bytes": steps.bytes,
        "step_records_rows": steps.rows,
        "step_records_rows_estimated": steps.rows_estimated,
        "step_records_partitions": steps.partitions,
        "bytes_per_record": round(steps.bytes / stored, 1),
        "bytes_per_1m_records": steps.bytes * 1_000_000 // stored,
        "summaries": summaries.rows,
        "summary_bytes_per_1m_records": summaries.bytes * 1_000_000 // stored,
        "ingest_seconds": round(seconds, 1),
        **({"retention_pass": passed} if passed is not None else {}),
    }


def retention_pass(engine: Engine) -> dict[str, Any]:
    """One retention pass 30 days on, when every record written is past the period: on
    PostgreSQL day partitions dropped, on SQLite rows deleted in batches."""
    start = time.perf_counter()
    done = maintain(engine, RetentionConfig(), time.time() + 30 * 86400)
    return {
        "seconds": round(time.perf_counter() - start, 2),
        "partitions_dropped": len(done.dropped),
        "rows_deleted": done.deleted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--sample-ids", type=int, default=8, help="batch ids per record (0: none)")
    parser.add_argument("--postgres", action="store_true", help="start a throwaway PostgreSQL")
    parser.add_argument("--db", help="an empty database to fill (PostgreSQL or SQLite URL)")
    parser.add_argument("--sqlite", action="store_true", help="measure an SQLite file too")
    parser.add_argument(
        "--retention", action="store_true", help="then time one retention pass that removes every record"
    )
    args = parser.parse_args()
    if not (args.postgres or args.db or args.sqlite):
        parser.error("say where: --postgres, --db URL or --sqlite")
    results = []
    with tempfile.TemporaryDirectory(prefix="store_size_") as workdir:
        if args.postgres:
            from tests.support import PostgresServer  # the tests' throwaway cluster

            server = PostgresServer(Path(workdir) / "postgres")
            server.start()
            try:
                db = server.create_database("size").render_as_string(hide_password=False)
                results.append(measure(db, args))
            finally:
                server.stop()
        if args.db:
            results.append(measure(args.db, args))
        if args.sqlite:
            results.append(measure(f"sqlite:///{workdir}/size.db", args))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
