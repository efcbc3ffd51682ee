"""The settings as a pydantic-settings model, generated from the config dataclasses' fields.

pydantic checks each value's type (a number, one of a Literal's words, an enum's value);
the dataclasses' own ``__post_init__`` then checks the ranges, so every rule is written once.
Each field's default is the default config's value, and only fields a source set are
applied (``model_fields_set``), so a default here can never override one computed in code.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from monitor.settings.layout import Leaf, Path
from policies.flags import FALSE_WORDS, TRUE_WORDS, FlagError, parse_flag


class SettingsBase(BaseSettings):
    """The root of the generated model. Its values come only from the keyword arguments
    ``read_settings`` layers from the environment mapping and the file, because the
    reader keeps each value's origin (``runhealth config show``) and never reads
    ``os.environ`` itself."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=False, allow_inf_nan=False)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


# No threshold is NaN or infinite; the configs' range checks would let a NaN through.
SECTION_CONFIG = ConfigDict(extra="forbid", validate_default=False, allow_inf_nan=False)
FLAG_SPELLING = f"must be one of {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}"


def settings_model(settings: Sequence[Leaf]) -> type[SettingsBase]:
    """The model of these settings, one nested model per section."""
    tree: dict[str, Any] = {}
    for leaf in settings:
        node = tree
        for step in leaf.name[:-1]:
            node = node.setdefault(step, {})
        node[leaf.name[-1]] = leaf
    return typing.cast(type[SettingsBase], _model("ServiceSettings", tree, SettingsBase))


def _model(name: str, tree: dict[str, Any], base: type[BaseModel] | None) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for key, child in tree.items():
        if isinstance(child, Leaf):
            fields[key] = (_annotation(child.kind), child.default)
        else:
            section = _model(f"{name}_{key}", child, None)
            fields[key] = (section, Field(default_factory=section))
    if base is None:
        return create_model(name, __config__=SECTION_CONFIG, **fields)
    return create_model(name, __base__=base, **fields)


def _annotation(kind: Any) -> Any:
    """The field's type, with the two spellings the environment needs: a yes/no by the shared
    rule, and a list as comma-separated words."""
    if kind is bool:
        return Annotated[bool, BeforeValidator(_flag)]
    if typing.get_origin(kind) in (tuple, frozenset):
        return Annotated[kind, BeforeValidator(_words)]
    return kind


def _flag(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return parse_flag(value, "value")
    except FlagError:
        raise PydanticCustomError("flag", FLAG_SPELLING) from None


def _words(value: Any) -> Any:
    if isinstance(value, str):
        return [word.strip() for word in value.split(",") if word.strip()]
    return value


def set_values(model: BaseModel, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(settings path, value) for each field a source set, nested sections included."""
    for key in model.model_fields_set:
        value = getattr(model, key)
        if isinstance(value, BaseModel):
            yield from set_values(value, (*prefix, key))
        else:
            yield (*prefix, key), value
