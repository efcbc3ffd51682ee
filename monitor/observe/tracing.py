"""OpenTelemetry spans for the stages a fault passes through: ingest batch, evaluation, incident
opened, proposal, approval, directive, acknowledgement.

A human approval can take hours, so no trace is held open across it. Each stage is a short span
of its own, and every span about an incident carries a *link* to the incident's span. That span's
context is derived from the incident itself (run, id, opening time), so a stage recorded days
later, or after a service restart, links to it without the store keeping trace ids; directives
work the same way, so an acknowledgement links to its directive.

Off unless the standard ``OTEL_*`` variables configure an exporter; the environment is read once,
through an injected mapping, and the tracer provider belongs to the ``Tracing`` object that the
service is given (nothing is registered globally).
"""

from __future__ import annotations

import contextvars
import hashlib
import importlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider, sampling
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import Link, Span, SpanContext, TraceFlags

from monitor.errors import ConfigError
from policies.flags import FlagError, parse_flag

ExporterFactory = Callable[[Mapping[str, str]], SpanExporter]
Attributes = Mapping[str, str | int | float | bool]

INGEST = "runhealth.ingest"
EVALUATE = "runhealth.evaluate"
INCIDENT = "runhealth.incident"
DIRECTIVE = "runhealth.directive"
ACKNOWLEDGEMENT = "runhealth.acknowledgement"
PROPOSAL = "runhealth.proposal"
APPROVAL = "runhealth.approval"

# The OpenTelemetry specification's defaults for the batch processor (OTEL_BSP_*) and for span
# limits, passed explicitly because the SDK would otherwise read them from os.environ.
BATCH_DEFAULTS = {
    "OTEL_BSP_MAX_QUEUE_SIZE": 2048,
    "OTEL_BSP_SCHEDULE_DELAY": 5000,
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": 512,
    "OTEL_BSP_EXPORT_TIMEOUT": 30000,
}
LIMITS = SpanLimits(
    max_attributes=128,
    max_events=128,
    max_links=128,
    max_span_attributes=128,
    max_event_attributes=128,
    max_link_attributes=128,
    max_attribute_length=4096,
    max_span_attribute_length=4096,
)


@dataclass(frozen=True)
class IncidentRef:
    """What names an incident's span: enough to derive its context again at any later time."""

    run: str
    id: int
    opened_at: float

    @property
    def context(self) -> SpanContext:
        return derived_context(f"incident:{self.run}:{self.id}:{self.opened_at!r}")


@dataclass(frozen=True)
class DirectiveRef:
    run: str
    id: int
    created_at: float

    @property
    def context(self) -> SpanContext:
        return derived_context(f"directive:{self.run}:{self.id}:{self.created_at!r}")


def derived_context(key: str) -> SpanContext:
    """A valid, sampled span context that depends only on ``key``."""
    digest = hashlib.blake2b(key.encode(), digest_size=24, person=b"runhealth-span").digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:], "big") or 1
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))


_PINNED: contextvars.ContextVar[SpanContext | None] = contextvars.ContextVar("runhealth_pinned", default=None)


class PinnedIds(IdGenerator):
    """Random ids, except for the one span started under ``pinned()``, which takes the ids of a
    derived context: how an incident's own span gets the context later stages link to."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()

    def generate_trace_id(self) -> int:
        pinned = _PINNED.get()
        return pinned.trace_id if pinned is not None else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        pinned = _PINNED.get()
        if pinned is None:
            return self._random.generate_span_id()
        _PINNED.set(None)  # one span only: its children get random ids
        return pinned.span_id

    def is_trace_id_random(self) -> bool:
        return _PINNED.get() is None


@contextmanager
def pinned(context: SpanContext) -> Iterator[None]:
    token = _PINNED.set(context)
    try:
        yield
    finally:
        _PINNED.reset(token)


class Tracing:
    """The service's tracer. ``Tracing.off()`` records nothing and costs a no-op span."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        if provider is not None and not isinstance(provider.id_generator, PinnedIds):
            raise ValueError("Tracing needs a provider from new_provider() (its ids link the stages)")
        self.provider = provider
        self.enabled = provider is not None
        source = provider if provider is not None else trace.NoOpTracerProvider()
        self._tracer = source.get_tracer("runhealth")

    @classmethod
    def off(cls) -> Tracing:
        return cls(None)

    @classmethod
    def to_exporter(cls, exporter: SpanExporter, service_name: str = "runhealth") -> Tracing:
        """Spans exported one by one as they end (tests, the console)."""
        provider = new_provider(Resource({"service.name": service_name}), sampling.ALWAYS_ON)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider)

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str], exporters: Mapping[str, ExporterFactory] | None = None
    ) -> Tracing:
        """Configured by ``OTEL_TRACES_EXPORTER`` (comma-separated names; ``none``), else by an
        OTLP endpoint variable; off when neither is set or ``OTEL_SDK_DISABLED=true``. Also read:
        ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` (and ``_ARG``),
        ``OTEL_BSP_*``. ``exporters`` maps a name to a factory (default: console and otlp)."""
        factories = dict(EXPORTERS if exporters is None else exporters)
        chosen = exporter_names(environ)
        if not chosen:
            return cls.off()
        unknown = [name for name in chosen if name not in factories]
        if unknown:
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER: unknown exporter {unknown[0]!r} (known: {sorted(factories)})"
            )
        provider = new_provider(resource_from(environ), sampler_from(environ))
        for name in chosen:
            exporter = factories[name](environ)
            processor: SpanProcessor = (
                SimpleSpanProcessor(exporter) if name == "console" else batch_processor(exporter, environ)
            )
            provider.add_span_processor(processor)
        return cls(provider)

    @contextmanager
    def span(
        self, name: str, attributes: Attributes | None = None, links: Sequence[Link] = ()
    ) -> Iterator[Span]:
        """A span of the current trace (a child of the current span, if any)."""
        with self._tracer.start_as_current_span(name, attributes=attributes, links=links) as span:
            yield span

    @contextmanager
    def stage(
        self, name: str, incident: IncidentRef | None, attributes: Attributes | None = None
    ) -> Iterator[Span]:
        """A decision stage about an incident (``PROPOSAL``, ``APPROVAL``, ...): a trace of its
        own, linked to the incident's span. What the decision workflow calls."""
        links = [incident_link(incident)] if incident is not None else []
        merged = {**(incident_attributes(incident) if incident else {}), **(attributes or {})}
        with self._tracer.start_as_current_span(
            name, context=Context(), attributes=merged, links=links
        ) as span:
            yield span

    def incident_opened(self, incident: IncidentRef, attributes: Attributes) -> None:
        """The incident's own span, with the context every later stage links to; it links back to
        the span that detected it (an evaluation or a hang check) when there is one."""
        self._pinned_span(INCIDENT, incident.context, incident.opened_at, attributes, self._current_link())

    def directive_created(
        self, directive: DirectiveRef, incident: IncidentRef | None, attributes: Attributes
    ) -> None:
        links = self._current_link() + ([incident_link(incident)] if incident is not None else [])
        self._pinned_span(DIRECTIVE, directive.context, directive.created_at, attributes, links)

    def recorded(self, name: str, at: float, incident: IncidentRef | None, attributes: Attributes) -> None:
        """A stage the store recorded at ``at`` (an audit entry): a trace of its own, linked to
        its incident's span."""
        if not self.enabled:
            return
        start = int(at * 1e9)
        links = [incident_link(incident)] if incident is not None else []
        span = self._tracer.start_span(
            name, context=Context(), attributes=attributes, links=links, start_time=start
        )
        span.end(end_time=start)

    def _pinned_span(
        self, name: str, context: SpanContext, at: float, attributes: Attributes, links: Sequence[Link]
    ) -> None:
        if not self.enabled:
            return
        start = int(at * 1e9)
        with pinned(context):
            span = self._tracer.start_span(
                name, context=Context(), attributes=attributes, links=links, start_time=start
            )
        span.end(end_time=start)  # an instant: what took time is the span that links to it

    def _current_link(self) -> list[Link]:
        current = trace.get_current_span().get_span_context()
        return [Link(current)] if current.is_valid else []

    def force_flush(self) -> None:
        if self.provider is not None:
            self.provider.force_flush()

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def incident_link(incident: IncidentRef) -> Link:
    return Link(incident.context, attributes={"runhealth.incident.id": incident.id})


def incident_attributes(incident: IncidentRef) -> dict[str, str | int]:
    return {"runhealth.run": incident.run, "runhealth.incident.id": incident.id}


def new_provider(resource: Resource, sampler: sampling.Sampler) -> TracerProvider:
    # shutdown_on_exit=False: no atexit hook; whoever built the service shuts tracing down.
    return TracerProvider(
        sampler=sampler,
        resource=resource,
        shutdown_on_exit=False,
        id_generator=PinnedIds(),
        span_limits=LIMITS,
    )


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    if sdk_disabled(environ):
        return []
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if not raw:
        endpoints = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if any(environ.get(name, "").strip() for name in endpoints) else []
    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    return [name for name in names if name != "none"]


def sdk_disabled(environ: Mapping[str, str]) -> bool:
    """``OTEL_SDK_DISABLED``, spelled as every runhealth yes/no is (policies.flags): the spec's
    ``true`` and ``false`` read as it says, and a misspelling is an error, not "enabled"."""
    raw = environ.get("OTEL_SDK_DISABLED", "").strip()
    try:
        return bool(raw) and parse_flag(raw, "OTEL_SDK_DISABLED")
    except FlagError as exc:
        raise ConfigError(str(exc)) from None


def resource_from(environ: Mapping[str, str]) -> Resource:
    attributes: dict[str, str] = {}
    for pair in environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            attributes[unquote(key.strip())] = unquote(value.strip())
    attributes["service.name"] = (
        environ.get("OTEL_SERVICE_NAME", "").strip() or attributes.get("service.name") or "runhealth"
    )
    return Resource(attributes)


def sampler_from(environ: Mapping[str, str]) -> sampling.Sampler:
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    raw = environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0").strip() or "1.0"
    try:
        ratio = float(raw)
    except ValueError as exc:
        raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG must be a number, got {raw!r}") from exc
    roots: dict[str, Callable[[], sampling.Sampler]] = {
        "always_on": lambda: sampling.ALWAYS_ON,
        "always_off": lambda: sampling.ALWAYS_OFF,
        "traceidratio": lambda: sampling.TraceIdRatioBased(ratio),
    }
    base = name.removeprefix("parentbased_")
    if base not in roots:
        raise ConfigError(f"OTEL_TRACES_SAMPLER: unsupported sampler {name!r}")
    root = roots[base]()
    return sampling.ParentBased(root) if name.startswith("parentbased_") else root


def batch_processor(exporter: SpanExporter, environ: Mapping[str, str]) -> BatchSpanProcessor:
    values = {}
    for name, default in BATCH_DEFAULTS.items():
        raw = environ.get(name, "").strip()
        if raw and not raw.isdigit():
            raise ConfigError(f"{name} must be a whole number, got {raw!r}")
        values[name] = int(raw) if raw else default
    return BatchSpanProcessor(
        exporter,
        max_queue_size=values["OTEL_BSP_MAX_QUEUE_SIZE"],
        schedule_delay_millis=values["OTEL_BSP_SCHEDULE_DELAY"],
        max_export_batch_size=values["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"],
        export_timeout_millis=values["OTEL_BSP_EXPORT_TIMEOUT"],
    )


def console_exporter(_environ: Mapping[str, str]) -> SpanExporter:
    return ConsoleSpanExporter(out=sys.stdout)


def otlp_exporter(environ: Mapping[str, str]) -> SpanExporter:
    """OTLP over HTTP or gRPC, when the opentelemetry-exporter-otlp package is installed."""
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    module = {
        "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    }.get(protocol)
    if module is None:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: unsupported protocol {protocol!r}")
    try:
        exporter_class: Any = importlib.import_module(module).OTLPSpanExporter
    except ImportError as exc:
        raise ConfigError(
            "OTLP trace export needs the opentelemetry-exporter-otlp package (pip install "
            "opentelemetry-exporter-otlp), or set OTEL_TRACES_EXPORTER=console"
        ) from exc
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not endpoint and base:
        endpoint = base.rstrip("/") + "/v1/traces" if protocol == "http/protobuf" else base
    headers = dict(
        (unquote(k.strip()), unquote(v.strip()))
        for k, _, v in (p.partition("=") for p in environ.get("OTEL_EXPORTER_OTLP_HEADERS", "").split(","))
        if k.strip()
    )
    kwargs: dict[str, Any] = {"headers": headers or None}
    if endpoint:
        kwargs["endpoint"] = endpoint
    return exporter_class(**kwargs)  # type: ignore[no-any-return]


EXPORTERS: Mapping[str, ExporterFactory] = {"console": console_exporter, "otlp": otlp_exporter}
