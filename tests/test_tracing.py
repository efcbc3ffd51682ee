"""OpenTelemetry: a span per stage, joined by links to the incident's span, off unless configured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from sqlalchemy.engine import Engine

from monitor.config import ConfigError, ServiceConfig
from monitor.judge.config import EngineConfig
from monitor.observe.stages import incident_ref
from monitor.observe.tracing import (
    ACKNOWLEDGEMENT,
    APPROVAL,
    DIRECTIVE,
    EVALUATE,
    INCIDENT,
    INGEST,
    PROPOSAL,
    DirectiveRef,
    IncidentRef,
    Tracing,
    derived_context,
)
from monitor.recovery.decisions import list_proposals
from monitor.recovery.directives import create_directive
from monitor.service import Service
from policies.hangs import HangConfig
from tests.support import ADMIN_TOKEN, INCARNATION, RunHandle, checkpoint, post, spiky_windows


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def ack(directive: int, rank: int, at: float) -> dict[str, Any]:
    return {
        "kind": "directive_ack",
        "directive_id": directive,
        "incarnation": INCARNATION,
        "rank": rank,
        "time": at,
        "status": "done",
        "step": 80,
    }


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def traced(store: Engine, exporter: InMemorySpanExporter) -> Service:
    return Service(store, ServiceConfig(admin_token=ADMIN_TOKEN), tracing=Tracing.to_exporter(exporter))


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def linked_to(span: ReadableSpan, context: Any) -> bool:
    return any(
        link.context.trace_id == context.trace_id and link.context.span_id == context.span_id
        for link in span.links
    )


# --- the stages ---------------------------------------------------------------------------------------


def test_an_ingest_batch_is_a_span_and_its_evaluation_a_child(
    traced: Service, run: RunHandle, exporter: InMemorySpanExporter
) -> None:
    post(traced, run, spiky_windows(range(1, 4)))
    (ingest,) = named(exporter, INGEST)
    (evaluate,) = named(exporter, EVALUATE)
    assert ingest.parent is None and ingest.context is not None
    assert evaluate.parent is not None and evaluate.parent.span_id == ingest.context.span_id
    assert ingest.attributes == {
        "runhealth.run": run.name,
        "runhealth.records": 6,
        "runhealth.accepted": 6,
        "runhealth.duplicates": 0,
    }


def test_every_stage_of_a_rollback_links_to_the_incident_and_none_is_held_open(
    traced: Service, run: RunHandle, exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    post(traced, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 2}])
    post(traced, run, [checkpoint(tmp_path, 20), *spiky_windows(range(1, 65))])
    post(traced, run, spiky_windows(range(65, 75), spike=65))
    with traced.engine.connect() as connection:
        (proposal,) = list_proposals(connection, run.name)
        incident = incident_ref(connection, proposal["incident"])

    (opened,) = [s for s in named(exporter, INCIDENT) if s.attributes["runhealth.incident.id"] == incident.id]
    assert opened.context is not None
    assert (opened.context.trace_id, opened.context.span_id) == (
        incident.context.trace_id,
        incident.context.span_id,
    )
    assert opened.parent is None and opened.start_time == int(incident.opened_at * 1e9)
    (evaluation,) = [s for s in named(exporter, EVALUATE) if linked_to(opened, s.context)]
    (proposed,) = named(exporter, PROPOSAL)
    assert proposed.attributes["runhealth.action"] == "proposed" and linked_to(proposed, incident.context)

    traced.decisions.approve(proposal["id"], "alice", "the spike is reproducible")
    traced.check_hangs()  # the next watched job traces what the API recorded meanwhile
    (approved,) = named(exporter, APPROVAL)
    assert approved.attributes["runhealth.actor"] == "alice" and linked_to(approved, incident.context)
    (directive,) = named(exporter, DIRECTIVE)
    directive_id = directive.attributes["runhealth.directive.id"]
    assert isinstance(directive_id, int) and linked_to(directive, incident.context)

    post(traced, run, [ack(directive_id, 0, 500.0), ack(directive_id, 1, 500.0)])
    (acknowledged,) = named(exporter, ACKNOWLEDGEMENT)  # one span for both ranks
    assert acknowledged.attributes["runhealth.ranks"] == 2
    assert acknowledged.attributes["runhealth.ranks.done"] == 2
    assert directive.context is not None and linked_to(acknowledged, directive.context)
    assert linked_to(acknowledged, incident.context)

    stages = [opened, proposed, approved, directive]
    assert len({s.context.trace_id for s in stages if s.context}) == len(stages)  # no trace spans stages
    assert evaluation.context is not None and evaluation.context.trace_id != opened.context.trace_id


def test_a_hang_its_stack_request_and_the_answer_are_linked(
    store: Engine, run: RunHandle, exporter: InMemorySpanExporter
) -> None:
    clock = Clock(10_000.0)
    config = ServiceConfig(engine=EngineConfig(hangs=HangConfig(min_timeout_s=30.0)))
    service = Service(store, config, clock=clock, tracing=Tracing.to_exporter(exporter))
    beats = [
        {
            "kind": "heartbeat",
            "incarnation": INCARNATION,
            "rank": r,
            "phase": "backward",
            "phase_since": 9_900.0 if r == 2 else 9_999.0,
            "time": 9_999.0,
        }
        for r in range(4)
    ]
    post(service, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": 9_000.0, "world_size": 4}])
    post(service, run, beats)
    assert service.check_hangs() != []
    (hang,) = named(exporter, INCIDENT)
    assert hang.attributes["runhealth.incident.kind"] == "hang"
    (request,) = [
        s for s in named(exporter, DIRECTIVE) if s.attributes["runhealth.directive.kind"] == "dump_stacks"
    ]
    assert request.attributes["runhealth.directive.created_by"] == "engine"
    assert hang.context is not None and linked_to(request, hang.context)
    directive_id = request.attributes["runhealth.directive.id"]
    assert isinstance(directive_id, int)
    post(service, run, [ack(directive_id, 2, 10_001.0)])
    (answer,) = named(exporter, ACKNOWLEDGEMENT)
    assert (
        linked_to(answer, hang.context) and request.context is not None and linked_to(answer, request.context)
    )


def test_a_directive_made_through_the_api_is_traced_by_the_next_check(
    traced: Service, run: RunHandle, exporter: InMemorySpanExporter
) -> None:
    post(traced, run, spiky_windows(range(1, 3)))  # tracing starts following the store here
    with traced.engine.begin() as connection:
        created = create_directive(connection, run.id, "dump_stacks", created_by="admin", now=123.0)
    traced.check_hangs()
    (span,) = [s for s in named(exporter, DIRECTIVE) if s.attributes["runhealth.directive.id"] == created]
    context = DirectiveRef(run.name, created, 123.0).context
    assert span.context is not None and span.context.span_id == context.span_id and span.links == ()
    traced.check_hangs()
    assert (
        len([s for s in named(exporter, DIRECTIVE) if s.attributes["runhealth.directive.id"] == created]) == 1
    )


def test_history_before_tracing_started_is_not_traced(
    store: Engine, run: RunHandle, exporter: InMemorySpanExporter
) -> None:
    with store.begin() as connection:
        create_directive(connection, run.id, "dump_stacks", created_by="admin", now=1.0)
    service = Service(store, ServiceConfig(), tracing=Tracing.to_exporter(exporter))
    service.check_hangs()
    assert named(exporter, DIRECTIVE) == []


def test_off_by_default_and_then_it_reads_nothing_more(store: Engine, run: RunHandle) -> None:
    service = Service(store, ServiceConfig())
    assert service.tracing.enabled is False
    seen: list[str] = []

    def record(*args: Any) -> None:
        seen.append(args[2])

    sa.event.listen(store, "before_cursor_execute", record)
    try:
        service.check_hangs()
    finally:
        sa.event.remove(store, "before_cursor_execute", record)
    assert not any("audit_log" in statement for statement in seen)


def test_a_stage_traced_by_hand_is_its_own_trace_linked_to_the_incident(
    exporter: InMemorySpanExporter,
) -> None:
    tracing = Tracing.to_exporter(exporter)
    incident = IncidentRef("run-a", 7, 1000.0)
    with tracing.span(INGEST):
        with tracing.stage(APPROVAL, incident, {"runhealth.actor": "bob"}):
            pass
    (approval,) = named(exporter, APPROVAL)
    (ingest,) = named(exporter, INGEST)
    assert approval.parent is None and ingest.context is not None and approval.context is not None
    assert approval.context.trace_id != ingest.context.trace_id
    assert linked_to(approval, incident.context)
    assert approval.attributes == {
        "runhealth.run": "run-a",
        "runhealth.incident.id": 7,
        "runhealth.actor": "bob",
    }


def test_derived_contexts_are_stable_distinct_and_pin_one_span_only(exporter: InMemorySpanExporter) -> None:
    first, again, other = IncidentRef("a", 1, 5.0), IncidentRef("a", 1, 5.0), IncidentRef("a", 2, 5.0)
    assert first.context == again.context and first.context != other.context
    assert first.context.is_valid and first.context != DirectiveRef("a", 1, 5.0).context
    assert derived_context("x").trace_flags.sampled
    tracing = Tracing.to_exporter(exporter)
    tracing.incident_opened(first, {"runhealth.incident.id": 1})
    with tracing.span(INGEST):
        pass
    (opened,) = named(exporter, INCIDENT)
    (ingest,) = named(exporter, INGEST)
    assert opened.context is not None and ingest.context is not None
    assert opened.context.span_id == first.context.span_id
    assert ingest.context.trace_id != first.context.trace_id


def test_a_provider_without_the_pinned_ids_is_refused() -> None:
    with pytest.raises(ValueError):
        Tracing(TracerProvider(shutdown_on_exit=False))


# --- the environment ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"},
        {"OTEL_SERVICE_NAME": "runhealth"},
    ],
)
def test_off_unless_an_exporter_is_configured(environ: dict[str, str]) -> None:
    assert Tracing.from_environ(environ).enabled is False


def test_an_injected_exporter_with_the_resource_from_the_environment(exporter: InMemorySpanExporter) -> None:
    environ = {
        "OTEL_TRACES_EXPORTER": "memory",
        "OTEL_SERVICE_NAME": "runhealth-east",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,cluster=a%2Cb",
        "OTEL_BSP_SCHEDULE_DELAY": "10",
    }
    tracing = Tracing.from_environ(environ, exporters={"memory": lambda _environ: exporter})
    with tracing.span(INGEST):
        pass
    tracing.force_flush()
    (span,) = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == "runhealth-east"
    assert span.resource.attributes["cluster"] == "a,b"
    assert span.resource.attributes["deployment.environment"] == "test"
    tracing.shutdown()


def test_the_console_exporter(capsys: pytest.CaptureFixture[str]) -> None:
    tracing = Tracing.from_environ({"OTEL_TRACES_EXPORTER": "console"})
    assert tracing.provider is not None
    with tracing.span(INGEST, {"runhealth.run": "run-a"}):
        pass
    tracing.shutdown()
    assert '"name": "runhealth.ingest"' in capsys.readouterr().out


def test_otlp_without_its_package_says_what_to_install() -> None:
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp"):
        Tracing.from_environ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "unknown exporter"),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "jaeger_remote"}, "unsupported sampler"),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER_ARG": "half"}, "must be a number"),
        ({"OTEL_TRACES_EXPORTER": "memory", "OTEL_BSP_MAX_QUEUE_SIZE": "lots"}, "whole number"),
    ],
)
def test_bad_settings_are_named(environ: dict[str, str], message: str) -> None:
    exporters = {"console": lambda _e: ConsoleSpanExporter(), "memory": lambda _e: InMemorySpanExporter()}
    with pytest.raises(ConfigError, match=message):
        Tracing.from_environ(environ, exporters=exporters)


def test_the_sampler_from_the_environment() -> None:
    ratio = Tracing.from_environ(
        {
            "OTEL_TRACES_EXPORTER": "memory",
            "OTEL_TRACES_SAMPLER": "traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
        },
        exporters={"memory": lambda _e: InMemorySpanExporter()},
    )
    assert ratio.provider is not None and isinstance(ratio.provider.sampler, TraceIdRatioBased)
    off = Tracing.from_environ(
        {"OTEL_TRACES_EXPORTER": "memory", "OTEL_TRACES_SAMPLER": "parentbased_always_off"},
        exporters={"memory": lambda _e: InMemorySpanExporter()},
    )
    assert off.provider is not None and isinstance(off.provider.sampler, ParentBased)
    assert off.provider.sampler._root is ALWAYS_OFF
