"""Alert rules, their unit tests and the Alertmanager routing, checked with the real tools."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from monitor.observe.metrics import names
from tests.support import require_binary, require_module

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "rules.yml"
RULE_TESTS = PROMETHEUS / "tests"
ALERTMANAGER = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
# Metrics Prometheus makes itself, not runhealth.
PROMETHEUS_OWN = {"up"}


def run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60, check=False)


def load(path: Path) -> Any:
    yaml = require_module("yaml")
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load(RULES)["groups"] for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules() -> None:
    done = run(require_binary("promtool"), "check", "rules", RULES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


def test_promtool_runs_the_rule_unit_tests() -> None:
    tests = sorted(RULE_TESTS.glob("*.yml"))
    assert tests
    done = run(require_binary("promtool"), "test", "rules", *tests)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_checks_the_prometheus_config() -> None:
    done = run(require_binary("promtool"), "check", "config", PROMETHEUS / "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_tested_firing_and_quiet() -> None:
    """Each alert has a unit test where it fires and one where it must not."""
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS.glob("*.yml"):
        for case in load(path)["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = {rule["alert"] for rule in alert_rules()}
    assert alerts == firing, f"never seen firing: {alerts - firing}"
    assert alerts == quiet, f"never seen quiet: {alerts - quiet}"


def test_the_issue_s_alerts_are_all_there() -> None:
    assert {rule["alert"] for rule in alert_rules()} == {
        "RunhealthCriticalIncident",
        "RunhealthProposalAwaitingApproval",
        "RunhealthRankHung",
        "RunhealthStraggler",
        "RunhealthDeviceCriticalError",
        "RunhealthRunSilent",
        "RunhealthRecordsLate",
        "RunhealthMonitorDown",
        "RunhealthPreemptionBudgetShort",
    }


def test_rules_route_by_severity_and_use_only_exported_metrics() -> None:
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        for metric in metric_names(rule["expr"]):
            assert metric in names.BY_NAME or metric in PROMETHEUS_OWN, f"{rule['alert']}: {metric}"


def metric_names(expr: str) -> set[str]:
    """Identifiers that name series: runhealth_* and the bare names of Prometheus's own."""
    found = set(re.findall(r"\brunhealth_[a-z0-9_]+", expr))
    return found | {name for name in PROMETHEUS_OWN if re.search(rf"\b{name}\{{", expr)}


def test_amtool_checks_the_alertmanager_config() -> None:
    done = run(require_binary("amtool"), "check-config", ALERTMANAGER)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 inhibit rules" in done.stdout and "2 receivers" in done.stdout


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["severity=critical", "run=r1", "alertname=RunhealthRankHung"], "page"),
        (["severity=warning", "run=r1", "alertname=RunhealthStraggler"], "ticket"),
        (["run=r1", "alertname=Unlabelled"], "ticket"),
    ],
)
def test_amtool_routes_critical_to_the_pager_and_warnings_to_tickets(
    labels: list[str], receiver: str
) -> None:
    done = run(
        require_binary("amtool"),
        "config",
        "routes",
        "test",
        f"--config.file={ALERTMANAGER}",
        f"--verify.receivers={receiver}",
        *labels,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_alerts_group_by_run_and_warnings_are_inhibited_under_a_critical_of_the_same_run() -> None:
    config = load(ALERTMANAGER)
    assert config["route"]["group_by"] == ["run"]
    (inhibit,) = config["inhibit_rules"]
    assert inhibit == {
        "source_matchers": ['severity="critical"'],
        "target_matchers": ['severity="warning"'],
        "equal": ["run"],
    }
    urls = [hook["url"] for receiver in config["receivers"] for hook in receiver["webhook_configs"]]
    assert all(".invalid/" in url for url in urls)  # placeholders, marked in the file
    assert ALERTMANAGER.read_text().count("PLACEHOLDER") >= len(urls)
