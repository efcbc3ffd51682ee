"""Alembic environment: runs on the connection ``monitor.store.migrate`` hands it."""

from __future__ import annotations

from typing import Any

from alembic import context

from monitor.store.models import Base, Float64, constraint_dialect
from monitor.store.partitions import is_partition

# Tables other components own (APScheduler's job store) stay out of our history.
EXCLUDED_TABLES = frozenset({"apscheduler_jobs"})


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """Our tables, not their PostgreSQL partitions (made by the service, day by day)."""
    return not (type_ == "table" and name is not None and (name in EXCLUDED_TABLES or is_partition(name)))


def object_filter(dialect: str) -> Any:
    """``include_object`` on ``dialect``: a model's constraint made only on another dialect
    (``models.raw_record_keys``) is not expected here."""

    def include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ == "unique_constraint" and not reflected and constraint_dialect(obj) not in (None, dialect):
            return False
        return include_object(obj, name, type_, reflected, compare_to)

    return include


def render_item(type_: str, obj: Any, autogen_context: Any) -> str | bool:
    # Migrations must not import the models' Python types: render the column's SQL type.
    if type_ == "type" and isinstance(obj, Float64):
        return "sa.Double()"
    return False


def run_migrations() -> None:
    connection = context.config.attributes["connection"]
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        include_object=object_filter(connection.dialect.name),
        render_item=render_item,
        compare_type=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
