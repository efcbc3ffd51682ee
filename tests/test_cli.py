"""The command line: listings with --json, filters, export, and one-line user errors."""

import ast
import io
import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import typer
import typer.main

from monitor.api.server import prepare_store
from monitor.cli.incidents import collapse_evidence
from monitor.cli.root import COMMAND_GROUPS, build_app, groups_for
from monitor.config import ServiceConfig
from monitor.ingest.schemas import BatchIn
from monitor.service import Service
from monitor.store import migrate, queries
from monitor.store.db import create_store_engine, resolve_url
from tests.support import cli_result

CURVES = Path(__file__).parent / "data" / "real-curves"


def seed_store(db: Path) -> None:
    """A run of 80 windows on 2 ranks with a loss spike at step 70 and a NaN at step 75."""
    engine = create_store_engine(resolve_url(str(db), {}))
    migrate.upgrade(engine)
    service = Service(engine, ServiceConfig())
    with engine.begin() as connection:
        queries.create_run(connection, "cli-run")
        run_id = int(queries.run_row(connection, "cli-run").id)
    incarnation = str(uuid.uuid4())
    records = [{"kind": "run_start", "incarnation": incarnation, "time": 0.0, "world_size": 2}]
    for step in range(1, 81):
        loss = 8.0 if step == 70 else ("NaN" if step == 75 else 2.0 + 0.01 * (step % 3))
        for rank in (0, 1):
            records.append(
                {
                    "kind": "step",
                    "incarnation": incarnation,
                    "rank": rank,
                    "attempt": step,
                    "step": step,
                    "time": float(step),
                    "node": f"node-{rank}",
                    "tokens": 100,
                    "loss_sum": loss if isinstance(loss, str) else loss * 100,
                    "grad_norm": 1.0,
                }
            )
    batch = BatchIn.model_validate_json(json.dumps({"records": records}))
    service.ingest("cli-run", run_id, batch.records)
    engine.dispose()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    db = tmp_path / "cli.db"
    seed_store(db)
    return db


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli_result(capsys, "--help")
    assert code == 0
    for command in ("serve", "db", "runs", "incidents", "incident", "backtest", "export", "demo"):
        assert command in out


def test_a_command_starts_without_the_backtest_readers(tmp_path: Path) -> None:
    """polars and the series readers load when a backtest runs: every other command (an approve
    at 3 AM, a ``serve``, an embedded service on a trainer's node) started 0.35 s of CPU later
    with them, 1.57 against 1.22 s for ``import monitor.cli`` here."""
    probe = "import sys, monitor.cli; monitor.cli.build_app(); print(sorted(m for m in sys.modules if m.split('.')[0] == 'polars' or m == 'monitor.judge.backtest'))"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


def test_the_root_dispatches_each_command_to_the_module_that_registers_it() -> None:
    """``COMMAND_GROUPS`` names what each module registers (``--help`` lists top-level
    commands, then groups, each in its order): a command line builds the app from its command's
    module alone, and a name no module registers gets click's answer from the whole app."""
    for group, names in COMMAND_GROUPS.items():
        assert tuple(typer.main.get_command(build_app((group,))).commands) == names, group  # type: ignore[attr-defined]
    every = tuple(typer.main.get_command(build_app()).commands)  # type: ignore[attr-defined]
    assert sorted(every) == sorted(name for names in COMMAND_GROUPS.values() for name in names)
    assert groups_for(["approve", "7", "--reason", "x"]) == ("proposals",)
    assert groups_for(["--help"]) == groups_for(["no-such-command"]) == groups_for([]) == tuple(COMMAND_GROUPS)


def test_a_command_imports_its_own_module_only(tmp_path: Path) -> None:
    """Importing every group for any command (the backtest readers, the settings schema, the
    judge's configs) cost each command about 0.3 s of CPU here."""
    probe = (
        "import sys\nfrom monitor.cli import main\ntry:\n    main(['incidents', '--help'])\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('monitor.cli.')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded = set(ast.literal_eval(done.stdout.strip().splitlines()[-1]))
    assert loaded & set(COMMAND_GROUPS) == {"incidents"}, loaded


def test_incidents_json_and_filters(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli_result(capsys, "incidents", "--db", str(store), "--json")
    assert code == 0
    incidents = json.loads(out)["incidents"]
    assert {(i["kind"], i["first_step"]) for i in incidents} == {("spike", 70), ("nonfinite", 75)}
    _, out, _ = cli_result(capsys, "incidents", "--db", str(store), "--json", "--kind", "nonfinite")
    assert [i["first_step"] for i in json.loads(out)["incidents"]] == [75]
    _, out, _ = cli_result(
        capsys, "incidents", "--db", str(store), "--json", "--severity", "critical", "--run", "other"
    )
    assert json.loads(out)["incidents"] == []
    _, out, _ = cli_result(capsys, "incidents", "--db", str(store), "--json", "--since", "1h")
    assert len(json.loads(out)["incidents"]) == 2
    _, out, _ = cli_result(capsys, "incidents", "--db", str(store), "--json", "--until", "2000-01-01")
    assert json.loads(out)["incidents"] == []


def shown_incident(store: Path, capsys: pytest.CaptureFixture[str], kind: str) -> tuple[int, str]:
    """The id of the store's incident of ``kind`` and its ``runhealth incident --json``."""
    _, out, _ = cli_result(capsys, "incidents", "--db", str(store), "--json", "--kind", kind)
    incident_id = json.loads(out)["incidents"][0]["id"]
    code, out, _ = cli_result(capsys, "incident", str(incident_id), "--db", str(store), "--json")
    assert code == 0
    return incident_id, out


def test_incident_shows_its_evidence_with_nan_encoded(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    incident_id, out = shown_incident(store, capsys, "nonfinite")
    assert '"value": "NaN"' in out
    shown = json.loads(out)
    assert shown["evidence"][0]["signal"] == "loss"
    code, out, _ = cli_result(capsys, "incident", str(incident_id), "--db", str(store))
    assert code == 0 and "nonfinite" in out


def test_a_finding_repeated_at_consecutive_steps_is_one_evidence_row() -> None:
    def finding(
        step: int, signal: str = "loss", rank: int | None = None, value: float = math.nan
    ) -> dict[str, Any]:
        return {
            "step": step,
            "kind": "nonfinite",
            "signal": signal,
            "severity": "critical",
            "value": value,
            "threshold": None,
            "rank": rank,
            "message": f"{signal} at {step}",
        }

    evidence = [f for s in range(121, 769) for f in (finding(s), finding(s, "grad_norm"), finding(s, rank=0))]
    evidence += [finding(900, value=3.0), finding(901, value=5.0), finding(950)]  # a gap: a new run
    runs = collapse_evidence(evidence)
    assert [(r.first["step"], r.last_step, r.count, r.first["signal"], r.first["rank"]) for r in runs] == [
        (121, 768, 648, "grad_norm", None),
        (121, 768, 648, "loss", None),
        (121, 768, 648, "loss", 0),
        (900, 901, 2, "loss", None),
        (950, 950, 1, "loss", None),
    ]
    assert (runs[3].low, runs[3].high) == (3.0, 5.0)


def test_incident_collapses_repeated_evidence_unless_asked_for_all(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    incident_id, out = shown_incident(store, capsys, "spike")
    findings = len(json.loads(out)["evidence"])
    code, every, _ = cli_result(capsys, "incident", str(incident_id), "--db", str(store), "--all")
    assert code == 0 and every.count("│ 70 ") == findings  # one row per finding, all at step 70


def test_runs_lists_and_creates(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli_result(capsys, "runs", "--db", str(store), "--json")
    (run,) = json.loads(out)["runs"]
    assert (run["name"], run["latest_step"], run["open_incidents"]) == ("cli-run", 80, 2)
    code, out, _ = cli_result(capsys, "runs", "create", "second", "--db", str(store), "--json")
    assert code == 0 and json.loads(out)["token"].startswith("rh_run_")
    code, _, err = cli_result(capsys, "runs", "create", "second", "--db", str(store))
    assert code == 2 and err.count("\n") == 1 and "already exists" in err
    code, _, err = cli_result(capsys, "runs", "create", "../x y", "--db", str(store))
    assert code == 2 and err.count("\n") == 1 and "not a run name" in err  # the API would refuse it


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_export_steps_and_incidents(
    store: Path, tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    steps_file = tmp_path / f"steps{suffix}"
    code, out, _ = cli_result(capsys, "export", "cli-run", "--out", str(steps_file), "--db", str(store))
    assert code == 0 and "wrote 80 steps rows" in out
    frame = pl.read_parquet(steps_file) if suffix == ".parquet" else pl.read_csv(steps_file)
    assert frame.height == 80
    nan_row = frame.filter(pl.col("step") == 75)
    assert math.isnan(nan_row["loss"][0])
    history = tmp_path / f"incidents{suffix}"
    code, out, _ = cli_result(
        capsys, "export", "cli-run", "--what", "incidents", "--out", str(history), "--db", str(store)
    )
    assert code == 0 and "wrote 2 incidents rows" in out
    code, out, _ = cli_result(
        capsys,
        "export",
        "cli-run",
        "--what",
        "records",
        "--out",
        str(tmp_path / f"r{suffix}"),
        "--db",
        str(store),
    )
    assert "wrote 160 records rows" in out


def test_exported_steps_backtest_to_the_same_incidents(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps_file = tmp_path / "steps.csv"
    cli_result(capsys, "export", "cli-run", "--out", str(steps_file), "--db", str(store))
    code, out, _ = cli_result(capsys, "backtest", str(steps_file), "--json")
    assert code == 0
    assert {(i["kind"], i["first_step"]) for i in json.loads(out)["incidents"]} == {
        ("spike", 70),
        ("nonfinite", 75),
    }


def test_backtest_json_document_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli_result(
        capsys, "backtest", str(CURVES / "bigscience_chronicle_excerpts.csv"), "--json", "--run", "tr8-104B"
    )
    assert code == 0
    document = json.loads(out)
    assert {"run", "steps", "findings", "incidents"} <= document.keys()
    assert set(document["findings"][0]) >= {
        "step",
        "kind",
        "severity",
        "signal",
        "value",
        "threshold",
        "message",
    }
    assert set(document["incidents"][0]) >= {"id", "kind", "severity", "first_step", "last_step", "summary"}


@pytest.mark.parametrize(
    "args",
    [
        ["backtest", "/nonexistent/file.csv"],
        ["backtest", str(CURVES / "labels.csv")],
        ["backtest", str(CURVES / "labels.csv"), "--preset", "magic"],
        ["incident", "999", "--db", "{db}"],
        ["incidents", "--db", "{db}", "--severity", "huge"],
        ["incidents", "--db", "{db}", "--since", "yesterday-ish"],
        ["export", "nope", "--out", "x.csv", "--db", "{db}"],
        ["export", "cli-run", "--out", "x.xlsx", "--db", "{db}"],
        ["incidents", "--db", "{fresh}"],
    ],
)
def test_user_errors_are_one_line_and_exit_2(
    store: Path, tmp_path: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.format(db=store, fresh=tmp_path / "fresh.db") for a in args]
    code, _out, err = cli_result(capsys, *args)
    assert code == 2
    assert err.startswith("runhealth: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize("bad", ["ragged row", "directory", "NUL bytes", "not readable"])
def test_backtest_of_a_file_it_cannot_read_is_one_line_and_exit_2(
    tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: polars' ragged-row error and hint on three lines, and click's usage box for a
    file the user may not read."""
    path = tmp_path / "bad.csv"
    if bad == "ragged row":
        path.write_text("step,loss\n1,2.0\n2,2.0,5\n")
    elif bad == "directory":
        path.mkdir()
    elif bad == "NUL bytes":
        path.write_bytes(bytes(1000))
    else:
        # Root (these tests' usual user) reads anything: refuse as the system refuses another user.
        path.write_text("step,loss\n1,2.0\n")
        access, open_path = os.access, Path.open

        def refused_access(name: Any, mode: int, *args: Any, **kwargs: Any) -> bool:
            return False if Path(name) == path else access(name, mode, *args, **kwargs)

        def refused_open(self: Path, *args: Any, **kwargs: Any) -> Any:
            if self == path:
                raise PermissionError(13, "Permission denied", str(path))
            return open_path(self, *args, **kwargs)

        monkeypatch.setattr(os, "access", refused_access)
        monkeypatch.setattr(Path, "open", refused_open)
    code, out, err = cli_result(capsys, "backtest", str(path))
    assert (code, out) == (2, "")
    assert err.startswith(f"runhealth: error: cannot read {path}: ") and err.count("\n") == 1, err


def test_usage_errors_exit_nonzero_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli_result(capsys, "incidents", "--no-such-flag")
    assert code != 0 and "Traceback" not in err


@pytest.mark.parametrize(
    "args",
    [
        ["incidents"],
        ["incident", "1"],
        ["proposals"],
        ["checkpoints", "cli-run"],
        ["runs"],
        ["audit", "verify"],
        ["export", "cli-run", "--out", "{tmp}/x.csv"],
        ["gate", "cli-run"],
        ["db", "current"],
        ["db", "downgrade", "base", "--yes"],
    ],
)
def test_a_mistyped_store_on_a_reading_command_is_not_created(
    tmp_path: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    typo = tmp_path / "typo" / "runheath.db"
    code, out, err = cli_result(capsys, *[a.format(tmp=tmp_path) for a in args], "--db", str(typo))
    assert (code, out, err) == (2, "", f"runhealth: error: no store at {typo}\n")
    assert not typo.exists() and not typo.parent.exists()


def test_db_upgrade_and_serve_still_create_a_new_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = tmp_path / "new" / "s.db"
    code, out, _ = cli_result(capsys, "db", "upgrade", "--db", str(new))
    assert code == 0 and out.startswith("store at revision ") and new.exists()
    service = prepare_store(ServiceConfig(db=str(tmp_path / "served.db")), {})
    service.engine.dispose()
    assert (tmp_path / "served.db").exists()


def test_db_downgrade_without_yes_and_without_a_terminal_is_refused(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli_result(capsys, "db", "downgrade", "base", "--db", str(store))
    assert code == 2 and out == ""
    assert (
        err.startswith("runhealth: error: db downgrade drops data")
        and "--yes" in err
        and err.count("\n") == 1
    )
    assert cli_result(capsys, "runs", "--db", str(store), "--json")[0] == 0  # nothing was dropped


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("answer", "code"), [("n\n", 2), ("y\n", 0)])
def test_db_downgrade_asks_on_a_terminal(
    store: Path, answer: str, code: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", Terminal(answer))
    done, out, err = cli_result(capsys, "db", "downgrade", "base", "--db", str(store))
    assert done == code and "Downgrade" in out, (out, err)
    current = cli_result(capsys, "db", "current", "--db", str(store))[1]
    assert current.startswith("current None" if code == 0 else "current 0"), current


def test_db_downgrade_with_yes_does_not_ask(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli_result(capsys, "db", "downgrade", "base", "--yes", "--db", str(store))
    assert (code, out) == (0, "store at revision None\n")
