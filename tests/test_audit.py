"""The keyed, anchored audit log: each way of tampering with a store someone can write to,
and what ``runhealth audit verify`` names; where the key and the anchor live; key rotation."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.store import audit
from monitor.store.anchor import read_heads
from monitor.store.audit_keys import AuditKeyError, Key, KeySource, key_source
from tests.support import both_backends, cli_result

OLD_SECRET = "o" * 40
NEW_SECRET = "n" * 40


def db_of(store: Engine) -> str:
    return str(store.url.database)


def add_operators(capsys: pytest.CaptureFixture[str], store: Engine, *names: str) -> None:
    """One audit entry each, written the way an operator does: the CLI on the store."""
    for name in names:
        code, _, err = cli_result(capsys, "operators", "add", name, "--db", db_of(store))
        assert code == 0, err


def entries(store: Engine) -> list[dict[str, Any]]:
    with store.connect() as connection:
        return [
            dict(r) for r in connection.execute(sa.select(audit.AUDIT).order_by(audit.AUDIT.c.seq)).mappings()
        ]


def rechain(store: Engine, start: int) -> None:
    """What an attacker with the store but not the key does: recompute every hash from
    ``start`` on, so the hash chain holds again."""
    rows = entries(store)
    previous = next((r["hash"] for r in rows if r["seq"] == start - 1), audit.GENESIS)
    with store.begin() as connection:
        for row in (r for r in rows if r["seq"] >= start):  # prev_hash is unique: free them first
            free = sa.update(audit.AUDIT).where(audit.AUDIT.c.seq == row["seq"])
            connection.execute(free.values(prev_hash=f"free-{row['seq']}"))
        for row in (r for r in rows if r["seq"] >= start):
            row = {**row, "prev_hash": previous}
            row["hash"] = audit.entry_hash(row)
            connection.execute(
                sa.update(audit.AUDIT)
                .where(audit.AUDIT.c.seq == row["seq"])
                .values(prev_hash=row["prev_hash"], hash=row["hash"])
            )
            previous = row["hash"]


def execute(store: Engine, *statements: str) -> None:
    with store.begin() as connection:
        for statement in statements:
            connection.execute(sa.text(statement))


def edit_and_rechain(store: Engine) -> None:
    execute(store, "UPDATE audit_log SET subject = 'operator:mallory' WHERE seq = 2")
    rechain(store, 2)


def swap_and_rechain(store: Engine) -> None:
    # prev_hash is unique: swap through a free value
    execute(
        store,
        "UPDATE audit_log SET seq = 1000 WHERE seq = 2",
        "UPDATE audit_log SET seq = 2 WHERE seq = 3",
        "UPDATE audit_log SET seq = 3 WHERE seq = 1000",
    )
    rechain(store, 2)


def forge_append(store: Engine, mac: Callable[[str], tuple[str | None, str | None]]) -> None:
    tail = entries(store)[-1]
    forged = {
        **tail,
        "seq": tail["seq"] + 1,
        "actor": "operator:alice",
        "action": "approved",
        "subject": "proposal:2",
        "prev_hash": tail["hash"],
    }
    forged["hash"] = audit.entry_hash(forged)
    forged["key_id"], forged["mac"] = mac(forged["hash"])
    with store.begin() as connection:
        connection.execute(audit.AUDIT.insert(), forged)


def under_another_key(digest: str) -> tuple[str | None, str | None]:
    key = Key.of(b"x" * 40)
    return key.id, key.sign(audit.PURPOSE, digest)


TAMPERING: dict[str, tuple[Callable[[Engine], None], int, str]] = {
    "edited, hashes recomputed": (edit_and_rechain, 2, "its HMAC does not match"),
    "swapped, hashes recomputed": (swap_and_rechain, 2, "its HMAC does not match"),
    "forged append, no HMAC": (lambda s: forge_append(s, lambda _: (None, None)), 5, "carries no HMAC"),
    "forged append, another key": (lambda s: forge_append(s, under_another_key), 5, "not in the keyring"),
    "tail cut off": (lambda s: execute(s, "DELETE FROM audit_log WHERE seq >= 3"), 3, "its tail was cut off"),
    "table wiped": (lambda s: execute(s, "DELETE FROM audit_log"), 1, "it was wiped"),
    "details not JSON": (
        lambda s: execute(s, "UPDATE audit_log SET details = '{\"granted\": tru' WHERE seq = 2"),
        2,
        "unreadable: its details are not valid JSON",
    ),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_verify_names_the_first_broken_entry_of_each_tampering(
    store: Engine, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    add_operators(capsys, store, "alice", "bob", "carol", "dave")
    code, out, _ = cli_result(capsys, "audit", "verify", "--db", db_of(store), "--json")
    intact = json.loads(out)
    assert code == 0 and intact["ok"] and intact["keyed"] and intact["anchor_checked"]
    assert intact["entries"] == 4 and intact["anchored_seq"] == 4
    tamper, broken, reason = TAMPERING[case]
    tamper(store)
    code, out, err = cli_result(capsys, "audit", "verify", "--db", db_of(store))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"audit log BROKEN at entry {broken}: ")
    assert reason in err
    code, out, _ = cli_result(capsys, "audit", "verify", "--db", db_of(store), "--json")
    document = json.loads(out)
    assert code == 1 and not document["ok"] and document["broken_seq"] == broken
    assert reason in document["problem"]


def test_without_the_anchor_a_cut_tail_is_a_shorter_valid_chain(
    store: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    add_operators(capsys, store, "alice", "bob", "carol")
    anchor = Path(f"{db_of(store)}.audit-anchor")
    kept = tmp_path / "anchor-copy"
    kept.write_bytes(anchor.read_bytes())
    anchor.unlink()  # the anchor is wiped with the tail: only a copy elsewhere still knows
    execute(store, "DELETE FROM audit_log WHERE seq = 3")
    code, out, _ = cli_result(capsys, "audit", "verify", "--db", db_of(store), "--json")
    assert code == 0 and json.loads(out)["anchor_checked"] is False
    code, _, err = cli_result(capsys, "audit", "verify", "--db", db_of(store), "--anchor", str(kept))
    assert code == 1 and "entry 3: missing" in err and "tail was cut off" in err


def test_the_key_and_the_anchor_are_0600_files_beside_the_store(
    store: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    add_operators(capsys, store, "alice", "bob")
    key_file, anchor = Path(f"{db_of(store)}.audit-key"), Path(f"{db_of(store)}.audit-anchor")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(anchor.stat().st_mode) == 0o600
    heads = read_heads(anchor)
    stored = entries(store)
    assert [(h.seq, h.hash) for h in heads] == [(r["seq"], r["hash"]) for r in stored]
    key = KeySource("store", key_file=key_file).keyring().signing
    assert {r["key_id"] for r in stored} == {key.id} == {h.key_id for h in heads}
    assert key_file.read_text().strip() not in json.dumps([{**r, "time": 0} for r in stored])


def test_a_missing_or_open_key_is_one_line(store: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    add_operators(capsys, store, "alice")
    key_file = Path(f"{db_of(store)}.audit-key")
    key_file.chmod(0o644)
    code, _, err = cli_result(capsys, "operators", "add", "bob", "--db", db_of(store))
    assert (
        code == 2
        and err
        == f"runhealth: error: the audit key file {key_file} is open to others (mode 0644): chmod 600 {key_file}\n"
    )
    key_file.unlink()
    code, _, err = cli_result(capsys, "operators", "add", "bob", "--db", db_of(store))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"runhealth: error: no audit key: {key_file} does not exist")
    code, _, err = cli_result(capsys, "audit", "verify", "--db", db_of(store))
    assert code == 2 and err.count("\n") == 1
    assert "cannot verify the audit log: its entries are keyed (entry 1, key " in err
    assert len(entries(store)) == 1  # the refused entry was not written unkeyed


def test_rotation_keeps_old_entries_verifiable(store: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    add_operators(capsys, store, "alice", "bob")
    code, out, err = cli_result(capsys, "audit", "rotate-key", "--db", db_of(store))
    assert code == 0, err
    key_file = Path(f"{db_of(store)}.audit-key")
    retired = list(Path(f"{key_file}.retired").iterdir())
    assert len(retired) == 1 and stat.S_IMODE(retired[0].stat().st_mode) == 0o600
    add_operators(capsys, store, "carol", "dave")
    key_ids = [r["key_id"] for r in entries(store)]
    assert key_ids[0] == key_ids[1] == retired[0].name != key_ids[2] == key_ids[3]
    code, out, _ = cli_result(capsys, "audit", "verify", "--db", db_of(store), "--json")
    assert code == 0 and json.loads(out)["key_id"] == key_ids[3]
    retired[0].unlink()  # the old key lost: its entries can no longer be checked
    code, out, _ = cli_result(capsys, "audit", "verify", "--db", db_of(store), "--json")
    assert code == 1 and json.loads(out)["problem"].startswith(f"entry 1: it is signed with key {key_ids[0]}")


@both_backends
def test_rotation_through_the_environment(store: Engine, tmp_path: Path) -> None:
    def keyed_by(environ: Mapping[str, str]) -> KeySource:
        with_store = {"RUNHEALTH_AUDIT_ANCHOR": str(tmp_path / "anchor"), **environ}
        source = audit.attach(store, with_store)
        assert source is not None
        return source

    keyed_by({"RUNHEALTH_AUDIT_KEY": OLD_SECRET})
    note(store, 2)
    source = keyed_by({"RUNHEALTH_AUDIT_KEY": NEW_SECRET, "RUNHEALTH_AUDIT_OLD_KEYS": OLD_SECRET})
    note(store, 2)
    heads = read_heads(tmp_path / "anchor")
    with store.connect() as connection:
        checked = audit.verify(connection, source.keyring(), heads)
        assert checked.ok and checked.entries == 4 and checked.keyed and checked.anchored_seq == 4
        new_only = key_source(store.url, {"RUNHEALTH_AUDIT_KEY": NEW_SECRET})
        assert new_only is not None
        refused = audit.verify(connection, new_only.keyring(), heads)
    assert refused.broken_seq == 1 and "not in the keyring" in str(refused.problem)
    assert [e["key_id"] for e in entries(store)] == [
        Key.of(s.encode()).id for s in [OLD_SECRET] * 2 + [NEW_SECRET] * 2
    ]


@both_backends
def test_tampering_is_caught_on_either_backend(store: Engine, tmp_path: Path) -> None:
    source = audit.attach(
        store, {"RUNHEALTH_AUDIT_KEY": OLD_SECRET, "RUNHEALTH_AUDIT_ANCHOR": str(tmp_path / "a")}
    )
    assert source is not None
    note(store, 4)
    swap_and_rechain(store)
    execute(store, "DELETE FROM audit_log WHERE seq = 4")
    with store.connect() as connection:
        checked = audit.verify(connection, source.keyring(), read_heads(tmp_path / "a"))
        assert (checked.broken_seq, checked.problem) == (
            2,
            "entry 2: its HMAC does not match: edited, reordered or forged, with its hashes recomputed",
        )
    execute(store, "DELETE FROM audit_log")
    with store.connect() as connection:
        checked = audit.verify(connection, source.keyring(), read_heads(tmp_path / "a"))
    assert checked.broken_seq == 1 and "it was wiped" in str(checked.problem)


def test_the_service_creates_its_key_at_start_and_refuses_a_bad_one(store: Engine, tmp_path: Path) -> None:
    key_file = tmp_path / "keys" / "audit-key"
    audit.attach(store, {"RUNHEALTH_AUDIT_KEY_FILE": str(key_file)}, check=True)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    with pytest.raises(AuditKeyError, match="too short"):
        audit.attach(store, {"RUNHEALTH_AUDIT_KEY": "short"}, check=True)


def note(store: Engine, n: int) -> None:
    for i in range(n):
        with store.begin() as connection:
            audit.append(connection, actor="test", action="note", subject=f"test:{i}", now=float(i))


def test_an_engine_without_a_key_writes_hash_chained_entries(store: Engine) -> None:
    """Stores opened without ``attach`` (tools, older tests) keep the plain hash chain."""
    note(store, 2)
    assert [(e["key_id"], e["mac"]) for e in entries(store)] == [(None, None)] * 2
    with store.connect() as connection:
        assert audit.verify(connection).ok
        assert "carries no HMAC" in str(
            audit.verify(connection, KeySource("s", OLD_SECRET).keyring()).problem
        )
