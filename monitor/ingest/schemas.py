"""The ingest wire format: one batch, records of every kind, validated strictly.

Each record model is generated from its definition in ``policies.protocol`` (the one place a
record's fields, types and limits are written), in the protocol's field order: the store's
content hash of a record follows that order.

Strict means a string is not a number and a float is not an int: a collector bug shows up
as a 422 naming the field, not as a silently coerced value. Nonfinite floats are written as
``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (``policies.protocol.nonfinite``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

from policies import protocol

# A float that may be nonfinite, sent as a number or as one of the three names.
Real = Annotated[float, BeforeValidator(protocol.float_from_wire)]
Count = Annotated[int, Field(ge=0)]
IncarnationId = Annotated[str, Field(min_length=1, max_length=64)]


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def annotation(value_type: protocol.ValueType) -> Any:
    """The pydantic type of one protocol value type, limits included."""
    match value_type:
        case protocol.Integer(ge=ge, le=le):
            return int if ge is None and le is None else Annotated[int, Field(ge=ge, le=le)]
        case protocol.Real():
            return Real
        case protocol.Text(max_length=longest, min_length=shortest, pattern=pattern):
            return Annotated[str, Field(min_length=shortest or None, max_length=longest, pattern=pattern)]
        case protocol.Flag():
            return bool
        case protocol.Choice(values=values):
            return Literal.__getitem__(values)
        case protocol.Document():
            return dict[str, Any]
        case protocol.ListOf(item=item, max_length=longest):
            listed = list.__class_getitem__(annotation(item))
            return listed if longest is None else Annotated[listed, Field(max_length=longest)]
        case protocol.MapOf(value=value, key=key):
            return dict.__class_getitem__((annotation(key), annotation(value)))
        case protocol.Nested(structure=structure):
            return model_of(structure)
        case protocol.Either(options=options):
            return Union.__getitem__(tuple(annotation(option) for option in options))
    raise TypeError(f"no pydantic type for {value_type!r}")


def _field(spec: protocol.Field) -> tuple[Any, Any]:
    kind = annotation(spec.type)
    if spec.required:
        return kind, ...
    if spec.default == protocol.EMPTY_LIST and isinstance(spec.type, protocol.ListOf):
        return kind, Field(default_factory=list)
    return (kind if spec.default is not None else kind | None), spec.default


@functools.cache
def model_of(structure: protocol.Structure) -> type[BaseModel]:
    """The strict, frozen pydantic model of one protocol structure (made once per structure)."""
    fields: dict[str, Any] = {spec.name: _field(spec) for spec in structure.fields}
    if structure.kind is not None:
        fields = {"kind": (Literal.__getitem__(structure.kind), ...), **fields}
    model: type[BaseModel] = create_model(
        structure.name, __base__=_Record, __doc__=structure.doc, __module__=__name__, **fields
    )
    return model


StepIn = model_of(protocol.STEP)
HeartbeatIn = model_of(protocol.HEARTBEAT)
RunStartIn = model_of(protocol.RUN_START)
RunFinishIn = model_of(protocol.RUN_FINISH)
DeviceSampleIn = model_of(protocol.DEVICE_SAMPLE)
LinkSampleIn = model_of(protocol.LINK_SAMPLE)
CheckpointIn = model_of(protocol.CHECKPOINT)
ResumeIn = model_of(protocol.RESUME)
StackDumpIn = model_of(protocol.STACK_DUMP)
DirectiveAckIn = model_of(protocol.DIRECTIVE_ACK)
CanaryResultIn = model_of(protocol.CANARY_RESULT)

RECORD_KINDS = tuple(kind.kind for kind in protocol.RECORD_KINDS)

if TYPE_CHECKING:
    RecordIn = Any  # a union made at import: to the type checker, one of the models above
else:
    RecordIn = Annotated[
        Union.__getitem__(tuple(model_of(kind) for kind in protocol.RECORD_KINDS)),
        Field(discriminator="kind"),
    ]


class BatchIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    records: list[RecordIn]


class RunCreateIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: annotation(protocol.RUN_NAME)  # type: ignore[valid-type]


class DirectiveCreateIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    kind: Literal["dump_stacks", "canary"]
    incarnation: IncarnationId | None = None
    ranks: list[Count] | None = None


class DecisionIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    reason: Annotated[str, Field(max_length=4000)] | None = None
