"""The ingest API's models (``monitor.ingest.schemas``) against the record protocol, field by
field: names and order, optionality and defaults, types and limits, strictness.

Each case is derived from the protocol's definition of the field, so a field added there is
checked here without a new test; what is probed is the pydantic model's actual behaviour.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from monitor.ingest.schemas import RECORD_KINDS, BatchIn, WholeBatchIn, model_of, validate_batch
from policies import protocol
from policies.protocol import Field, Structure, ValueType
from tests.support import record_of_each_kind

RECORDS = {record["kind"]: record for record in record_of_each_kind()}
KINDS = {kind.kind: kind for kind in protocol.RECORD_KINDS}
# A valid instance of every structure, nested ones included (a manifest, a kernel's result).
VALID = {
    **{KINDS[kind].name: record for kind, record in RECORDS.items()},
    protocol.MANIFEST.name: RECORDS["checkpoint"]["manifest"],
    protocol.MANIFEST_FILE.name: RECORDS["checkpoint"]["manifest"]["files"][0],
    protocol.KERNEL.name: RECORDS["canary_result"]["kernels"]["gemm_fp32"],
}
STRUCTURES = {
    structure.name: structure
    for structure in (*protocol.RECORD_KINDS, protocol.MANIFEST, protocol.MANIFEST_FILE, protocol.KERNEL)
}


def accepted(kind: Structure, record: dict[str, Any]) -> BaseModel:
    return model_of(kind).model_validate(record)


def refused_at(kind: Structure, record: dict[str, Any]) -> list[tuple[Any, ...]]:
    with pytest.raises(ValidationError) as caught:
        model_of(kind).model_validate(record)
    return [tuple(error["loc"]) for error in caught.value.errors()]


def good_values(value_type: ValueType) -> Iterator[Any]:
    """Values at the edges of what the type admits."""
    match value_type:
        case protocol.Integer(ge=ge):
            yield 0 if ge is None else ge
            if ge is None:
                yield -5
        case protocol.Real():
            yield from (1.5, 2, "NaN", "Infinity", "-Infinity")
        case protocol.Text(max_length=longest, min_length=shortest, pattern=pattern):
            if pattern is not None:
                yield "0" * 64  # the one pattern (a sha256)
            else:
                yield "a" * max(shortest, 1)
                if longest is not None:
                    yield "a" * longest
        case protocol.Flag():
            yield from (True, False)
        case protocol.Choice(values=values):
            yield from values
        case protocol.Document():
            yield {"any": {"nested": [1, "x"]}}
        case protocol.ListOf(item=item, max_length=longest):
            yield []
            if longest is not None:
                yield [next(good_values(item))] * longest
        case protocol.MapOf(value=value, key=key):
            yield {next(good_values(key)): next(good_values(value))}
        case protocol.Nested(structure=structure):
            yield minimal(structure)
        case protocol.Either(options=options):
            for option in options:
                yield from good_values(option)


def bad_values(value_type: ValueType) -> Iterator[Any]:
    """Values just outside the type, or of the wrong JSON type (strictness)."""
    match value_type:
        case protocol.Integer(ge=ge):
            yield from ("1", 1.0, True)
            if ge is not None:
                yield ge - 1
        case protocol.Real():
            yield from ("1.5", "nan", True, None)
        case protocol.Text(max_length=longest, min_length=shortest, pattern=pattern):
            yield 5
            if longest is not None:
                yield "a" * (longest + 1)
            if shortest > 0:
                yield ""
            if pattern is not None:
                yield "g" * 64
        case protocol.Flag():
            yield from (1, "true")
        case protocol.Choice(values=values):
            yield from ("-".join(values), 0)
        case protocol.Document():
            yield from ([], "x")
        case protocol.ListOf(item=item, max_length=longest):
            yield "x"
            yield [next(bad_values(item))]
            if longest is not None:
                yield [next(good_values(item))] * (longest + 1)
        case protocol.MapOf(value=value, key=key):
            yield {next(good_values(key)): next(bad_values(value))}
            if key.max_length is not None:
                yield {"k" * (key.max_length + 1): next(good_values(value))}
        case protocol.Nested(structure=structure):
            yield {**minimal(structure), "unknown": 1}
            yield []
        case protocol.Either():
            yield from (True, 1.5, [])


def minimal(structure: Structure) -> dict[str, Any]:
    """A valid instance with only the required fields."""
    return {field.name: next(good_values(field.type)) for field in structure.fields if field.required}


def cases() -> Iterator[tuple[str, Field]]:
    for name, structure in STRUCTURES.items():
        for field in structure.fields:
            yield name, field


CASES = list(cases())


def test_the_models_are_the_protocols_kinds_in_its_order() -> None:
    assert RECORD_KINDS == tuple(KINDS) == tuple(RECORDS)
    for name, structure in STRUCTURES.items():
        model = model_of(structure)
        kind = ["kind"] if structure.kind else []
        assert list(model.model_fields) == [*kind, *(f.name for f in structure.fields)], name
        assert model.model_config.get("strict") and model.model_config.get("extra") == "forbid"


@pytest.mark.parametrize(("name", "field"), CASES, ids=[f"{k}.{f.name}" for k, f in CASES])
def test_each_field_takes_its_good_values_and_refuses_its_bad_ones(name: str, field: Field) -> None:
    structure = STRUCTURES[name]
    for value in good_values(field.type):
        model = accepted(structure, {**VALID[name], field.name: value})
        stored = getattr(model, field.name)
        if isinstance(field.type, protocol.Real) and isinstance(value, str):
            assert math.isnan(stored) if value == "NaN" else stored == float(value.replace("Infinity", "inf"))
    for value in bad_values(field.type):
        if value is None and not field.required:
            continue
        locations = refused_at(structure, {**VALID[name], field.name: value})
        assert all(loc[0] == field.name for loc in locations), (field.name, value, locations)


@pytest.mark.parametrize(("name", "field"), CASES, ids=[f"{k}.{f.name}" for k, f in CASES])
def test_optionality_and_defaults_follow_the_protocol(name: str, field: Field) -> None:
    structure = STRUCTURES[name]
    without = {key: value for key, value in VALID[name].items() if key != field.name}
    if field.required:
        assert refused_at(structure, without) == [(field.name,)]
        return
    model = accepted(structure, without)
    expected = [] if field.default == protocol.EMPTY_LIST else field.default
    assert getattr(model, field.name) == expected
    assert type(getattr(model, field.name)) is type(expected)  # an empty list, not ()
    if field.default is None:
        assert getattr(accepted(structure, {**without, field.name: None}), field.name) is None


def test_a_batch_error_names_the_record_kind_and_field() -> None:
    record = {**RECORDS["step"], "loss_sum": "1.5"}
    with pytest.raises(ValidationError) as caught:
        BatchIn.model_validate({"records": [record]})
    assert [tuple(e["loc"]) for e in caught.value.errors()] == [("records", 0, "step", "loss_sum")]


def test_what_the_hook_builds_the_service_accepts() -> None:
    for kind in protocol.RECORD_KINDS:
        fields = {name: value for name, value in RECORDS[kind.kind or ""].items() if name != "kind"}
        built = protocol.build(kind, **fields)
        (record,) = BatchIn.model_validate({"records": [built]}).records
        assert record.kind == kind.kind


def test_bare_nonfinite_tokens_read_as_the_names_do() -> None:
    # Python's json module writes NaN and Infinity bare; the protocol's writers use names.
    values = {"loss_sum": math.nan, "grad_norm": math.inf, "lr": -math.inf}
    bare = json.dumps({"records": [{**RECORDS["step"], **values}]})
    named = json.dumps({"records": [{**RECORDS["step"], **protocol.to_wire(values)}]})
    assert "NaN" in bare and '"NaN"' not in bare and '"NaN"' in named
    for raw in (bare, named):
        (record,) = BatchIn.model_validate_json(raw).records
        assert math.isnan(record.loss_sum) and (record.grad_norm, record.lr) == (math.inf, -math.inf)


def integer_fields() -> Iterator[tuple[str, str]]:
    for kind, record in RECORDS.items():
        for field in KINDS[kind].fields:
            value = record.get(field.name)
            if isinstance(field.type, protocol.Integer) and type(value) is int:
                yield kind, field.name


@pytest.mark.parametrize(("kind", "field"), list(integer_fields()))
def test_an_integer_written_as_a_whole_float_is_that_integer(kind: str, field: str) -> None:
    """JSON Schema's ``integer`` (the OpenAPI document's) takes ``2.0`` as ``2``, so does the API
    (on the second read of ``validate_batch``); ``2.5`` is still refused, by the field's name."""
    record = RECORDS[kind]
    (plain,) = validate_batch(json.dumps({"records": [record]}).encode()).records
    (whole,) = validate_batch(
        json.dumps({"records": [{**record, field: float(record[field])}]}).encode()
    ).records
    assert whole.model_dump() == plain.model_dump() and type(getattr(whole, field)) is int
    with pytest.raises(ValidationError) as caught:
        validate_batch(json.dumps({"records": [{**record, field: record[field] + 0.5}]}).encode())
    assert [error["loc"][-1] for error in caught.value.errors()] == [field]


def test_the_second_read_documents_what_the_first_does() -> None:
    """The OpenAPI document is made from the strict models; the ones that take whole floats
    describe the very same batch."""
    strict, whole = (model.model_json_schema() for model in (BatchIn, WholeBatchIn))
    assert (strict["$defs"], strict["properties"]) == (whole["$defs"], whole["properties"])
