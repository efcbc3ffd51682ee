"""``runhealth proposals``, ``approve ID`` and ``reject ID``: the decision workflow.

Listing reads the service (with ``--url`` or a token) or else the store; deciding always goes
through the service, which checks the operator's token and records who decided."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from monitor.cli.options import DbOption, JsonOption, TokenOption, UrlOption, reading
from monitor.cli.render import UserError, out, print_json, table
from monitor.store import queries

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
    found = token or os.environ.get("RUNHEALTH_OPERATOR_TOKEN")
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
    verb: str, proposal_id: int, reason: str | None, url: str | None, token: str | None, as_json: bool
) -> None:
    document = call_service(
        "POST",
        service_url(url),
        f"/v1/proposals/{proposal_id}/{verb}",
        operator_token(token),
        {"reason": reason},
    )
    if as_json:
        print_json(document)
    else:
        typer.echo(document["message"])
    if not document.get("ok"):
        raise SystemExit(1)


def approve(
    proposal_id: Annotated[int, typer.Argument(metavar="ID")],
    reason: Annotated[str | None, typer.Option(help="Why (recorded in the audit log).")] = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Approve a proposal as the operator the token belongs to."""
    decide("approve", proposal_id, reason, url, token, as_json)


def reject(
    proposal_id: Annotated[int, typer.Argument(metavar="ID")],
    reason: Annotated[str, typer.Option(help="Why (required; recorded in the audit log).")],
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Reject a proposal, with a reason."""
    decide("reject", proposal_id, reason, url, token, as_json)


def register(app: typer.Typer) -> None:
    app.command()(proposals)
    app.command()(approve)
    app.command()(reject)
