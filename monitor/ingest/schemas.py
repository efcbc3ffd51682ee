"""The ingest wire format: one batch, records of every kind, validated strictly.

Each record model is generated from its definition in ``policies.protocol`` (the one place a
record's fields, types and limits are written), in the protocol's field order: the store's
content hash of a record follows that order.

Strict means a string is not a number and a fraction is not an int: a collector bug shows up
as a 422 naming the field, not as a silently coerced value. A whole number written with a
fraction part (``2.0``) is the integer it spells, as JSON Schema's ``integer`` (the API's
OpenAPI document) says: ``validate_batch`` reads a batch with the strict models first (the
hook writes integers as integers; a Python check on every integer took a 2,000-record batch of
step records from 8.5 to 24 us a record) and only a batch they refuse for such a number again
with models that take it (``model_of(..., whole=True)``). Nonfinite floats are written as ``"NaN"``, ``"Infinity"``
or ``"-Infinity"`` (``policies.protocol.nonfinite``).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    create_model,
)
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from policies import protocol

NONFINITE_NAMES = tuple(protocol.NONFINITE_BY_NAME)


def whole_number(value: Any) -> Any:
    """A float with no fraction part as the integer it spells (JSON does not tell ``2.0`` from
    ``2``); anything else is left as it is, for validation to judge."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Whole = BeforeValidator(whole_number)


def storable(document: dict[str, Any]) -> dict[str, Any]:
    """A free-form document as the store can write it: an integer outside 64 bits (the store's
    JSON writer takes -2^63 to 2^64 - 1, and refused the batch with a 500) becomes the float
    nearest it. Tried first as it is: the writer is fast, the walk is not."""
    try:
        orjson.dumps(document)
    except TypeError:
        return {key: _wide_integers_as_floats(value) for key, value in document.items()}
    return document


def _wide_integers_as_floats(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return float(value)
    if isinstance(value, list):
        return [_wide_integers_as_floats(item) for item in value]
    if isinstance(value, dict):
        return {key: _wide_integers_as_floats(item) for key, item in value.items()}
    return value


class _RealSchema:
    """A number, or one of the three nonfinite names read as its float. A union in
    pydantic-core: a finite number (the common case) is validated without calling Python; any
    other value takes the ``float_from_wire`` path every float took before (a name read as its
    float; a bare ``NaN`` token or a number past a double's range as the float validator reads
    it), with its answers and its one error ``float_type`` ("Input should be a valid number").
    The Python call on every float was 10 calls per step record."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        finite = core_schema.float_schema(strict=True, allow_inf_nan=False)
        by_name = core_schema.no_info_before_validator_function(protocol.float_from_wire, handler(float))
        return core_schema.union_schema(
            [finite, by_name],
            mode="left_to_right",
            custom_error_type="float_type",  # its own message: "Input should be a valid number"
        )


# A float that may be nonfinite, sent as a number or as one of the three names (and documented
# so in the API's OpenAPI document).
Real = Annotated[
    float,
    _RealSchema(),
    WithJsonSchema({"anyOf": [{"type": "number"}, {"type": "string", "enum": list(NONFINITE_NAMES)}]}),
]
IncarnationId = Annotated[str, Field(min_length=1, max_length=64)]
# (A validator after its limits: before them, the limits would be lost from the JSON schema.)
Rank = Annotated[int, Field(ge=0, le=protocol.RANK_LIMIT), Whole]


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def annotation(value_type: protocol.ValueType, whole: bool = False) -> Any:
    """The pydantic type of one protocol value type, limits included (``whole``: an integer may
    be written as a whole float)."""
    match value_type:
        case protocol.Integer(ge=ge, le=le):
            limited = int if ge is None and le is None else Annotated[int, Field(ge=ge, le=le)]
            return Annotated[limited, Whole] if whole else limited
        case protocol.Real():
            return Real
        case protocol.Text(max_length=longest, min_length=shortest, pattern=pattern):
            return Annotated[str, Field(min_length=shortest or None, max_length=longest, pattern=pattern)]
        case protocol.Flag():
            return bool
        case protocol.Choice(values=values):
            return Literal.__getitem__(values)
        case protocol.Document():
            return Annotated[dict[str, Any], AfterValidator(storable)]
        case protocol.ListOf(item=item, max_length=longest):
            listed = list.__class_getitem__(annotation(item, whole))
            return listed if longest is None else Annotated[listed, Field(max_length=longest)]
        case protocol.MapOf(value=value, key=key):
            return dict.__class_getitem__((annotation(key, whole), annotation(value, whole)))
        case protocol.Nested(structure=structure):
            return model_of(structure, whole)
        case protocol.Either(options=options):
            return Union.__getitem__(tuple(annotation(option, whole) for option in options))
    raise TypeError(f"no pydantic type for {value_type!r}")


def _field(spec: protocol.Field, whole: bool) -> tuple[Any, Any]:
    kind = annotation(spec.type, whole)
    if spec.required:
        return kind, ...
    if spec.default == protocol.EMPTY_LIST and isinstance(spec.type, protocol.ListOf):
        return kind, Field(default_factory=list)
    return (kind if spec.default is not None else kind | None), spec.default


@functools.cache
def model_of(structure: protocol.Structure, whole: bool = False) -> type[BaseModel]:
    """The strict, frozen pydantic model of one protocol structure (made once per structure;
    ``whole``: its integers may be written as whole floats)."""
    fields: dict[str, Any] = {spec.name: _field(spec, whole) for spec in structure.fields}
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
    WholeRecordIn = Any
else:
    RecordIn = Annotated[
        Union.__getitem__(tuple(model_of(kind) for kind in protocol.RECORD_KINDS)),
        Field(discriminator="kind"),
    ]
    WholeRecordIn = Annotated[
        Union.__getitem__(tuple(model_of(kind, whole=True) for kind in protocol.RECORD_KINDS)),
        Field(discriminator="kind"),
    ]


class BatchIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    records: list[RecordIn]


class WholeBatchIn(BaseModel):
    """A batch whose integers may be written as whole floats: ``validate_batch``'s second read."""

    model_config = ConfigDict(strict=True, extra="forbid")

    records: list[WholeRecordIn]


BATCH = TypeAdapter(BatchIn)
WHOLE_BATCH = TypeAdapter(WholeBatchIn)


def validate_batch(raw: bytes) -> BatchIn | WholeBatchIn:
    """The batch in ``raw`` (JSON), or the ``ValidationError`` naming what is wrong with it."""
    try:
        return BATCH.validate_json(raw)
    except ValidationError as exc:
        if not any(_whole_float(error["input"]) for error in exc.errors() if error["type"] == "int_type"):
            raise
    return WHOLE_BATCH.validate_json(raw)


def _whole_float(value: Any) -> bool:
    return isinstance(value, float) and value.is_integer()


class RunCreateIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: annotation(protocol.RUN_NAME)  # type: ignore[valid-type]


class DirectiveCreateIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    kind: Literal["dump_stacks", "canary"]
    incarnation: IncarnationId | None = None
    # Ranks within the protocol's rank limit, as many as there can be ranks.
    ranks: Annotated[list[Rank], Field(max_length=protocol.RANK_LIMIT + 1)] | None = None


class DecisionIn(BaseModel):
    """A decision's body: with the admin token it may name the local user who decides."""

    model_config = ConfigDict(strict=True, extra="forbid")

    reason: Annotated[str, Field(max_length=4000)] | None = None
    operator: Annotated[str, Field(min_length=1, max_length=100)] | None = None


# Some character that is not white space, alike to Python's ``re`` (and ``str.strip``, which also
# strips \x1c-\x1f) and to an ECMAScript engine reading the OpenAPI document (whose ``\s`` also
# takes U+FEFF and not \x85).
VISIBLE = r"[^\s\x1c-\x1f\x85\ufeff]"


def says_something(reason: str) -> str:
    if re.search(VISIBLE, reason) is None:
        raise PydanticCustomError("reason_needed", "a rejection needs a reason")
    return reason


class RejectionIn(DecisionIn):
    """A rejection's body: it needs a reason, and one that says something."""

    reason: Annotated[
        str, Field(max_length=4000, json_schema_extra={"pattern": VISIBLE}), AfterValidator(says_something)
    ]
