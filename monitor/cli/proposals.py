"""``runhealth proposals``, ``approve ID`` and ``reject ID``: the decision workflow.

Listing reads the service (with ``--url`` or a token) or else the store. Deciding with an
operator token goes through the service at ``--url``, which records the token's operator. Without
one it is this OS user's decision (``local:USER``): through the store's running service, found by
its discovery file (``monitor.api.discovery``) and asked with its admin token, or on the store
itself when none runs, by the same decision code the service runs."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from monitor.api.discovery import Discovery, DiscoveryError, discovery_path, read_discovery, why_not_live
from monitor.cli.options import (
    DbOption,
    JsonOption,
    TokenOption,
    UrlOption,
    cli_user,
    open_engine,
    reading,
)
from monitor.cli.render import UserError, out, print_json, table
from monitor.config import ServiceConfig
from monitor.settings import service_config
from monitor.store import queries
from monitor.store.db import resolve_url, sqlite_path

OPERATOR_TOKEN = "RUNHEALTH_OPERATOR_TOKEN"

LocalDbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        help="Decide as this OS user on this store (default: $RUNHEALTH_DB, else ./runhealth.db): "
        "through its running service (<db>.service.json), else on the store itself.",
    ),
]
LocalConfigOption = Annotated[
    str | None,
    typer.Option(
        "--config",
        help="The service's settings file, used when deciding on the store itself (default: "
        "$RUNHEALTH_CONFIG).",
    ),
]

PROPOSAL_COLUMNS = [
    "id",
    "run",
    "incident",
    "status",
    "action",
    "rewind to",
    "data",
    "quarantine",
    "verdict",
    "lost steps",
    "decided by",
]


def service_url(url: str | None) -> str:
    return (url or os.environ.get("RUNHEALTH_URL") or "http://127.0.0.1:8765").rstrip("/")


def operator_token(token: str | None) -> str:
    found = token or os.environ.get(OPERATOR_TOKEN)
    if not found:
        raise UserError("an operator token is needed: --token or RUNHEALTH_OPERATOR_TOKEN")
    return found


def call_service(method: str, url: str, path: str, token: str, body: dict[str, Any] | None = None) -> Any:
    import httpx

    try:
        response = httpx.request(
            method, url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
    except httpx.HTTPError as exc:
        raise UserError(f"the service at {url} is unreachable: {exc}") from exc
    document = (
        response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    )
    if response.status_code in (401, 403):
        raise UserError(f"refused by the service: {document.get('message', response.status_code)}")
    # a 409 that carries the proposal is an answer (already decided), printed like any other
    if response.status_code >= 400 and not (response.status_code == 409 and "proposal" in document):
        raise UserError(document.get("message") or f"the service answered {response.status_code}")
    return document


def proposal_rows(proposals: Sequence[dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            p["id"],
            p["run"],
            p["incident"],
            p["status"],
            p["action"],
            f"step {p['target']['step']}" if p["target"]["step"] is not None else "",
            p["data_action"] + (f" {len(p['skip_batches'])} batches" if p["skip_batches"] else ""),
            "/".join(x for x in (p["quarantine"]["node"], p["quarantine"]["device"]) if x) or "",
            p["verdict"],
            p["cost_steps"],
            p["decided_by"] or "",
        ]
        for p in proposals
    ]


def proposals(
    db: DbOption = None,
    run: Annotated[str | None, typer.Option(help="Only this run.")] = None,
    status: Annotated[
        str | None, typer.Option(help="pending, approved, executing, done, rejected, ...")
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """List recovery proposals (from the service with --url, else from the store)."""
    if url or token:
        query = "&".join(f"{k}={v}" for k, v in (("run", run), ("status", status)) if v)
        listed = call_service("GET", service_url(url), f"/v1/proposals?{query}", operator_token(token))[
            "proposals"
        ]
    else:
        with reading(db) as connection:
            listed = queries.list_proposals(connection, run, status)
    if as_json:
        print_json({"proposals": listed})
        return
    out.print(table("Proposals", PROPOSAL_COLUMNS, proposal_rows(listed)))


def decide(
    verb: str,
    proposal_id: int,
    reason: str | None,
    where: Where,
    as_json: bool,
) -> None:
    if where.by_operator_token():
        document = call_service(
            "POST",
            service_url(where.url),
            f"/v1/proposals/{proposal_id}/{verb}",
            operator_token(where.token),
            {"reason": reason},
        )
    else:
        document = decide_locally(verb, proposal_id, reason, where)
    if as_json:
        print_json(document)
    else:
        typer.echo(document["message"])
    if not document.get("ok"):
        raise SystemExit(1)


@dataclass(frozen=True)
class Where:
    """Where a decision is made: the options that say so."""

    db: str | None
    url: str | None
    token: str | None
    config_file: str | None

    def by_operator_token(self) -> bool:
        """``--url``/``--token``, or an operator token in the environment and no ``--db``: as
        before ``--db`` existed, an operator's decision over HTTP."""
        if self.db is not None and (self.url or self.token):
            raise UserError("--db finds the service itself: give --db, or --url and --token, not both")
        return bool(self.url or self.token or (self.db is None and os.environ.get(OPERATOR_TOKEN)))


def decide_locally(verb: str, proposal_id: int, reason: str | None, where: Where) -> dict[str, Any]:
    """As this OS user: through the store's live service, else on the store itself."""
    config = service_config(os.environ, file=where.config_file, db=where.db)
    store = resolve_url(config.db, os.environ)
    found = live_service(discovery_path(store))
    if found is None:
        return decide_on_store(verb, proposal_id, reason, config)
    body = {"reason": reason, "operator": cli_user()}
    answer: dict[str, Any] = call_service(
        "POST", found.url, f"/v1/proposals/{proposal_id}/{verb}", admin_token(found), body
    )
    return answer


def live_service(path: Path | None) -> Discovery | None:
    """The service the discovery file names, if it runs; a stale file is said in one line."""
    try:
        found = read_discovery(path) if path is not None else None
    except DiscoveryError as exc:
        raise UserError(f"{exc} (remove it if no service runs)") from exc
    if found is None:
        return None
    problem = why_not_live(found)
    if problem is not None:
        typer.echo(f"runhealth: {path}: {problem}; deciding on the store directly", err=True)
        return None
    return found


def admin_token(found: Discovery) -> str:
    """The service's admin token: from the file it names, or this environment's variable when
    the service took it from RUNHEALTH_ADMIN_TOKEN (an embedded service)."""
    if found.admin_token_file is None:
        token = os.environ.get("RUNHEALTH_ADMIN_TOKEN", "").strip()
        if not token:
            raise UserError(
                f"the service at {found.url} (pid {found.pid}) has its admin token from "
                "RUNHEALTH_ADMIN_TOKEN: set it here too, or decide with --url and --token"
            )
        return token
    try:
        token = Path(found.admin_token_file).read_text().strip()
    except OSError as exc:
        raise UserError(f"cannot read the admin token in {found.admin_token_file}: {exc.strerror}") from exc
    if not token:
        raise UserError(f"the admin token file {found.admin_token_file} is empty")
    return token


def decide_on_store(verb: str, proposal_id: int, reason: str | None, config: ServiceConfig) -> dict[str, Any]:
    """No service runs: the decision code the service runs, on the store, with its settings; the
    answer reads as the service's would (an unknown proposal is an error, as its 404 is)."""
    from monitor.recovery.decisions import Decisions, InvalidDecision, local_decider

    path = sqlite_path(resolve_url(config.db, os.environ))
    if path is not None and not path.exists():
        raise UserError(f"no store at {path}")
    engine = open_engine(config.db)
    try:
        decisions = Decisions(engine, config.decisions, time.time)
        outcome = decisions.decide(verb, proposal_id, local_decider(cli_user()), reason)
    except InvalidDecision as exc:
        raise UserError(str(exc)) from exc
    finally:
        engine.dispose()
    if not outcome.ok and outcome.proposal is None:
        raise UserError(outcome.message)
    return outcome.as_json()


def approve(
    proposal_id: Annotated[int, typer.Argument(metavar="ID")],
    reason: Annotated[str | None, typer.Option(help="Why (recorded in the audit log).")] = None,
    db: LocalDbOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    config_file: LocalConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Approve a proposal: as the operator whose token is given, else as this OS user."""
    decide("approve", proposal_id, reason, Where(db, url, token, config_file), as_json)


def reject(
    proposal_id: Annotated[int, typer.Argument(metavar="ID")],
    reason: Annotated[str, typer.Option(help="Why (required; recorded in the audit log).")],
    db: LocalDbOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    config_file: LocalConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Reject a proposal, with a reason: as the operator whose token is given, else as this OS user."""
    decide("reject", proposal_id, reason, Where(db, url, token, config_file), as_json)


def register(app: typer.Typer) -> None:
    app.command()(proposals)
    app.command()(approve)
    app.command()(reject)
