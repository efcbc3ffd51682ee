"""The two places a setting can come from besides its default: the environment (an injected
mapping, never ``os.environ`` read here) and a TOML file. Each gives the nested values the
model takes and, per setting, where it came from."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path as FilePath
from typing import Any

from pydantic_settings import BaseSettings, TomlConfigSettingsSource

from monitor.config import ConfigError
from monitor.settings.layout import DELIMITER, LEGACY_VARIABLES, PREFIX, TRAINER_SECTIONS, Path

# The variable naming the settings file (``--config`` takes precedence).
FILE_VARIABLE = "RUNHEALTH_CONFIG"


@dataclass(frozen=True)
class Layer:
    """What one source set: ``values`` nested as the model takes them, ``origins`` the
    variable name or file path that set each setting."""

    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[Path, str] = field(default_factory=dict)


def environment_layer(environ: Mapping[str, str], top_level: Collection[str]) -> Layer:
    """``RUNHEALTH_SECTION__FIELD`` (any case) and the legacy flat names; an empty value is
    unset. Other ``RUNHEALTH_*`` names (the trainer's and the CLI's own, ``TRAINER_SECTIONS``)
    are not the service's and are left alone; any other ``__`` name that is no setting is an
    error, so a typo is not silent."""
    layer = Layer()
    for variable, raw in environ.items():
        path = _setting_path(variable.upper(), top_level)
        value = raw.strip()
        if path is None or not value:
            continue
        if path in layer.origins:
            raise ConfigError(f"{layer.origins[path]} and {variable} set the same setting: set one")
        _insert(layer.values, path, value, variable)
        layer.origins[path] = variable
    return layer


def file_layer(path: str, model: type[BaseSettings]) -> Layer:
    """The TOML file's tables are the settings' sections: ``[policies.spike]`` then ``z = 10``."""
    if not FilePath(path).is_file():
        raise ConfigError(f"the settings file {path} does not exist")
    try:
        values = TomlConfigSettingsSource(model, toml_file=path)()
    except ValueError as exc:  # tomllib.TOMLDecodeError
        raise ConfigError(f"the settings file {path} is not valid TOML: {exc}") from None
    return Layer(values, {name: path for name in _paths(values)})


def layered(*layers: Layer) -> dict[str, Any]:
    """The layers' values merged, a later layer's over an earlier one's, section by section."""
    merged: dict[str, Any] = {}
    for layer in layers:
        _merge(merged, layer.values)
    return merged


def _setting_path(variable: str, top_level: Collection[str]) -> Path | None:
    if variable in LEGACY_VARIABLES:
        return LEGACY_VARIABLES[variable]
    if not variable.startswith(PREFIX) or variable == FILE_VARIABLE:
        return None
    rest = variable[len(PREFIX) :].lower()
    if DELIMITER in rest:
        path = tuple(rest.split(DELIMITER))
        return None if path[0] in TRAINER_SECTIONS else path
    return (rest,) if rest in top_level else None


def _insert(tree: dict[str, Any], path: Path, value: str, variable: str) -> None:
    node = tree
    for step in path[:-1]:
        node = node.setdefault(step, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{variable} is not a setting (runhealth config show lists them)")
    node[path[-1]] = value


def _merge(into: dict[str, Any], values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        if not isinstance(value, Mapping):
            into[key] = value
            continue
        if not isinstance(into.get(key), dict):
            into[key] = {}  # a copy: merging the next layer must not change this one's values
        _merge(into[key], value)


def _paths(values: Mapping[str, Any], prefix: Path = ()) -> list[Path]:
    found: list[Path] = []
    for key, value in values.items():
        if isinstance(value, Mapping):
            found.extend(_paths(value, (*prefix, key)))
        else:
            found.append((*prefix, key))
    return found
