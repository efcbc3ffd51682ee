"""Grafana dashboards, generated from the metric names so they cannot drift from ``/metrics``.

Two dashboards: a run overview (loss, tokens per second, grad norm, LR, loss scale, incidents as
annotations, pending approvals, rank heartbeats, ingest) and a fleet view (clock-event time,
device and link error rates, straggler scores, canary results). The generated JSON is committed
under ``deploy/grafana/dashboards`` and a test fails when it is stale:

    python -m monitor.observe.dashboards --write deploy/grafana/dashboards
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monitor.observe.metrics import names as n

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RUN = 'run=~"$run"'
RUN_NODE = 'run=~"$run", node=~"$node"'
WINDOW = "$__rate_interval"
SCHEMA_VERSION = 39


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False
    unit: str = ""  # overrides the panel's unit for this query's series


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"
    unit: str = "short"
    width: int = 12
    height: int = 8
    description: str = ""
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    variables: tuple[dict[str, Any], ...]
    annotations: tuple[dict[str, Any], ...] = ()


def q(expr: str, legend: str = "", instant: bool = False, unit: str = "") -> Query:
    return Query(expr, legend, instant, unit)


def run_overview() -> Dashboard:
    return Dashboard(
        uid="runhealth-run",
        title="runhealth: run overview",
        description="One training run: progress, numerics, incidents and the service's view of its ranks.",
        variables=(datasource_variable(), run_variable()),
        annotations=(incident_annotation(),),
        panels=(
            Panel(
                "Step",
                (
                    q(f"{n.RUN_STEP.name}{{{RUN}}}", "step", instant=True),
                    q(f"{n.RUN_FINISHED.name}{{{RUN}}}", "finished", instant=True),
                ),
                "stat",
                width=4,
                height=4,
            ),
            Panel(
                "Open incidents",
                (q(f"sum by (severity) ({n.INCIDENTS_OPEN.name}{{{RUN}}})", "{{severity}}", instant=True),),
                "stat",
                width=5,
                height=4,
            ),
            Panel(
                "Pending approvals",
                (q(f"sum by (run) ({n.PROPOSALS_PENDING.name}{{{RUN}}})", "{{run}}", instant=True),),
                "stat",
                width=5,
                height=4,
                description="Recovery proposals waiting for an operator: runhealth proposals; "
                "runhealth approve ID.",
            ),
            Panel(
                "Newest resumable checkpoint",
                (
                    q(f"time() - {n.RUN_LAST_CHECKPOINT.name}{{{RUN}}}", "age", instant=True, unit="s"),
                    q(f"{n.RUN_LAST_CHECKPOINT_STEP.name}{{{RUN}}}", "step", instant=True),
                ),
                "stat",
                width=5,
                height=4,
            ),
            Panel(
                "Ranks heartbeating",
                (
                    q(f"{n.RUN_RANKS_HEARTBEATING.name}{{{RUN}}}", "heartbeating", instant=True),
                    q(f"{n.RUN_RANKS.name}{{{RUN}}}", "world size", instant=True),
                ),
                "stat",
                width=5,
                height=4,
            ),
            Panel(
                "Loss (token-weighted)",
                (q(f"{n.RUN_LOSS.name}{{{RUN}}}", "{{run}}"),),
                description="loss_sum / tokens over every rank of the newest judged window; "
                "red marks are incidents.",
            ),
            Panel(
                "Supervised tokens per second", (q(f"{n.RUN_TOKENS_PER_SECOND.name}{{{RUN}}}", "{{run}}"),)
            ),
            Panel(
                "Grad norm (before clipping)", (q(f"{n.RUN_GRAD_NORM.name}{{{RUN}}}", "{{run}}"),), width=8
            ),
            Panel("Learning rate", (q(f"{n.RUN_LEARNING_RATE.name}{{{RUN}}}", "{{run}}"),), width=8),
            Panel(
                "Loss scale and skipped updates",
                (
                    q(f"{n.RUN_LOSS_SCALE.name}{{{RUN}}}", "{{run}} loss scale"),
                    q(
                        f"increase({n.RUN_SKIPPED_UPDATES.name}{{{RUN}}}[{WINDOW}])",
                        "{{run}} skipped updates",
                    ),
                ),
                width=8,
            ),
            Panel(
                "Goodput",
                (q(f"{n.RUN_GOODPUT.name}{{{RUN}}}", "{{run}}"),),
                unit="percentunit",
                width=8,
                description="Productive training over the run's wall time, across its incarnations: "
                "runhealth goodput RUN says how each cause was measured.",
            ),
            Panel(
                "Badput by cause",
                (q(f"{n.RUN_BADPUT.name}{{{RUN}}}", "{{run}} {{cause}}"),),
                unit="s",
                width=8,
                description="Wall time lost: start-up and restore, checkpoint saves, work redone after "
                "rollbacks and restarts, hangs before detection, canaries, data wait, holds, down time.",
            ),
            Panel(
                "Checkpoint interval: today and advised",
                (
                    q(f"{n.RUN_CHECKPOINT_INTERVAL.name}{{{RUN}}}", "{{run}} today"),
                    q(f"{n.RUN_CHECKPOINT_INTERVAL_ADVISED.name}{{{RUN}}}", "{{run}} advised (Young/Daly)"),
                ),
                unit="s",
                width=8,
                description="Compute between saves today, and sqrt(2 x save cost x mean time between "
                "interruptions) from the run's own saves and interruptions (or the configured fleet rate).",
            ),
            Panel(
                "Rank heartbeats",
                (
                    q(f"time() - {n.RUN_OLDEST_HEARTBEAT.name}{{{RUN}}}", "{{run}} worst rank silence"),
                    q(f"time() - {n.RUN_LAST_HEARTBEAT.name}{{{RUN}}}", "{{run}} newest heartbeat age"),
                    q(f"time() - {n.RUN_LAST_RECORD.name}{{{RUN}}}", "{{run}} newest record age"),
                ),
                unit="s",
                description="Seconds since the least recent rank's newest heartbeat: a hung or dead rank "
                "shows here before its hang incident opens.",
            ),
            Panel(
                "Open incidents by kind",
                (
                    q(
                        f"sum by (kind, severity) ({n.INCIDENTS_OPEN.name}{{{RUN}}})",
                        "{{kind}} ({{severity}})",
                    ),
                ),
            ),
            Panel(
                "Records ingested",
                (
                    q(f"sum by (run) (rate({n.RECORDS_INGESTED.name}{{{RUN}}}[{WINDOW}]))", "{{run}} stored"),
                    q(
                        f"sum by (run) (rate({n.RECORDS_DUPLICATE.name}{{{RUN}}}[{WINDOW}]))",
                        "{{run}} duplicates",
                    ),
                    q(
                        f"sum by (run) (rate({n.RECORDS_LATE.name}{{{RUN}}}[{WINDOW}]))",
                        "{{run}} late (spooled)",
                    ),
                    q(
                        f"sum by (run) (rate({n.RECORDS_REJECTED.name}{{{RUN}}}[{WINDOW}]))",
                        "{{run}} rejected",
                    ),
                    q(
                        f"sum by (run) (rate({n.JUDGE_ERRORS.name}{{{RUN}}}[{WINDOW}]))",
                        "{{run}} judge errors",
                    ),
                    q(
                        f"sum by (run) (rate({n.BATCHES_GROUPED.name}{{{RUN}}}[{WINDOW}]))",
                        "{{run}} batches written in a group",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Ingest load (each service)",
                (
                    q(
                        f"sum by (instance) (rate({n.INGEST_SHED.name}[{WINDOW}]))",
                        "{{instance}} batches shed (429)",
                    ),
                    q(f"sum by (instance) ({n.INGEST_IN_FLIGHT.name})", "{{instance}} batches in flight"),
                ),
                description="Batches a service holds now, and those it refused with 429 past its bound "
                "(ingest.shedding.max_in_flight_batches); the hooks keep those and send them again.",
            ),
            Panel(
                "Preemption budget slack",
                (q(f"{n.PREEMPTION_SLACK.name}{{{RUN}}}", "{{run}}"),),
                unit="s",
                description="The platform's preemption warning minus the path to a durable checkpoint "
                "(p99 window + longest recent save + margin), after each measured save: below 0 a "
                "save started at the warning does not finish (RUNHEALTH_PREEMPTION_WARNING_S).",
            ),
            Panel(
                "Open incidents",
                (q(f"{n.INCIDENT_OPENED.name}{{{RUN}}} * 1000", instant=True),),
                "table",
                unit="dateTimeAsIso",
                width=24,
                description="Newest open incidents: runhealth incident ID shows one whole.",
                options={"showHeader": True},
            ),
        ),
    )


def fleet() -> Dashboard:
    return Dashboard(
        uid="runhealth-fleet",
        title="runhealth: fleet",
        description="Nodes and devices of a run: clock-event time, error rates, stragglers, canaries.",
        variables=(datasource_variable(), run_variable(), node_variable()),
        annotations=(incident_annotation(),),
        panels=(
            Panel(
                "Clock-event time by node and reason",
                (
                    q(
                        f"sum by (node, reason) (rate({n.DEVICE_CLOCK_EVENT.name}{{{RUN_NODE}}}[{WINDOW}]))",
                        "{{node}} {{reason}}",
                    ),
                ),
                unit="percentunit",
                description="Share of wall time the clocks were held down, summed over the node's devices.",
            ),
            Panel(
                "Slowest ranks (straggler ratio)",
                (
                    q(
                        f"topk(8, {n.STRAGGLER_SLOWDOWN.name}{{{RUN}}})",
                        "rank {{rank}} {{node}} {{phase}}",
                        True,
                    ),
                ),
                "bargauge",
                description="Smoothed time of each rank's worst phase over its data-parallel peers' median "
                "(1.0 = typical); the engine flags a straggler at 1.07.",
            ),
            Panel(
                "ECC errors",
                (
                    q(
                        "sum by (node, device, type) "
                        f"(rate({n.DEVICE_ECC_ERRORS.name}{{{RUN_NODE}}}[{WINDOW}]))",
                        "{{node}} {{device}} {{type}}",
                    ),
                ),
                unit="ops",
                width=8,
            ),
            Panel(
                "NVLink errors",
                (
                    q(
                        f"sum by (node, type) (rate({n.DEVICE_NVLINK_ERRORS.name}{{{RUN_NODE}}}[{WINDOW}]))",
                        "{{node}} {{type}}",
                    ),
                ),
                unit="ops",
                width=8,
            ),
            Panel(
                "PCIe replays",
                (
                    q(
                        f"sum by (node) (rate({n.DEVICE_PCIE_REPLAYS.name}{{{RUN_NODE}}}[{WINDOW}]))",
                        "{{node}}",
                    ),
                ),
                unit="ops",
                width=8,
            ),
            Panel(
                "InfiniBand/RoCE port errors",
                (
                    q(
                        "sum by (node, hca, port, counter) "
                        f"(rate({n.LINK_ERRORS.name}{{{RUN_NODE}}}[{WINDOW}]))",
                        "{{node}} {{hca}}/{{port}} {{counter}}",
                    ),
                ),
                unit="ops",
            ),
            Panel(
                "Ports active and rows awaiting remap",
                (
                    q(f"sum by (node) ({n.LINK_ACTIVE.name}{{{RUN_NODE}}})", "{{node}} ports active"),
                    q(
                        f"sum by (node) ({n.DEVICE_ROW_REMAP_PENDING.name}{{{RUN_NODE}}})",
                        "{{node}} devices with a row remap pending",
                    ),
                ),
            ),
            Panel(
                "Canary results",
                (q(f"sum by (result) ({n.CANARY_RANKS.name}{{{RUN}}})", "{{result}}"),),
                description="Ranks by their newest canary verdict (unchecked: no canary has run there yet).",
            ),
            Panel(
                "Devices whose newest canary missed",
                (q(f"{n.CANARY_MISMATCH.name}{{{RUN_NODE}}} * 1000", instant=True),),
                "table",
                unit="dateTimeAsIso",
                description="Silent data corruption suspects: the canary's output differed from the stack's "
                "reference. runhealth incidents --kind canary shows whether the re-run confirmed it.",
            ),
            Panel(
                "Device, link, canary and straggler incidents",
                (
                    q(
                        f"sum by (kind, severity) ({n.INCIDENTS_OPEN.name}"
                        f'{{{RUN}, kind=~"device|link|canary|straggler"}})',
                        "{{kind}} ({{severity}})",
                    ),
                ),
            ),
        ),
    )


def datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"}


def run_variable() -> dict[str, Any]:
    return _query_variable("run", "Run", f"label_values({n.RUN_STEP.name}, run)", include_all=False)


def node_variable() -> dict[str, Any]:
    return _query_variable("node", "Node", f"label_values({n.DEVICE_CLOCK_EVENT.name}{{{RUN}}}, node)", True)


def _query_variable(name: str, label: str, query: str, include_all: bool) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,  # on time range change: new runs appear without a reload
        "includeAll": include_all,
        "allValue": ".*" if include_all else None,
        "multi": include_all,
        "sort": 1,
    }


def incident_annotation() -> dict[str, Any]:
    """Each open incident as a mark at its opening time (the series' value, in ms)."""
    return {
        "name": "Incidents",
        "datasource": DATASOURCE,
        "enable": True,
        "iconColor": "red",
        "expr": f"{n.INCIDENT_OPENED.name}{{{RUN}}} * 1000",
        "useValueForTime": True,
        "step": "60s",
        "titleFormat": "incident {{incident}}: {{kind}} ({{severity}})",
        "textFormat": "run {{run}} {{scope}}: runhealth incident {{incident}}",
        "tagKeys": "kind,severity",
    }


def render(dashboard: Dashboard) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (schema 39), laid out left to right, top to bottom."""
    panels, x, y, row_height = [], 0, 0, 0
    for index, panel in enumerate(dashboard.panels, start=1):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        panels.append(_panel(index, panel, x, y))
        x, row_height = x + panel.width, max(row_height, panel.height)
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["runhealth"],
        "timezone": "utc",
        "editable": False,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": list(dashboard.variables)},
        "annotations": {"list": [_builtin_annotation(), *dashboard.annotations]},
        "panels": panels,
    }


def _panel(index: int, panel: Panel, x: int, y: int) -> dict[str, Any]:
    overrides = [
        {
            "matcher": {"id": "byFrameRefID", "options": _ref(i)},
            "properties": [{"id": "unit", "value": query.unit}],
        }
        for i, query in enumerate(panel.queries)
        if query.unit
    ]
    targets = [
        {
            "refId": _ref(i),
            "datasource": DATASOURCE,
            "expr": query.expr,
            "legendFormat": query.legend or "__auto",
            "instant": query.instant,
            "range": not query.instant,
        }
        for i, query in enumerate(panel.queries)
    ]
    return {
        "id": index,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": overrides},
        "options": panel.options,
        "targets": targets,
    }


def _ref(index: int) -> str:
    return chr(ord("A") + index)


def _builtin_annotation() -> dict[str, Any]:
    return {
        "builtIn": 1,
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard",
    }


DASHBOARDS = {"run-overview.json": run_overview, "fleet.json": fleet}


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, build in DASHBOARDS.items():
        path = directory / filename
        path.write_text(json.dumps(render(build()), indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


def queries(document: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a rendered dashboard: panel targets and annotations."""
    found = [t["expr"] for p in document["panels"] for t in p["targets"]]
    return found + [a["expr"] for a in document["annotations"]["list"] if "expr" in a]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m monitor.observe.dashboards", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--write", type=Path, required=True, metavar="DIR", help="write the dashboards here")
    args = parser.parse_args(argv)
    for path in write(args.write):
        print(path)


if __name__ == "__main__":
    main()
