"""The record protocol (``policies.protocol``): its definitions, the NaN codec, building records."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import OrderedDict
from types import MappingProxyType

import pytest

from policies import protocol
from policies.protocol import (
    CHECKPOINT,
    HEARTBEAT,
    RECORD_KINDS,
    STEP,
    Field,
    Integer,
    ProtocolError,
    Structure,
    build,
    check_fields,
    require,
    to_wire,
)

SHA = "0" * 64


def heartbeat(**overrides: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "incarnation": "inc-1",
        "rank": 0,
        "phase": "forward",
        "phase_since": 1.0,
        "time": 2.0,
    }
    return {**fields, **overrides}


def test_the_protocol_imports_only_the_standard_library() -> None:
    # Both sides import it: the trainer must not pull in numpy or pydantic through it.
    code = (
        "import sys; before = set(sys.modules); import policies.protocol; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(' '.join(sorted(new - set(sys.stdlib_module_names))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.split() == ["policies"]


def test_every_kind_has_a_distinct_wire_name_and_a_key_of_required_fields() -> None:
    kinds = [kind.kind for kind in RECORD_KINDS]
    assert len(set(kinds)) == len(kinds) == 11
    assert set(protocol.BY_KIND) == set(kinds)
    for kind in RECORD_KINDS:
        assert kind.key, kind.kind
        assert all(kind[name].required or kind[name].default is not None for name in kind.key), kind.kind


def test_a_structure_refuses_duplicate_fields_and_a_key_it_lacks() -> None:
    with pytest.raises(ValueError, match="unique"):
        Structure("X", "", (Field("a", Integer()), Field("a", Integer())))
    with pytest.raises(ValueError, match="key"):
        Structure("X", "", (Field("a", Integer()),), kind="x", key=("b",))
    with pytest.raises(KeyError, match="no field 'b'"):
        STEP["b"]


def test_bounds_are_read_from_the_definitions() -> None:
    assert STEP.max_length("sample_ids") == protocol.SAMPLE_ID_LIMIT == 100_000
    assert protocol.STACK_DUMP.max_length("stacks") == 4_000_000
    assert protocol.LINK_SAMPLE.max_length("state") == 32
    with pytest.raises(KeyError, match="no length bound"):
        STEP.max_length("rank")


def test_build_orders_fields_drops_absent_ones_and_names_nonfinite_floats() -> None:
    record = build(
        HEARTBEAT, time=math.nan, rank=3, incarnation="i", phase="idle", phase_since=-math.inf, node=None
    )
    assert list(record) == ["kind", "incarnation", "rank", "phase", "phase_since", "time"]
    assert record["time"] == "NaN" and record["phase_since"] == "-Infinity"
    assert record["kind"] == "heartbeat"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rank": -1}, r"heartbeat\.rank: must be >= 0"),
        ({"rank": True}, r"heartbeat\.rank: expected an integer, got bool"),
        ({"rank": 1.0}, r"heartbeat\.rank: expected an integer, got float"),
        ({"time": "1.5"}, r"heartbeat\.time: expected a number, got str"),
        ({"phase": "x" * 33}, r"heartbeat\.phase: at most 32 characters, got 33"),
        ({"phase": ""}, r"heartbeat\.phase: at least 1 characters"),
        ({"phase": 3}, r"heartbeat\.phase: expected a string"),
        ({"loss": 1.0}, r"heartbeat: unknown fields \['loss'\]"),
        ({"time": None}, r"heartbeat\.time: required"),
    ],
)
def test_build_refuses_what_the_service_would_refuse(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        build(HEARTBEAT, **heartbeat(**overrides))


def test_build_checks_nested_structures_and_keyed_maps() -> None:
    manifest = {"step": 5, "files": [{"path": "model.pt", "size": 10, "sha256": SHA}]}
    ok = build(
        CHECKPOINT,
        incarnation="i",
        step=5,
        path="/c",
        time=1.0,
        manifest=manifest,
        metrics={"loss": math.inf},
    )
    assert ok["manifest"] == manifest and ok["metrics"] == {"loss": "Infinity"}
    bad_hash = {**manifest, "files": [{"path": "model.pt", "size": 10, "sha256": "xyz"}]}
    with pytest.raises(ProtocolError, match=r"checkpoint\.manifest: .*sha256: does not match"):
        build(CHECKPOINT, incarnation="i", step=5, path="/c", time=1.0, manifest=bad_hash)
    with pytest.raises(ProtocolError, match=r"missing \['files'\]"):
        build(CHECKPOINT, incarnation="i", step=5, path="/c", time=1.0, manifest={"step": 5})
    with pytest.raises(ProtocolError, match=r"checkpoint\.tags: \[1\]: at most 64 characters"):
        build(CHECKPOINT, incarnation="i", step=5, path="/c", time=1.0, tags=["ok", "t" * 65])
    kernel = {"fingerprint": "f"}
    with pytest.raises(ProtocolError, match=r"canary_result\.kernels: \['k{65}'\]: at most 64"):
        check_fields(protocol.CANARY_RESULT, {"kernels": {"k" * 65: kernel}})


def test_sample_ids_are_numbers_or_bounded_strings() -> None:
    check_fields(STEP, {"sample_ids": [1, -2, "shard-3:17"]})
    with pytest.raises(ProtocolError, match=r"step\.sample_ids: \[1\]: not any of the accepted types"):
        check_fields(STEP, {"sample_ids": [1, "s" * 201]})
    with pytest.raises(ProtocolError, match="at most 100000 items"):
        check_fields(STEP, {"sample_ids": [0] * 100_001})


def test_require_names_only_known_fields() -> None:
    assert require(STEP, "forward_s", "loss_sum") == ("forward_s", "loss_sum")
    with pytest.raises(ProtocolError, match=r"unknown fields \['loss'\]"):
        require(STEP, "loss_sum", "loss")


def test_to_wire_copies_containers_and_reads_any_mapping() -> None:
    ids = [1, 2, "x"]
    assert to_wire(ids) == ids and to_wire(ids) is not ids  # a later change to ids is not sent
    assert to_wire((1, 2)) == [1, 2]
    nested = MappingProxyType({"a": OrderedDict(b=math.nan)})
    assert to_wire(nested) == {"a": {"b": "NaN"}}
    assert to_wire(True) is True and to_wire(None) is None


class Ratio(float):
    """A float subclass (numpy's float64 is one): still a float to the codec."""


def test_to_wire_names_nonfinite_float_subclasses() -> None:
    assert to_wire({"x": Ratio(math.inf)}) == {"x": "Infinity"}
    assert to_wire(Ratio(0.5)) == 0.5
