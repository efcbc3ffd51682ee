"""Operators: named people with bearer tokens; the identity the audit log records."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import audit, models
from monitor.store.tokens import new_token, token_digest

OPERATOR = models.table_of(models.Operator)


class OperatorError(Exception):
    pass


def add_operator(connection: Connection, name: str, *, actor: str, now: float) -> str:
    """Create an operator; return the token (shown once: only a digest is kept)."""
    if connection.execute(sa.select(OPERATOR.c.id).where(OPERATOR.c.name == name)).first() is not None:
        raise OperatorError(f"operator {name!r} already exists")
    token = new_token("rh_op")
    connection.execute(
        OPERATOR.insert(), {"name": name, "token_hash": token_digest(token), "created_at": now}
    )
    audit.append(connection, actor=actor, action="operator_added", subject=f"operator:{name}", now=now)
    return token


def revoke_operator(connection: Connection, name: str, *, actor: str, now: float, reason: str | None) -> None:
    updated = connection.execute(
        OPERATOR.update()
        .where(OPERATOR.c.name == name, OPERATOR.c.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    if updated.rowcount != 1:
        raise OperatorError(f"no active operator named {name!r}")
    audit.append(
        connection, actor=actor, action="operator_revoked", subject=f"operator:{name}", now=now, reason=reason
    )


def identify(connection: Connection, token: str) -> str | None:
    """The operator this token belongs to, or ``None`` (unknown or revoked)."""
    row = connection.execute(
        sa.select(OPERATOR.c.name, OPERATOR.c.revoked_at).where(OPERATOR.c.token_hash == token_digest(token))
    ).first()
    if row is None or row.revoked_at is not None:
        return None
    return str(row.name)


def list_operators(connection: Connection) -> list[dict[str, Any]]:
    rows = connection.execute(sa.select(OPERATOR).order_by(OPERATOR.c.id)).mappings()
    return [{"name": r["name"], "created_at": r["created_at"], "revoked_at": r["revoked_at"]} for r in rows]
