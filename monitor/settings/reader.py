"""Reading the service's settings: defaults, then the file, then the environment.

``read_settings(environ, file)`` is the one place the service turns its environment into a
``ServiceConfig``. A value of the wrong type, or one the config's own ``__post_init__`` refuses,
is one ``ConfigError`` naming the variable (or the file's key) that set it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from monitor.config import ConfigError, ServiceConfig
from monitor.settings.layout import Leaf, Path, leaves, value_at
from monitor.settings.schema import set_values, settings_model
from monitor.settings.sources import FILE_VARIABLE, Layer, environment_layer, file_layer, layered

SECRETS: frozenset[Path] = frozenset({("admin_token",)})

# What a value must be, by pydantic's error type; others use pydantic's own words.
EXPECTED = {
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "int_type": "must be an integer",
    "finite_number": "must be a finite number",
}


@dataclass(frozen=True)
class Setting:
    """One effective value: ``source`` is "default", "file" or "environment", ``origin`` the
    file's path or the variable's name (``None`` for a default), ``variable`` the name that
    sets it from the environment."""

    name: str
    value: Any
    source: str
    origin: str | None
    variable: str


@dataclass(frozen=True)
class Effective:
    config: ServiceConfig
    settings: tuple[Setting, ...]
    file: str | None


def read_settings(environ: Mapping[str, str], file: str | None = None) -> Effective:
    """The effective settings; ``file`` (``--config``) wins over ``$RUNHEALTH_CONFIG``."""
    chosen = file or environ.get(FILE_VARIABLE, "").strip() or None
    known = leaves()
    model = settings_model(known)
    environment = environment_layer(environ, {leaf.name[0] for leaf in known if len(leaf.name) == 1})
    from_file = file_layer(chosen, model) if chosen else Layer()
    where = _namer(environment, from_file)
    try:
        settings = model(**layered(from_file, environment))
    except ValidationError as exc:
        raise ConfigError("; ".join(_problem(error, where) for error in exc.errors())) from None
    by_name = {leaf.name: leaf for leaf in known}
    changes = {by_name[name].target: value for name, value in set_values(settings)}
    targets = {leaf.target: leaf.name for leaf in known}
    config = _rebuild(ServiceConfig(), changes, (), lambda target: where(targets[target]))
    rows = tuple(_row(leaf, config, environment, from_file) for leaf in known)
    return Effective(config, rows, chosen)


def service_config(
    environ: Mapping[str, str], file: str | None = None, db: str | None = None
) -> ServiceConfig:
    """The config the service runs with; ``db`` (``--db``) wins over the settings' store."""
    config = read_settings(environ, file).config
    return dataclasses.replace(config, db=db) if db else config


def _namer(environment: Layer, from_file: Layer) -> Callable[[Path], str]:
    """Names a setting (or a section) by what set it: the variable, else the file's key."""

    def where(name: Path) -> str:
        variables = [v for path, v in environment.origins.items() if path[: len(name)] == name]
        if variables:
            return ", ".join(variables)
        keys = [path for path in from_file.origins if path[: len(name)] == name]
        if keys:
            return ", ".join(f"{from_file.origins[key]}: {'.'.join(key)}" for key in keys)
        return ".".join(name)

    return where


def _problem(error: ErrorDetails, where: Callable[[Path], str]) -> str:
    name = tuple(str(step) for step in error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{where(name)} is not a setting (runhealth config show lists them)"
    if kind in ("model_type", "dict_type"):
        return f"{where(name)} names a section of settings, not one setting"
    expected = EXPECTED.get(kind) or error["msg"]
    if expected.startswith("Input should be "):
        expected = "must be " + expected.removeprefix("Input should be ")
    return f"{where(name)} {expected}, got {error['input']!r}"


def _rebuild(node: Any, changes: Mapping[Path, Any], at: Path, where: Callable[[Path], str]) -> Any:
    """``node`` with ``changes`` (paths below it) applied, innermost first, so each config's
    ``__post_init__`` judges its new values; a refusal names the settings that changed."""
    direct: dict[str, Any] = {}
    nested: dict[str, dict[Path, Any]] = defaultdict(dict)
    for path, value in changes.items():
        if len(path) == 1:
            direct[path[0]] = value
        else:
            nested[path[0]][path[1:]] = value
    for key, below in nested.items():
        direct[key] = _rebuild(value_at(node, (key,)), below, (*at, key), where)
    if isinstance(node, Mapping):
        return {**node, **direct}
    try:
        return dataclasses.replace(node, **direct)
    except (ValueError, TypeError) as exc:
        named = ", ".join(f"{where(at + path)}={value!r}" for path, value in changes.items())
        raise ConfigError(f"{named}: {exc}") from None


def _row(leaf: Leaf, config: ServiceConfig, environment: Layer, from_file: Layer) -> Setting:
    value = plain(value_at(config, leaf.target))
    if leaf.name in SECRETS and value is not None:
        value = "(set)"
    if leaf.name in environment.origins:
        source, origin = "environment", environment.origins[leaf.name]
    elif leaf.name in from_file.origins:
        source, origin = "file", from_file.origins[leaf.name]
    else:
        source, origin = "default", None
    return Setting(leaf.dotted, value, source, origin, leaf.variable)


def plain(value: Any) -> Any:
    """A value as JSON writes it: an enum's value, a set sorted, a tuple as a list."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, frozenset | set):
        return sorted(value)
    if isinstance(value, tuple):
        return list(value)
    return value
