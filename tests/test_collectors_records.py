"""The hook's records (``collectors.records``) and its outbox (``collectors.outbox``): each kind
is built through the record protocol, events made before attach are sent at attach in order."""

from __future__ import annotations

import math
from typing import Any, cast

import pytest

from collectors import records
from collectors.config import RunHealthConfig
from collectors.layout import Coordinate, Identity, ParallelLayout
from collectors.outbox import Outbox
from collectors.sender import Sender
from collectors.stacks import StackDump
from policies import protocol

IDENTITY = Identity(
    rank=1,
    world_size=2,
    local_rank=1,
    node="node-a",
    device="cpu",
    device_uuid="GPU-1",
    layout=ParallelLayout(dp=Coordinate(1, 2)),
)
ORIGIN = records.Origin.of(IDENTITY, "inc-1")


def valid(record: dict[str, Any]) -> dict[str, Any]:
    """``record``, once the protocol takes it as its kind (no field unknown, missing or off)."""
    kind = protocol.BY_KIND[record["kind"]]
    protocol.check_fields(kind, record)
    missing = [f.name for f in kind.fields if f.required and f.name not in record]
    assert missing == [], missing
    return record


def test_every_builder_makes_a_record_the_protocol_takes() -> None:
    config = RunHealthConfig()
    start = valid(records.run_start("inc-1", 1.0, IDENTITY, {"lr": math.inf}, config))
    assert start["config"]["lr"] == "Infinity"  # nonfinite by name
    assert start["config"]["runhealth_hook"]["agree_every"] == config.hook.agree_every
    assert valid(records.run_finish("inc-1", 2.0, "failed"))["status"] == "failed"
    beat = valid(records.heartbeat(ORIGIN, 3.0, "forward", 2.5, 7, 8))
    assert (beat["rank"], beat["node"], beat["step"], beat["attempt"]) == (1, "node-a", 7, 8)
    ack = valid(records.directive_ack(ORIGIN, 4.0, 9, "missed", 7))
    assert (ack["directive_id"], ack["detail"]) == (9, {})
    dump = StackDump(time=5.0, threads="x" * 10, flight_recorder=None, note=None)
    assert "flight_recorder" not in valid(records.stack_dump(ORIGIN, 9, dump))
    outcome: dict[str, Any] = {"stack": {}, "stack_key": "k", "kernels": {}, "rerun": None, "seconds": 0.1,
               "over_budget": False}  # fmt: skip
    canary = valid(records.canary_result(ORIGIN, 6.0, 7, None, outcome))
    assert canary["device_uuid"] == "GPU-1" and "directive_id" not in canary


def test_an_event_is_checked_when_made_and_sent_with_its_origin() -> None:
    event = records.checkpoint(10, "ckpt-10", 1.0, manifest={"step": 10, "files": [], "consumed": 80})
    sent = valid(records.with_origin(event, ORIGIN))
    assert (sent["incarnation"], sent["rank"], sent["consumed"]) == ("inc-1", 1, 80)
    with pytest.raises(protocol.ProtocolError, match=r"checkpoint\.tags"):
        records.checkpoint(10, "ckpt-10", 1.0, tags=["x" * 65])
    resume = records.resume({"model": {}}, None, 10, 2.0, [1, 2])
    assert valid(records.with_origin(resume, ORIGIN))["restored"]["first_sample_ids"] == [1, 2]


def test_the_step_identity_is_checked_once() -> None:
    assert records.step_identity(IDENTITY, "inc-1")["dp_rank"] == 1
    with pytest.raises(protocol.ProtocolError, match=r"step\.node"):
        records.step_identity(Identity(0, 1, 0, "n" * 201, "cpu", None, ParallelLayout()), "inc-1")


class Sent:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def submit(self, record: dict[str, Any]) -> None:
        self.records.append(record)


def test_the_outbox_keeps_what_comes_before_attach_and_sends_it_in_order() -> None:
    outbox = Outbox(limit=3)
    outbox.submit({"kind": "link_sample", "seq": 1})
    outbox.submit_event(records.checkpoint(10, "ckpt-10", 1.0))
    outbox.submit_event(records.resume({}, "ckpt-10", 10, 2.0, None))
    outbox.submit({"kind": "link_sample", "seq": 2})  # over the limit: dropped
    sent = Sent()
    rank0 = records.Origin("inc-1", 0, "node-a", None)
    outbox.open(cast(Sender, sent), rank0)
    assert [(r["kind"], r.get("incarnation")) for r in sent.records] == [
        ("link_sample", None),
        ("checkpoint", "inc-1"),
        ("resume", "inc-1"),
    ]
    outbox.close()
    outbox.submit({"kind": "link_sample", "seq": 3})
    assert len(sent.records) == 3  # closed: nothing more goes out


def test_only_rank_0_sends_checkpoint_events() -> None:
    outbox, sent = Outbox(limit=10), Sent()
    outbox.open(cast(Sender, sent), ORIGIN)  # rank 1
    outbox.submit_event(records.checkpoint(10, "ckpt-10", 1.0))
    outbox.submit_event(records.resume({}, None, None, 2.0, None))
    assert [r["kind"] for r in sent.records] == ["resume"]
