"""The API's OpenAPI document: who may call each operation, what it reads, what it answers.

Three bearer schemes name the tokens (a run's, an operator's, the service's admin token) and
each operation lists those it takes; every status an operation answers is listed with its body.
The handlers read their request bodies themselves (the byte limit before any JSON is parsed,
then the strict ingest models), so FastAPI cannot see them: ``operation`` names each one's model
and ``install`` puts those models' schemas into the document. ``tests/test_api_schema.py`` runs
schemathesis against a real service and this document.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field, TypeAdapter

from monitor.ingest.schemas import BatchIn, DecisionIn, DirectiveCreateIn, RejectionIn, RunCreateIn
from policies.directive_lifecycle import DirectiveStatus

RUN_TOKEN = "runToken"
OPERATOR_TOKEN = "operatorToken"
ADMIN_TOKEN = "adminToken"

SECURITY_SCHEMES: dict[str, dict[str, str]] = {
    RUN_TOKEN: {
        "type": "http",
        "scheme": "bearer",
        "description": "A run's token (`rh_run_...`, shown once by `POST /v1/runs` or `runhealth runs "
        "create`): reads and writes that run only.",
    },
    OPERATOR_TOKEN: {
        "type": "http",
        "scheme": "bearer",
        "description": "An operator's token (`runhealth operators add`): lists proposals and decides "
        "them as that operator, until revoked.",
    },
    ADMIN_TOKEN: {
        "type": "http",
        "scheme": "bearer",
        "description": "The service's admin token (`RUNHEALTH_ADMIN_TOKEN`, or the 0600 token file "
        "beside the store): every operation, on every run.",
    },
}

# Who may call an operation: any one of the schemes listed.
ADMIN = (ADMIN_TOKEN,)
RUN_OR_ADMIN = (RUN_TOKEN, ADMIN_TOKEN)
OPERATOR_OR_ADMIN = (OPERATOR_TOKEN, ADMIN_TOKEN)

# The request bodies the handlers read (by their models' names in the document).
REQUEST_BODIES: tuple[type[BaseModel], ...] = (
    BatchIn,
    RunCreateIn,
    DirectiveCreateIn,
    DecisionIn,
    RejectionIn,
)

# A float in an answer: nonfinite ones are written by name (``monitor.store.floats``).
Number = float | Literal["NaN", "Infinity", "-Infinity"]


class ProblemOut(BaseModel):
    """One invalid record: its index in the batch (null: not a record's), the field's dotted path."""

    index: int | None
    field: str | None
    message: str


class ErrorOut(BaseModel):
    """Every refusal: a code (``unauthorized``, ``forbidden``, ``not_found``, ``malformed_json``,
    ``invalid``, ``invalid_record``, ``inconsistent_record``, ``conflict``, ``exists``,
    ``too_large``, ``overloaded``, ``store_unavailable``, ``method_not_allowed``) and a sentence; a 422 on a
    batch names each problem, a 409 on a batch the record and its key."""

    error: str
    message: str
    problems: list[ProblemOut] | None = None
    index: int | None = Field(None, description="The conflicting record's index (409 on a batch).")
    key: dict[str, Any] | None = Field(None, description="The conflicting record's key (409 on a batch).")


class HealthOut(BaseModel):
    status: Literal["ok"]
    replica: str | None = Field(
        default=None, description="This replica's name, when it is one of several over PostgreSQL."
    )
    judging: list[str] | None = Field(
        default=None,
        description="The runs this replica judges (holds the lease of); absent for the only service.",
    )


class HealthErrorOut(BaseModel):
    status: Literal["error"]
    message: str


class RunTokenOut(BaseModel):
    """A run and its token: shown once, only a digest of it is kept."""

    run: str
    token: str


class RunOut(BaseModel):
    name: str
    created_at: Number
    latest_step: int | None
    windows: int | None
    last_record_at: Number | None
    open_incidents: int


class RunsOut(BaseModel):
    runs: list[RunOut]


class DirectiveOut(BaseModel):
    """Something a run's ranks are to do: dump stacks, run a canary, roll back at a step."""

    id: int
    kind: str
    incarnation: str | None
    ranks: list[int] | None
    act_at_step: int | None
    payload: dict[str, Any]
    status: DirectiveStatus
    incident: int | None
    created_by: str
    created_at: Number


class BatchOut(BaseModel):
    """A stored batch: records new to the store, and re-sent ones (same key, same content)."""

    accepted: int
    duplicates: int
    by_kind: dict[str, int]
    directives: list[DirectiveOut] | None = Field(
        None, description="With `incarnation` and `rank`: what that rank has still to act on."
    )
    directives_by_rank: dict[str, list[DirectiveOut]] | None = Field(
        None, description="With `incarnation` and `ranks`: what each of those ranks has still to act on."
    )


class StepOut(BaseModel):
    """The whole run at one accumulation window, aggregated over its ranks."""

    incarnation: str
    attempt: int
    step: int
    ranks: int
    tokens: int | None
    loss: Number | None
    reported_loss: Number | None
    grad_norm: Number | None
    lr: Number | None
    loss_scale: Number | None
    skipped_ranks: int
    consumed: int | None
    time: Number
    judged: bool


class StepsOut(BaseModel):
    run: str
    steps: list[StepOut]


class FindingOut(BaseModel):
    id: int
    incident: int | None
    step: int
    attempt: int | None
    incarnation: str
    rank: int | None
    kind: str
    severity: str
    signal: str
    value: Number | None
    threshold: Number | None
    message: str
    evidence: dict[str, Any] | None


class FindingsOut(BaseModel):
    run: str
    findings: list[FindingOut]


class IncidentOut(BaseModel):
    id: int
    run: str
    kind: str
    severity: str
    status: str
    first_step: int
    last_step: int
    incarnation: str
    summary: str
    ranks: list[Any]
    nodes: list[Any]
    devices: list[Any]
    findings: int
    opened_at: Number
    updated_at: Number
    closed_at: Number | None


class IncidentsOut(BaseModel):
    run: str
    incidents: list[IncidentOut]


class DirectivesOut(BaseModel):
    run: str
    directives: list[DirectiveOut]


class DirectiveCreatedOut(BaseModel):
    run: str
    directive: int


class TargetOut(BaseModel):
    checkpoint: int | None
    step: int | None
    path: str | None


class QuarantineOut(BaseModel):
    node: str | None
    device: str | None


class ProposalOut(BaseModel):
    """A proposed recovery for an incident, and what became of it."""

    id: int
    run: str
    incident: int
    action: str
    status: str
    target: TargetOut
    data_action: str
    skip_batches: list[Any]
    quarantine: QuarantineOut
    verdict: str
    cost_steps: int | None
    evidence: dict[str, Any]
    created_at: Number
    decided_by: str | None
    decided_at: Number | None
    reason: str | None
    directive: int | None


class ProposalsOut(BaseModel):
    proposals: list[ProposalOut]


class DecisionOut(BaseModel):
    """A decision's outcome, as the CLI on the store gives it too (``proposal`` null: none)."""

    ok: bool
    message: str
    proposal: ProposalOut | None


# The errors most operations share, described once.
NO_TOKEN = "No bearer token (`Authorization: Bearer ...`)."
NOT_ADMIN = "The token is not the admin token."
NOT_THE_RUNS = (
    "The token is neither this run's nor the admin's: the same answer whether the run exists or not."
)
NO_SUCH_RUN = "No run of this name (only the admin token learns it)."
BAD_PARAMETER = "A parameter is out of its range or pattern; the message names it."
TOO_LARGE = "The body is over the byte limit."
SHED = (
    "`overloaded`: the service has its bound of batches in flight (`ingest.shedding`) and sheds "
    "load; nothing of this batch was read or stored. Send it again after `Retry-After` seconds."
)
# A 429 always says when to ask again (delay-seconds).
RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before sending the batch again.",
        "schema": {"type": "integer", "minimum": 1},
    }
}

Answer = str | tuple[Any, str]
"""An answer's description (an error: its body is ``ErrorOut``) or its body's type and description."""


def operation(
    security: Sequence[str] | None,
    answers: Mapping[int, Answer],
    body: type[BaseModel] | None = None,
    body_required: bool = True,
    media_type: str = "application/json",
) -> dict[str, Any]:
    """The FastAPI route arguments that document one operation: the tokens it takes (any one
    of ``security``; None: no token), its request body, and every status it answers."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status, answer in answers.items():
        model, description = (ErrorOut, answer) if isinstance(answer, str) else answer
        if model is None:  # not JSON: the body is described by its media type alone
            responses[status] = {"description": description, "content": {media_type: {"schema": {}}}}
        else:
            responses[status] = {"model": model, "description": description}
        if status == 429:
            responses[status]["headers"] = RETRY_AFTER
    extra: dict[str, Any] = {}
    if security is not None:
        extra["security"] = [{scheme: []} for scheme in security]
    if body is not None:
        assert body in REQUEST_BODIES, body
        schema = {"$ref": f"#/components/schemas/{body.__name__}"}
        extra["requestBody"] = {
            "required": body_required,
            "content": {"application/json": {"schema": schema}},
        }
    success = min(status for status in answers if status < 400)
    return {"status_code": success, "responses": responses, "openapi_extra": extra, "response_model": None}


def install(app: FastAPI) -> None:
    """Build ``app``'s document with the security schemes and the request bodies' schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            components = document.setdefault("components", {})
            components["securitySchemes"] = SECURITY_SCHEMES
            schemas = components.setdefault("schemas", {})
            for model in REQUEST_BODIES:
                schema = TypeAdapter(model).json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def run_read(body: type[BaseModel], description: str) -> dict[str, Any]:
    """The route arguments of a read of one run (its own token or the admin's)."""
    return operation(
        RUN_OR_ADMIN,
        {
            200: (body, description),
            401: NO_TOKEN,
            403: NOT_THE_RUNS,
            404: NO_SUCH_RUN,
            422: BAD_PARAMETER,
        },
    )
