"""``runhealth audit verify``: walk the audit log's keyed hash chain, check it against the
anchor, and name the first broken entry; ``runhealth audit rotate-key``: retire the key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from monitor.cli.options import DbOption, JsonOption, reading
from monitor.cli.render import print_json

AnchorOption = Annotated[
    Path | None,
    typer.Option(
        "--anchor",
        help="The anchor file the writers append the chain's head to (default: "
        "$RUNHEALTH_AUDIT_ANCHOR, else <db>.audit-anchor, when it exists).",
    ),
]


def audit_verify(db: DbOption = None, as_json: JsonOption = False, anchor: AnchorOption = None) -> None:
    """Check the audit log's hash chain, HMACs and anchor; name the first broken entry."""
    from monitor.store import audit
    from monitor.store.anchor import anchor_path, read_heads
    from monitor.store.audit_keys import AuditKeyError, key_source
    from monitor.store.db import resolve_url

    url = resolve_url(db, os.environ)
    source = key_source(url, os.environ)
    anchor_file = anchor or anchor_path(url, os.environ)
    if anchor is None and anchor_file is not None and not anchor_file.exists():
        anchor_file = None
    heads = read_heads(anchor_file) if anchor_file is not None else None
    with reading(db) as connection:
        keyring = source.keyring() if source is not None and source.available() else None
        keyed = audit.first_keyed(connection)
        if keyring is None and keyed is not None:
            where = source.describe() if source is not None else "$RUNHEALTH_AUDIT_KEY"
            raise AuditKeyError(
                f"cannot verify the audit log: its entries are keyed (entry {keyed.seq}, key "
                f"{keyed.key_id}) and there is no audit key at {where}"
            )
        checked = audit.verify(connection, keyring, heads)
    document = {
        "ok": checked.ok,
        "entries": checked.entries,
        "head": checked.head,
        "broken_seq": checked.broken_seq,
        "problem": checked.problem,
        "keyed": checked.keyed,
        "key_id": keyring.signing.id if keyring else None,
        "anchor_checked": checked.anchor_checked,
        "anchor": str(anchor_file) if anchor_file else None,
        "anchored_seq": checked.anchored_seq,
    }
    if as_json:
        print_json(document)
    elif checked.ok:
        typer.echo(f"audit log intact: {checked.entries} entries, head {checked.head}{_scope(document)}")
    else:
        typer.echo(f"audit log BROKEN at {checked.problem}", err=True)
    if not checked.ok:
        raise SystemExit(1)


def _scope(document: dict[str, object]) -> str:
    keyed = (
        f"HMACs checked (key {document['key_id']})"
        if document["keyed"]
        else "no audit key: HMACs not checked"
    )
    anchored = (
        f"anchor {document['anchor']} checked (newest anchored entry {document['anchored_seq']})"
        if document["anchor_checked"]
        else "no anchor checked"
    )
    return f"; {keyed}; {anchored}"


def audit_rotate_key(db: DbOption = None) -> None:
    """Retire the audit key file's key (kept in <key file>.retired/ to verify old entries) and
    write a new one; writers sign with it from their next entry on."""
    from monitor.store.audit_keys import AuditKeyError, key_source, rotate
    from monitor.store.db import resolve_url

    source = key_source(resolve_url(db, os.environ), os.environ)
    if source is None:
        raise AuditKeyError("this store has no audit key file: set RUNHEALTH_AUDIT_KEY_FILE")
    old, new = rotate(source)
    typer.echo(f"audit key {old} retired into {source.retired_dir}; new key {new} in {source.key_file}")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The keyed, hash-chained audit log.", no_args_is_help=True)
    group.command("verify")(audit_verify)
    group.command("rotate-key")(audit_rotate_key)
    app.add_typer(group, name="audit")
