"""``runhealth audit verify``: walk the audit log's hash chain and name the first broken entry."""

from __future__ import annotations

import typer

from monitor.cli.options import DbOption, JsonOption, reading
from monitor.cli.render import print_json


def audit_verify(db: DbOption = None, as_json: JsonOption = False) -> None:
    """Check the audit log's hash chain; name the first broken entry."""
    from monitor.store.audit import verify

    with reading(db) as connection:
        checked = verify(connection)
    document = {
        "ok": checked.ok,
        "entries": checked.entries,
        "head": checked.head,
        "broken_seq": checked.broken_seq,
        "problem": checked.problem,
    }
    if as_json:
        print_json(document)
    elif checked.ok:
        typer.echo(f"audit log intact: {checked.entries} entries, head {checked.head}")
    else:
        typer.echo(f"audit log BROKEN at {checked.problem}", err=True)
    if not checked.ok:
        raise SystemExit(1)


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The hash-chained audit log.", no_args_is_help=True)
    group.command("verify")(audit_verify)
    app.add_typer(group, name="audit")
