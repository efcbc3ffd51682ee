"""``runhealth checkpoints RUN``: a run's checkpoints, their validation and tags."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from monitor.cli.options import DbOption, JsonOption, open_engine
from monitor.cli.render import out, print_json, table
from monitor.store import queries

VALIDITY = {True: "yes", False: "NO", None: "unchecked"}


def checkpoints_command(
    run: Annotated[str, typer.Argument(help="The run.")],
    db: DbOption = None,
    validate: Annotated[
        bool, typer.Option(help="Re-check manifests not checked yet (reads the files).")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """List a run's checkpoints: validation, latest-resumable, best-eval, unsafe."""
    from monitor.recovery.checkpoints import registry, validate_pending

    engine = open_engine(db)
    with engine.begin() as connection:
        run_id = int(queries.run_row(connection, run).id)
        if validate:
            validate_pending(connection, time.time(), run_id)
        listed = registry(connection, run_id)
    if as_json:
        print_json({"run": run, "checkpoints": listed})
        return
    out.print(
        table(
            f"Checkpoints of {run}",
            ["id", "step", "consumed", "valid", "tags", "path"],
            [
                [c["id"], c["step"], c["consumed"], VALIDITY[c["valid"]], tags_text(c["tags"]), c["path"]]
                for c in listed
            ],
        )
    )


def tags_text(tags: list[dict[str, Any]]) -> str:
    return ", ".join(t["tag"] + (f" ({t['metric']}={t['value']:.4g})" if "metric" in t else "") for t in tags)


def register(app: typer.Typer) -> None:
    app.command("checkpoints")(checkpoints_command)
