"""The service side runs without torch installed (simulated: the import is made to fail)."""

import subprocess
import sys
import textwrap
from pathlib import Path

CURVES = Path(__file__).parent / "data" / "real-curves"

SCRIPT = textwrap.dedent(
    """
    import sys
    for name in ("torch", "pynvml", "transformers", "lightning"):
        sys.modules[name] = None  # `import torch` now raises ImportError, as if not installed
    import json, uuid
    from monitor.cli import main
    from monitor.api import routes, server  # noqa: F401
    from monitor.judge import engine
    from monitor.store import migrate, queries, export
    from monitor.store.db import create_store_engine, resolve_url
    from monitor.ingest.schemas import BatchIn
    from monitor.service import Service
    from monitor.config import ServiceConfig

    db = sys.argv[1]
    engine_ = create_store_engine(resolve_url(db, {}))
    migrate.upgrade(engine_)
    service = Service(engine_, ServiceConfig())
    with engine_.begin() as connection:
        queries.create_run(connection, "r")
    inc = str(uuid.uuid4())
    records = [{"kind": "step", "incarnation": inc, "rank": 0, "attempt": a, "step": a, "time": 0.0,
                "loss_sum": "NaN" if a == 3 else 2.0, "tokens": 1} for a in range(1, 5)]
    service.ingest("r", 1, BatchIn.model_validate_json(json.dumps({"records": records})).records)
    try:
        main(["incidents", "--db", db, "--json"])
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    try:
        main(["backtest", sys.argv[2], "--json"])
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
    """
)


def test_service_cli_and_backtest_run_without_torch(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            str(tmp_path / "s.db"),
            str(CURVES / "megatron_gpt3_15b_release_h100.csv"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert '"kind": "nonfinite"' in result.stdout
    assert '"steps": 10173' in result.stdout
