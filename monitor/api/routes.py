"""The HTTP API (FastAPI): ingest, reads and health.

Errors are JSON: ``{"error": CODE, "message": TEXT}``, plus ``"problems": [{"index", "field",
"message"}]`` for invalid records. Nonfinite floats in responses are written as ``"NaN"``,
``"Infinity"`` and ``"-Infinity"`` (``monitor.store.floats``). Each route's tokens, body and
answers are in its OpenAPI document (``monitor.api.document``).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import Match

from monitor.api import document
from monitor.api.document import ADMIN, NO_TOKEN, OPERATOR_OR_ADMIN, RUN_OR_ADMIN, operation
from monitor.ingest import schemas
from monitor.ingest.batches import ConflictError, InvalidRecord
from monitor.ingest.schemas import BatchIn, DecisionIn, DirectiveCreateIn, RejectionIn, RunCreateIn
from monitor.observe.metrics import metrics_registry
from monitor.recovery import decisions, directives
from monitor.service import Asked, Service
from monitor.store import operators, queries
from monitor.store.durability import StoreUnavailable
from monitor.store.floats import dumps
from policies import protocol
from policies.proposal_lifecycle import ProposalStatus

RUN_CREATE = TypeAdapter(RunCreateIn)
DIRECTIVE_CREATE = TypeAdapter(DirectiveCreateIn)
DECISION = TypeAdapter(DecisionIn)
REJECTION = TypeAdapter(RejectionIn)

# A run named in a path or a query: a name the service could have given (``protocol.RUN_NAME``).
RUN_NAME_RULE: dict[str, Any] = {
    "min_length": protocol.RUN_NAME.min_length,
    "max_length": protocol.RUN_NAME.max_length,
    "pattern": protocol.RUN_NAME.pattern,
}
RunName = Annotated[str, Path(**RUN_NAME_RULE)]
# The store's ids are signed 64-bit integers.
ProposalId = Annotated[int, Path(ge=1, le=2**63 - 1)]


class ApiError(Exception):
    def __init__(self, status: int, error: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.error, self.message, self.extra = status, error, message, extra


def json_response(body: Any, status: int = 200) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json")


def bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "missing bearer token (Authorization: Bearer ...)")
    return token.strip()


def declared_length(request: Request) -> int | None:
    """The body's ``Content-Length``; None when not given (chunked) or not a number."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


def shed(retry_after_s: int, bound: int) -> Response:
    """The answer to a batch past the bound of batches in flight: nothing of it was read."""
    message = f"the service has {bound} batches in flight; send this one again in {retry_after_s} s"
    answer = json_response({"error": "overloaded", "message": message}, 429)
    answer.headers["Retry-After"] = str(retry_after_s)
    return answer


async def read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "too_large", f"batch of {declared} bytes is over the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "too_large", f"batch is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def problems_of(error: ValidationError) -> list[dict[str, Any]]:
    """Each problem with the record's index and the offending field's dotted path."""
    found = []
    for item in error.errors(include_url=False):
        loc = list(item["loc"])
        index = None
        if len(loc) >= 2 and loc[0] == "records" and isinstance(loc[1], int):
            index = loc[1]
            loc = loc[2:]
            if loc and isinstance(loc[0], str) and item["type"] not in ("union_tag_invalid",):
                loc = loc[1:]  # drop the discriminator's tag ("step", "heartbeat", ...)
        if item["type"] in ("union_tag_invalid", "union_tag_not_found"):
            loc = ["kind"]
        field = ".".join(str(part) for part in loc) or None
        found.append({"index": index, "field": field, "message": item["msg"]})
    return found


def validate_batch(raw: bytes, max_records: int) -> BatchIn | schemas.WholeBatchIn:
    try:
        batch = schemas.validate_batch(raw)
    except ValidationError as exc:
        if any(item["type"] == "json_invalid" for item in exc.errors()):
            raise ApiError(
                400, "malformed_json", f"body is not valid JSON: {exc.errors()[0]['msg']}"
            ) from exc
        problems = problems_of(exc)
        first = problems[0]
        raise ApiError(
            422,
            "invalid_record",
            f"record {first['index']}: field {first['field']!r}: {first['message']}",
            problems=problems,
        ) from exc
    if len(batch.records) > max_records:
        raise ApiError(413, "too_large", f"{len(batch.records)} records is over the limit of {max_records}")
    return batch


# A node's ranks, as its relay names them (``collectors.relay``): nodes have 4 to 16 devices.
MAX_RELAYED_RANKS = 256
RankNumber = Annotated[int, Field(ge=0, le=protocol.RANK_LIMIT)]


@dataclass(frozen=True)
class RankQuestion:
    """Whose pending directives a batch's answer carries: one rank's (``directives``), several
    ranks' (``directives_by_rank``: a node's relay sending for its ranks), both, or none."""

    rank: int | None
    ranks: tuple[int, ...]

    @classmethod
    def of(cls, rank: int | None, ranks: list[int] | None) -> RankQuestion:
        return cls(rank, tuple(dict.fromkeys(ranks or ())))

    def asked(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys((*self.ranks, *(() if self.rank is None else (self.rank,)))))


def allowed_methods(request: Request) -> list[str]:
    """Every method some route takes at this path (Starlette's 405 names only the first
    route's, so ``GET /v1/runs`` beside ``POST /v1/runs`` was missing from its ``Allow``)."""
    allowed: set[str] = set()
    for route in request.app.router.routes:
        methods = getattr(route, "methods", None)
        if methods and route.matches(request.scope)[0] is not Match.NONE:
            allowed |= set(methods)
    return sorted(allowed)


def create_app(service: Service, registry: CollectorRegistry | None = None) -> FastAPI:
    app = FastAPI(title="runhealth", version="1", docs_url=None, redoc_url=None)
    document.install(app)
    app.state.service = service
    # The app's own registry (never prometheus-client's global one): two services in one
    # process, as in the tests, export only their own runs.
    app.state.metrics = metrics = metrics_registry(service, registry)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> Response:
        return json_response({"error": exc.error, "message": exc.message, **exc.extra}, exc.status)

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, exc: HTTPException) -> Response:
        """No route for this path (404) or this method (405, listing those there are)."""
        if exc.status_code == 405:
            allowed = allowed_methods(request)
            message = f"{request.url.path} takes {', '.join(allowed)}, not {request.method}"
            answer = json_response({"error": "method_not_allowed", "message": message}, 405)
            answer.headers["Allow"] = ", ".join(allowed)
            return answer
        if exc.status_code == 404:
            return json_response({"error": "not_found", "message": f"no such path: {request.url.path}"}, 404)
        return json_response({"error": "http_error", "message": str(exc.detail)}, exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> Response:
        """A query parameter out of its range: the API's own error shape, naming it."""
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        return json_response({"error": "invalid", "message": f"{where}: {first.get('msg')}"}, 422)

    @app.exception_handler(queries.NotFound)
    async def not_found(_request: Request, exc: queries.NotFound) -> Response:
        return json_response({"error": "not_found", "message": str(exc)}, 404)

    def is_admin(token: str) -> bool:
        admin = service.config.admin_token
        return admin is not None and secrets.compare_digest(token.encode(), admin.encode())

    def require_admin(request: Request) -> None:
        if not is_admin(bearer(request)):
            raise ApiError(403, "forbidden", "this needs the service's admin token")

    def require_run(request: Request, run: str) -> int:
        """The run's id for its own token (or the admin's). Any other token gets the same 403
        whether the run exists or not: a 404 would let a token holder list other runs' names."""
        token = bearer(request)
        try:
            run_id = service.run_id_for_token(run, token)
        except queries.NotFound:
            if is_admin(token):
                raise
            run_id = None
        if run_id is None:
            if is_admin(token):
                with service.engine.connect() as connection:
                    return int(queries.run_row(connection, run).id)
            raise ApiError(403, "forbidden", f"this token may not access run {run!r}")
        return run_id

    @app.get(
        "/healthz",
        **operation(
            None,
            {
                200: (document.HealthOut, "The service and its store are up."),
                503: (document.HealthErrorOut, "The store is down, gone or read-only; the message says why."),
            },
        ),
    )
    def healthz() -> Response:
        try:
            return json_response(service.healthy())
        except Exception as exc:  # the store is down: say so, with a status a probe reads
            return json_response({"status": "error", "message": str(exc)}, 503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        **operation(None, {200: (None, "Prometheus text exposition.")}, media_type="text/plain"),
    )
    def prometheus_metrics() -> Response:
        """Prometheus exposition, read from the store and the service at scrape time."""
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    @app.post(
        "/v1/runs",
        **operation(
            ADMIN,
            {
                201: (document.RunTokenOut, "Created: the run's token, shown this once."),
                401: NO_TOKEN,
                403: document.NOT_ADMIN,
                409: "A run of this name exists.",
                413: document.TOO_LARGE,
                422: "The body is not JSON, or not a run's valid name.",
            },
            body=RunCreateIn,
        ),
    )
    async def create_run(request: Request) -> Response:
        require_admin(request)
        raw = await read_limited(request, 64 * 1024)
        try:
            body = RUN_CREATE.validate_json(raw)
        except ValidationError as exc:
            raise ApiError(422, "invalid", str(exc.errors(include_url=False)[0]["msg"])) from exc

        def create() -> str:
            with service.engine.begin() as connection:
                return queries.create_run(connection, body.name)

        try:
            token = await run_in_threadpool(create)
        except queries.AlreadyExists as exc:
            raise ApiError(409, "exists", str(exc)) from exc
        return json_response({"run": body.name, "token": token}, 201)

    @app.post(
        "/v1/runs/{run}/token",
        **operation(
            ADMIN,
            {
                200: (
                    document.RunTokenOut,
                    "The run's new token: the old one is refused from now on by this replica, "
                    "and within a second by the others.",
                ),
                401: NO_TOKEN,
                403: document.NOT_ADMIN,
                404: document.NO_SUCH_RUN,
                422: document.BAD_PARAMETER,
            },
        ),
    )
    async def renew_token(run: RunName, request: Request) -> Response:
        """A new token for an existing run (admin): the embedded service of a restarted job."""
        require_admin(request)

        try:
            token = await run_in_threadpool(service.renew_token, run)
        except queries.NotFound as exc:
            raise ApiError(404, "not_found", str(exc)) from exc
        return json_response({"run": run, "token": token}, 200)

    @app.get(
        "/v1/runs",
        **operation(
            ADMIN,
            {200: (document.RunsOut, "Every run."), 401: NO_TOKEN, 403: document.NOT_ADMIN},
        ),
    )
    def list_runs(request: Request) -> Response:
        require_admin(request)
        with service.engine.connect() as connection:
            return json_response({"runs": queries.list_runs(connection)})

    @app.post(
        "/v1/runs/{run}/records",
        **operation(
            RUN_OR_ADMIN,
            {
                200: (document.BatchOut, "Stored, whole, with what is derived from it."),
                400: "The body is not JSON.",
                401: NO_TOKEN,
                403: document.NOT_THE_RUNS,
                404: document.NO_SUCH_RUN,
                409: "A record's key is stored with other content (never overwritten); nothing stored.",
                413: "Over the byte or the record limit.",
                422: "`invalid_record`: a record is not what this document says (type, range, "
                "pattern); `problems` names each. `inconsistent_record`: one is, but not beside "
                "what the run has or itself says, which a schema cannot state: a rank past its "
                "incarnation's declared world size, an acknowledgement of a directive the run does "
                "not have, a manifest digest that is not the manifest's. `invalid`: a parameter "
                "out of its range. Nothing stored.",
                429: document.SHED,
                503: "The store cannot take it now (not acknowledged: send it again).",
            },
            body=BatchIn,
        ),
    )
    async def post_records(
        run: RunName,
        request: Request,
        incarnation: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
        rank: Annotated[int | None, Query(ge=0, le=protocol.RANK_LIMIT)] = None,
        ranks: Annotated[list[RankNumber] | None, Query(max_length=MAX_RELAYED_RANKS)] = None,
    ) -> Response:
        """Ingest a batch. With ``incarnation`` and ``rank`` the answer also carries what that
        rank has still to act on, as ``GET .../directives`` would (after this batch's acks):
        a hook that sends every few seconds then needs no separate poll. With ``incarnation``
        and ``ranks`` (a node's relay, sending for its ranks), the same for each of them.

        Past the bound of batches in flight the batch is shed first of all, before its token is
        checked (a database read on a worker thread, which a full queue would make it wait for)
        or its body read: the answer must be quick to be of use."""
        admission = service.admission
        if not admission.admit(declared_length(request)):
            return shed(admission.config.retry_after_s, admission.config.max_in_flight_batches)
        try:
            return await ingest(run, request, incarnation, RankQuestion.of(rank, ranks))
        finally:
            admission.release()

    async def ingest(run: str, request: Request, incarnation: str | None, rank: RankQuestion) -> Response:
        # A token checked within the last second: no store read, no trip to a worker thread.
        run_id = service.known_run_id(run, bearer(request))
        if run_id is None:
            run_id = await run_in_threadpool(require_run, request, run)
        limits = service.config.ingest
        try:
            raw = await read_limited(request, limits.max_batch_bytes)
            answer = await run_in_threadpool(store_batch, run, run_id, raw, incarnation, rank)
        except ConflictError as exc:
            service.count(run, "rejected")
            raise ApiError(409, "conflict", str(exc), index=exc.index, key=exc.key) from exc
        except InvalidRecord as exc:  # valid alone, not beside what the run has (or itself)
            service.count(run, "rejected")
            problem = {"index": exc.index, "field": exc.field, "message": str(exc)}
            raise ApiError(422, "inconsistent_record", str(exc), problems=[problem]) from exc
        except StoreUnavailable as exc:  # not acknowledged: the hook keeps it and sends it again
            raise ApiError(503, "store_unavailable", str(exc)) from exc
        except ApiError:
            service.count(run, "rejected")
            raise
        return json_response(answer)

    def store_batch(
        run: str, run_id: int, raw: bytes, incarnation: str | None, rank: RankQuestion
    ) -> dict[str, Any]:
        """Validate, store and answer a batch in one trip to a worker thread: each trip there
        and back costs the event loop about as much as validating a one-rank batch."""
        batch = validate_batch(raw, service.config.ingest.max_batch_records)
        asked = rank.asked()
        question = Asked(incarnation, asked) if incarnation is not None and asked else None
        result, pending = service.ingest_asking(run, run_id, batch.records, question)
        answer = result.as_json()
        if question is None:
            return answer
        if rank.rank is not None:
            answer["directives"] = pending[rank.rank]
        if rank.ranks:
            answer["directives_by_rank"] = {str(number): pending[number] for number in rank.ranks}
        return answer

    def pending_directives(run_id: int, incarnation: str, rank: int) -> list[dict[str, Any]]:
        with service.engine.connect() as connection:
            return directives.pending_for(connection, run_id, incarnation, rank)

    @app.get(
        "/v1/runs/{run}/steps",
        **document.run_read(document.StepsOut, "The run's windows, oldest first, within the filters."),
    )
    def list_steps(
        run: RunName,
        request: Request,
        start: Annotated[int | None, Query(ge=0, le=protocol.INT32_MAX)] = None,
        end: Annotated[int | None, Query(ge=0, le=protocol.INT32_MAX)] = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
    ) -> Response:
        run_id = require_run(request, run)
        with service.engine.connect() as connection:
            steps = queries.list_steps(connection, run_id, start, end, limit)
        return json_response({"run": run, "steps": steps})

    @app.get(
        "/v1/runs/{run}/findings",
        **document.run_read(document.FindingsOut, "What the policies found in the run."),
    )
    def list_findings(run: RunName, request: Request) -> Response:
        run_id = require_run(request, run)
        with service.engine.connect() as connection:
            return json_response({"run": run, "findings": queries.list_findings(connection, run_id)})

    @app.get(
        "/v1/runs/{run}/directives",
        **document.run_read(
            document.DirectivesOut, "What this rank of this incarnation has still to act on."
        ),
    )
    def list_directives(
        run: RunName,
        request: Request,
        incarnation: Annotated[str, Query(min_length=1, max_length=64)],
        rank: Annotated[int, Query(ge=0, le=protocol.RANK_LIMIT)],
    ) -> Response:
        """What this rank of this incarnation has still to act on (the hooks poll this)."""
        run_id = require_run(request, run)
        return json_response({"run": run, "directives": pending_directives(run_id, incarnation, rank)})

    @app.post(
        "/v1/runs/{run}/directives",
        **operation(
            ADMIN,
            {
                201: (document.DirectiveCreatedOut, "Created: the directive's id."),
                401: NO_TOKEN,
                403: document.NOT_ADMIN,
                404: document.NO_SUCH_RUN,
                413: document.TOO_LARGE,
                422: "The body is not JSON or not a directive; or the run's name is not a valid one.",
            },
            body=DirectiveCreateIn,
        ),
    )
    async def create_directive(run: RunName, request: Request) -> Response:
        """Ask a run's hooks for something now (admin token): ``{"kind": "dump_stacks"}``."""
        require_admin(request)
        raw = await read_limited(request, 64 * 1024)
        try:
            body = DIRECTIVE_CREATE.validate_json(raw)
        except ValidationError as exc:
            raise ApiError(422, "invalid", str(exc.errors(include_url=False)[0]["msg"])) from exc

        def create() -> int:
            with service.engine.begin() as connection:
                run_id = int(queries.run_row(connection, run).id)
                return directives.create_directive(
                    connection,
                    run_id,
                    body.kind,
                    created_by="admin",
                    now=service.clock(),
                    incarnation=body.incarnation,
                    ranks=body.ranks,
                )

        directive_id = await run_in_threadpool(create)
        return json_response({"run": run, "directive": directive_id}, 201)

    def require_operator(request: Request) -> str:
        """The operator identity bound to this bearer token (unknown or revoked: 403)."""
        token = bearer(request)
        with service.engine.connect() as connection:
            name = operators.identify(connection, token)
        if name is None:
            raise ApiError(403, "forbidden", "this needs an operator token that is known and not revoked")
        return name

    @app.get(
        "/v1/proposals",
        **operation(
            OPERATOR_OR_ADMIN,
            {
                200: (document.ProposalsOut, "The proposals, oldest first, within the filters."),
                401: NO_TOKEN,
                403: "The token is neither a known, unrevoked operator's nor the admin's.",
                422: document.BAD_PARAMETER,
            },
        ),
    )
    def list_proposals(
        request: Request,
        run: Annotated[str | None, Query(**RUN_NAME_RULE)] = None,
        status: ProposalStatus | None = None,
    ) -> Response:
        token = bearer(request)
        if not is_admin(token):
            require_operator(request)
        with service.engine.connect() as connection:
            listed = decisions.list_proposals(connection, run, None if status is None else status.value)
            return json_response({"proposals": listed})

    def decision_answers(decided: str, unfit: str) -> dict[int, document.Answer]:
        return {
            200: (document.DecisionOut, decided),
            401: NO_TOKEN,
            403: "The token is neither a known, unrevoked operator's nor the admin's; or it is an "
            "operator's and the body names who decides (only the admin token names someone).",
            404: (document.DecisionOut, "No such proposal (`ok` false, `proposal` null)."),
            409: (document.DecisionOut, "The proposal cannot be decided so now (`ok` false)."),
            413: document.TOO_LARGE,
            422: f"The body is not JSON or {unfit}; or the id is out of range.",
        }

    @app.post(
        "/v1/proposals/{proposal_id}/approve",
        **operation(
            OPERATOR_OR_ADMIN,
            decision_answers("Approved (and its rollback or quarantine under way).", "not an approval"),
            body=DecisionIn,
            body_required=False,
        ),
    )
    async def approve(proposal_id: ProposalId, request: Request) -> Response:
        """Approve as the operator whose token this is, or with the admin token as the local
        user the body names (``runhealth approve --db`` on this machine)."""
        return await decide("approve", proposal_id, request, DECISION)

    @app.post(
        "/v1/proposals/{proposal_id}/reject",
        **operation(
            OPERATOR_OR_ADMIN,
            decision_answers("Rejected.", "not a rejection with a reason"),
            body=RejectionIn,
        ),
    )
    async def reject(proposal_id: ProposalId, request: Request) -> Response:
        """Reject, with a reason, as ``approve`` decides."""
        return await decide("reject", proposal_id, request, REJECTION)

    async def decide(verb: str, proposal_id: int, request: Request, reader: TypeAdapter[Any]) -> Response:
        # An operator token is checked before the body is read, as it always was.
        operator = None if is_admin(bearer(request)) else await run_in_threadpool(require_operator, request)
        body = await decision_body(request, reader)
        decider = decided_by(operator, body)
        try:
            outcome = await run_in_threadpool(
                service.decisions.decide, verb, proposal_id, decider, body.reason
            )
        except decisions.InvalidDecision as exc:
            raise ApiError(422, "invalid", str(exc)) from exc
        status = 200 if outcome.ok else (404 if outcome.proposal is None else 409)
        return json_response(outcome.as_json(), status)

    async def decision_body(request: Request, reader: TypeAdapter[Any]) -> DecisionIn:
        raw = await read_limited(request, 64 * 1024)
        try:
            body: DecisionIn = reader.validate_json(raw or b"{}")
        except ValidationError as exc:
            raise ApiError(422, "invalid", str(exc.errors(include_url=False)[0]["msg"])) from exc
        return body

    def decided_by(operator: str | None, body: DecisionIn) -> str:
        """The token's operator; with the admin token (``operator`` None), the named local user."""
        if operator is None:
            return decisions.local_decider(body.operator)
        if body.operator is not None:
            raise ApiError(
                403, "forbidden", "only the admin token names who decides; this token is an operator's"
            )
        return operator

    @app.get(
        "/v1/runs/{run}/incidents",
        **document.run_read(document.IncidentsOut, "The run's incidents, oldest first."),
    )
    def list_incidents(run: RunName, request: Request) -> Response:
        require_run(request, run)
        with service.engine.connect() as connection:
            incidents = queries.list_incidents(connection, queries.IncidentFilter(run=run))
        return json_response({"run": run, "incidents": incidents})

    return app
