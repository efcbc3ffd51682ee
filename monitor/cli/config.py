"""``runhealth config show``: the service's effective settings and where each came from."""

from __future__ import annotations

import os
from typing import Any

import typer
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from monitor.cli.options import ConfigOption, JsonOption
from monitor.cli.render import out, print_json, table
from monitor.settings import Setting, read_settings


def config_show(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Every setting's value as `runhealth serve` would use it here: its default, the settings
    file's value, or the environment variable that set it."""
    effective = read_settings(os.environ, config)
    rows = [_shown(setting) for setting in effective.settings]
    if as_json:
        print_json({"file": effective.file, "settings": [_document(row) for row in rows]})
        return
    title = f"settings (file {effective.file})" if effective.file else "settings (no settings file)"
    view = table(
        title,
        ["setting", "value", "from"],
        [(row.name, _text(row.value), row.origin or row.source) for row in rows],
    )
    for column in view.columns:
        column.overflow = "fold"  # names have no spaces to wrap at; cut, they would not say which
    out.print(view)
    out.print("each setting's variable: RUNHEALTH_ and its name in capitals, __ for each dot")


def _shown(setting: Setting) -> Setting:
    """The store's URL without its password (the admin token is already hidden)."""
    if setting.name != "db" or not isinstance(setting.value, str):
        return setting
    try:
        hidden = make_url(setting.value).render_as_string(hide_password=True)
    except ArgumentError:  # a plain SQLite path
        return setting
    return Setting(setting.name, hidden, setting.source, setting.origin, setting.variable)


def _document(row: Setting) -> dict[str, Any]:
    return {
        "name": row.name,
        "value": row.value,
        "source": row.source,
        "origin": row.origin,
        "variable": row.variable,
    }


def _text(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(item) for item in value)
    return "" if value is None else str(value)


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The service's settings.", no_args_is_help=True)
    group.command("show")(config_show)
    app.add_typer(group, name="config")
