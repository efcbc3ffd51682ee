"""``runhealth preflight``: checks before a launch, one line per failed check.

- the memory plan (``policies.memory_plan``): base weights at the plan's bits, plus the optional
  gradient, optimizer, activation and other terms, against the usable device budget;
- the preemption budget (``--run``): the run's p99 window and longest recent save, timed by the
  hook, plus the margin, against the platform's warning (``policies.preemption``);
- this node's devices: the canary suite run twice on each, against the golden fingerprints the
  store holds for the device's stack (``collectors.node_check``).

Exit status 0: every check passed. 1: a check failed (each failure is one line on stderr,
``preflight: FAIL <check>: <why>``). 2: the command could not check (bad input, an unreadable
store). ``--json`` prints every check either way.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any

import sqlalchemy as sa
import typer

from monitor.cli.options import DbOption, JsonOption, reading
from monitor.cli.render import UserError, print_json
from monitor.judge.saves import run_budget
from monitor.store import models, queries
from monitor.store.db import DEFAULT_DB_FILE
from policies.memory_plan import MemoryPlan, check_memory_plan
from policies.preemption import PreemptionConfig

FAILED = 1
GOLDEN = models.table_of(models.CanaryGolden)
STEP = models.table_of(models.StepRecord)
_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """``70B``, ``7.5b``, ``125M``, ``70e9`` or ``70000000000``: a parameter count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text, re.IGNORECASE)
    if not match:
        raise UserError(f"not a parameter count: {text!r} (use 70B, 125M, 7e9 or a plain number)")
    return float(match.group(1)) * _SUFFIX[match.group(2).lower()]


def memory_check(plan_args: dict[str, Any]) -> dict[str, Any] | None:
    if plan_args["parameters"] is None:
        return None
    if plan_args["budget_gib"] is None:
        raise UserError("--params needs --budget-gib: the usable memory of one device, in GiB")
    try:
        plan = MemoryPlan(
            parameters=parse_count(plan_args["parameters"]),
            trainable_parameters=parse_count(plan_args["trainable"]) if plan_args["trainable"] else 0.0,
            **{k: v for k, v in plan_args.items() if k not in ("parameters", "trainable")},
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    verdict = check_memory_plan(plan)
    return {
        "check": "memory",
        "ok": verdict.fits,
        "message": verdict.message(),
        "total_bytes": verdict.total_bytes,
        "budget_bytes": verdict.budget_bytes,
        "headroom_bytes": verdict.headroom_bytes,
        "base_only": verdict.base_only,
        "terms": [{"name": t.name, "bytes": t.bytes, "arithmetic": t.arithmetic} for t in verdict.terms],
    }


def budget_check(db: str | None, run: str, warning_s: float | None, margin_s: float) -> dict[str, Any]:
    """The preemption budget from ``run``'s newest incarnation: its windows and measured saves
    against the platform's warning (``policies.preemption``)."""
    if warning_s is None:
        raise UserError("--run needs the platform's warning: --warning-s or RUNHEALTH_PREEMPTION_WARNING_S")
    try:
        config = PreemptionConfig(warning_s=warning_s, margin_s=margin_s)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    with reading(db) as connection:
        run_id = int(queries.run_row(connection, run).id)
        # the incarnation that reported last: the one a relaunch follows
        incarnation = connection.execute(
            sa.select(STEP.c.incarnation).where(STEP.c.run_id == run_id).order_by(STEP.c.id.desc()).limit(1)
        ).scalar()
        budget = run_budget(connection, run_id, incarnation, config) if incarnation else None
    if budget is None:
        return {
            "check": "preemption_budget",
            "ok": False,
            "message": f"run {run} has no timed window and measured save to check the budget with "
            "(the hook times saves between rh.checkpoint_saving() and rh.checkpoint_saved())",
        }
    verb = "fits" if budget.fits else "does not fit"
    return {
        "check": "preemption_budget",
        "ok": budget.fits,
        "message": f"run {run}'s save path {verb} the warning: {budget.arithmetic()} "
        f"(slack {budget.slack_s:.3g} s; p99 of {budget.windows} windows, longest of {budget.saves} timed saves)",
        "warning_s": budget.warning_s,
        "window_s": budget.window_s,
        "save_s": budget.save_s,
        "margin_s": budget.margin_s,
        "slack_s": budget.slack_s,
    }


def golden_fingerprints(db: str | None) -> dict[str, dict[str, str]]:
    """The store's golden fingerprints by stack; none when no store is named and the default
    file is absent (a node that has never been part of a monitored run)."""
    if db is None and not os.environ.get("RUNHEALTH_DB") and not os.path.exists(DEFAULT_DB_FILE):
        return {}
    golden: dict[str, dict[str, str]] = {}
    with reading(db) as connection:
        for row in connection.execute(sa.select(GOLDEN.c.stack_key, GOLDEN.c.kernel, GOLDEN.c.fingerprint)):
            golden.setdefault(row.stack_key, {})[row.kernel] = row.fingerprint
    return golden


def canary_checks(db: str | None) -> list[dict[str, Any]]:
    golden = golden_fingerprints(db)
    try:
        from collectors.node_check import check_node  # torch: only where the canaries run
    except ImportError as exc:
        return [
            {
                "check": "canary",
                "ok": False,
                "message": f"the canary suite needs torch ({exc}); pass --no-canaries to skip it",
            }
        ]
    return [
        {
            "check": "canary",
            "ok": device.ok,
            "message": device.message(),
            "device": device.device,
            "stack_key": device.stack_key,
            "compared": device.compared,
            "unstable": list(device.unstable),
            "missed": list(device.missed),
            "seconds": device.seconds,
        }
        for device in check_node(golden)
    ]


def preflight(
    params: Annotated[str | None, typer.Option("--params", help="Model parameters: 70B, 125M, 7e9.")] = None,
    bits: Annotated[
        float, typer.Option("--bits", help="Bits per base weight (16 for bf16, 4 for 4-bit).")
    ] = 16.0,
    budget_gib: Annotated[
        float | None, typer.Option("--budget-gib", help="Usable memory of one device, GiB.")
    ] = None,
    trainable: Annotated[
        str | None, typer.Option("--trainable-params", help="Parameters that train (all, or the adapters').")
    ] = None,
    gradient_bits: Annotated[
        float, typer.Option("--gradient-bits", help="Bits per gradient of a trainable parameter.")
    ] = 0.0,
    optimizer_bytes: Annotated[
        float,
        typer.Option(
            "--optimizer-bytes", help="Optimizer bytes per trainable parameter (Adam with fp32 master: 12)."
        ),
    ] = 0.0,
    activations_gib: Annotated[
        float, typer.Option("--activations-gib", help="Activation memory per device, GiB.")
    ] = 0.0,
    other_gib: Annotated[float, typer.Option("--other-gib", help="Anything else resident, GiB.")] = 0.0,
    shards: Annotated[
        int, typer.Option("--shards", help="Devices that shard weights, gradients and optimizer state.")
    ] = 1,
    run: Annotated[
        str | None,
        typer.Option("--run", help="Check the preemption budget with this run's measured windows and saves."),
    ] = None,
    warning_s: Annotated[
        float | None,
        typer.Option(
            "--warning-s",
            envvar="RUNHEALTH_PREEMPTION_WARNING_S",
            help="The platform's preemption warning, seconds.",
        ),
    ] = None,
    margin_s: Annotated[
        float, typer.Option("--margin-s", help="T_margin of the budget, seconds (network and disk jitter).")
    ] = PreemptionConfig().margin_s,
    canaries: Annotated[
        bool, typer.Option("--canaries/--no-canaries", help="Run the canary suite on this node's devices.")
    ] = True,
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Check a launch before it starts: exit 0 if every check passes, 1 if one fails."""
    plan_args = {
        "parameters": params,
        "bits": bits,
        "budget_gib": budget_gib,
        "trainable": trainable,
        "gradient_bits": gradient_bits,
        "optimizer_bytes_per_parameter": optimizer_bytes,
        "activations_gib": activations_gib,
        "other_gib": other_gib,
        "shards": shards,
    }
    checks = [check for check in [memory_check(plan_args)] if check is not None]
    if run is not None:
        checks.append(budget_check(db, run, warning_s, margin_s))
    if canaries:
        checks += canary_checks(db)
    if not checks:
        raise UserError(
            "nothing to check: give a memory plan (--params, --bits, --budget-gib) or drop --no-canaries"
        )
    ok = all(check["ok"] for check in checks)
    if as_json:
        print_json({"ok": ok, "exit_status": 0 if ok else FAILED, "checks": checks})
    else:
        for check in checks:
            if check["ok"]:
                typer.echo(f"preflight: ok {check['check']}: {check['message']}")
            else:
                typer.echo(f"preflight: FAIL {check['check']}: {check['message']}", err=True)
    raise SystemExit(0 if ok else FAILED)


def register(app: typer.Typer) -> None:
    app.command()(preflight)
