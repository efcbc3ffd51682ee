"""Grafana dashboards: generated from the metric names, committed, provisioned from files."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from monitor.observe import dashboards
from monitor.observe.metrics import names
from tests.support import require_binary, require_module

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "grafana"
COMMITTED = GRAFANA / "dashboards"
# What Grafana substitutes before a query reaches Prometheus, for checking the queries offline.
SUBSTITUTIONS = {"$__rate_interval": "1m", "$run": "run-a", "$node": ".*"}


def committed() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(COMMITTED.glob("*.json"))}


def substituted(expr: str) -> str:
    for variable, value in SUBSTITUTIONS.items():
        expr = expr.replace(variable, value)
    return expr


def test_the_committed_dashboards_are_what_the_code_generates(tmp_path: Path) -> None:
    dashboards.write(tmp_path)
    fresh = {path.name: path.read_text() for path in sorted(tmp_path.glob("*.json"))}
    stale = [name for name, text in fresh.items() if (COMMITTED / name).read_text() != text]
    assert set(fresh) == {p.name for p in COMMITTED.glob("*.json")}
    assert not stale, (
        f"regenerate: python -m monitor.observe.dashboards --write deploy/grafana/dashboards ({stale})"
    )


def test_the_module_entry_point_writes_the_dashboards(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "python"),
            "-m",
            "monitor.observe.dashboards",
            "--write",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(dashboards.DASHBOARDS)


def test_every_query_names_exported_metrics_and_every_metric_is_shown() -> None:
    shown: set[str] = set()
    for name, document in committed().items():
        for expr in dashboards.queries(document):
            used = set(re.findall(r"\brunhealth_[a-z0-9_]+", expr))
            assert used, f"{name}: {expr} shows no runhealth metric"
            assert used <= set(names.BY_NAME), f"{name}: {used - set(names.BY_NAME)}"
            shown |= used
    assert set(names.BY_NAME) == shown


def test_every_query_parses(tmp_path: Path) -> None:
    """promtool parses each query (as a recording rule), with Grafana's variables substituted."""
    yaml = require_module("yaml")
    exprs = [substituted(e) for document in committed().values() for e in dashboards.queries(document)]
    rules = [{"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    done = subprocess.run(
        [str(require_binary("promtool")), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_layout_is_valid_grafana() -> None:
    for name, document in committed().items():
        ids = [panel["id"] for panel in document["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in document["panels"]:
            grid = panel["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, (name, panel["title"])
            assert panel["targets"] and all(
                t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]
            )
        variables = {v["name"] for v in document["templating"]["list"]}
        assert {"datasource", "run"} <= variables, name
        incidents = [a for a in document["annotations"]["list"] if a.get("name") == "Incidents"]
        assert incidents and incidents[0]["useValueForTime"] is True, name


@pytest.mark.parametrize("section", ["datasources", "dashboards"])
def test_provisioning_files(section: str) -> None:
    yaml = require_module("yaml")
    (path,) = (GRAFANA / "provisioning" / section).glob("*.yml")
    document = yaml.safe_load(path.read_text())
    assert document["apiVersion"] == 1
    if section == "datasources":
        (source,) = document["datasources"]
        assert source["type"] == "prometheus" and source["isDefault"] is True
    else:
        (provider,) = document["providers"]
        assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
