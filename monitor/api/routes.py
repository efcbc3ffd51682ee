"""The HTTP API (FastAPI): ingest, reads and health.

Errors are JSON: ``{"error": CODE, "message": TEXT}``, plus ``"problems": [{"index", "field",
"message"}]`` for invalid records. Nonfinite floats in responses are written as ``"NaN"``,
``"Infinity"`` and ``"-Infinity"`` (``monitor.store.floats``).
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool

from monitor.ingest.batches import ConflictError, InvalidRecord
from monitor.ingest.schemas import BatchIn, DecisionIn, DirectiveCreateIn, RunCreateIn
from monitor.observe.metrics import metrics_registry
from monitor.recovery import decisions, directives
from monitor.service import Service
from monitor.store import operators, queries
from monitor.store.durability import StoreUnavailable
from monitor.store.floats import dumps
from policies import protocol

BATCH = TypeAdapter(BatchIn)
RUN_CREATE = TypeAdapter(RunCreateIn)
DIRECTIVE_CREATE = TypeAdapter(DirectiveCreateIn)


class DecisionBody(DecisionIn):
    """A decision's body: with the admin token it may name the local user who decides."""

    operator: Annotated[str, Field(min_length=1, max_length=100)] | None = None


DECISION = TypeAdapter(DecisionBody)


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


def validate_batch(raw: bytes, max_records: int) -> BatchIn:
    try:
        batch = BATCH.validate_json(raw)
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


def create_app(service: Service, registry: CollectorRegistry | None = None) -> FastAPI:
    app = FastAPI(title="runhealth", version="1", docs_url=None, redoc_url=None)
    app.state.service = service
    # The app's own registry (never prometheus-client's global one): two services in one
    # process, as in the tests, export only their own runs.
    app.state.metrics = metrics = metrics_registry(service, registry)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> Response:
        return json_response({"error": exc.error, "message": exc.message, **exc.extra}, exc.status)

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

    @app.get("/healthz")
    def healthz() -> Response:
        try:
            return json_response(service.healthy())
        except Exception as exc:  # the store is down: say so, with a status a probe reads
            return json_response({"status": "error", "message": str(exc)}, 503)

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        """Prometheus exposition, read from the store and the service at scrape time."""
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/runs")
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

    @app.post("/v1/runs/{run}/token")
    async def renew_token(run: str, request: Request) -> Response:
        """A new token for an existing run (admin): the embedded service of a restarted job."""
        require_admin(request)

        def renew() -> str:
            with service.engine.begin() as connection:
                return queries.renew_run_token(connection, run)

        try:
            token = await run_in_threadpool(renew)
        except queries.NotFound as exc:
            raise ApiError(404, "not_found", str(exc)) from exc
        return json_response({"run": run, "token": token}, 200)

    @app.get("/v1/runs")
    def list_runs(request: Request) -> Response:
        require_admin(request)
        with service.engine.connect() as connection:
            return json_response({"runs": queries.list_runs(connection)})

    @app.post("/v1/runs/{run}/records")
    async def post_records(
        run: str, request: Request, incarnation: str | None = None, rank: int | None = None
    ) -> Response:
        """Ingest a batch. With ``incarnation`` and ``rank`` the answer also carries what that
        rank has still to act on, as ``GET .../directives`` would (after this batch's acks):
        a hook that sends every few seconds then needs no separate poll."""
        run_id = await run_in_threadpool(require_run, request, run)
        limits = service.config.ingest
        try:
            raw = await read_limited(request, limits.max_batch_bytes)
            batch = await run_in_threadpool(validate_batch, raw, limits.max_batch_records)
            result = await run_in_threadpool(service.ingest, run, run_id, batch.records)
        except ConflictError as exc:
            service.count(run, "rejected")
            raise ApiError(409, "conflict", str(exc), index=exc.index, key=exc.key) from exc
        except InvalidRecord as exc:
            service.count(run, "rejected")
            problem = {"index": exc.index, "field": exc.field, "message": str(exc)}
            raise ApiError(422, "invalid_record", str(exc), problems=[problem]) from exc
        except StoreUnavailable as exc:  # not acknowledged: the hook keeps it and sends it again
            raise ApiError(503, "store_unavailable", str(exc)) from exc
        except ApiError:
            service.count(run, "rejected")
            raise
        answer = result.as_json()
        if incarnation is not None and rank is not None:
            answer["directives"] = await run_in_threadpool(pending_directives, run_id, incarnation, rank)
        return json_response(answer)

    def pending_directives(run_id: int, incarnation: str, rank: int) -> list[dict[str, Any]]:
        with service.engine.connect() as connection:
            return directives.pending_for(connection, run_id, incarnation, rank)

    @app.get("/v1/runs/{run}/steps")
    def list_steps(
        run: str,
        request: Request,
        start: Annotated[int | None, Query(ge=0, le=protocol.INT32_MAX)] = None,
        end: Annotated[int | None, Query(ge=0, le=protocol.INT32_MAX)] = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
    ) -> Response:
        run_id = require_run(request, run)
        with service.engine.connect() as connection:
            steps = queries.list_steps(connection, run_id, start, end, limit)
        return json_response({"run": run, "steps": steps})

    @app.get("/v1/runs/{run}/findings")
    def list_findings(run: str, request: Request) -> Response:
        run_id = require_run(request, run)
        with service.engine.connect() as connection:
            return json_response({"run": run, "findings": queries.list_findings(connection, run_id)})

    @app.get("/v1/runs/{run}/directives")
    def list_directives(
        run: str,
        request: Request,
        incarnation: Annotated[str, Query(min_length=1, max_length=64)],
        rank: Annotated[int, Query(ge=0, le=protocol.RANK_LIMIT)],
    ) -> Response:
        """What this rank of this incarnation has still to act on (the hooks poll this)."""
        run_id = require_run(request, run)
        return json_response({"run": run, "directives": pending_directives(run_id, incarnation, rank)})

    @app.post("/v1/runs/{run}/directives")
    async def create_directive(run: str, request: Request) -> Response:
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

    @app.get("/v1/proposals")
    def list_proposals(request: Request, run: str | None = None, status: str | None = None) -> Response:
        token = bearer(request)
        if not is_admin(token):
            require_operator(request)
        with service.engine.connect() as connection:
            return json_response({"proposals": decisions.list_proposals(connection, run, status)})

    @app.post("/v1/proposals/{proposal_id}/{verb}")
    async def decide(proposal_id: int, verb: str, request: Request) -> Response:
        """Approve or reject as the operator whose token this is, or with the admin token as the
        local user the body names (``runhealth approve --db`` on this machine)."""
        if verb not in decisions.DECISION_VERBS:
            raise ApiError(404, "not_found", f"no action {verb!r} on proposals (approve or reject)")
        # An operator token is checked before the body is read, as it always was.
        operator = None if is_admin(bearer(request)) else await run_in_threadpool(require_operator, request)
        body = await decision_body(request)
        decider = decided_by(operator, body)
        try:
            outcome = await run_in_threadpool(
                service.decisions.decide, verb, proposal_id, decider, body.reason
            )
        except decisions.InvalidDecision as exc:
            raise ApiError(422, "invalid", str(exc)) from exc
        status = 200 if outcome.ok else (404 if outcome.proposal is None else 409)
        return json_response(outcome.as_json(), status)

    async def decision_body(request: Request) -> DecisionBody:
        raw = await read_limited(request, 64 * 1024)
        try:
            return DECISION.validate_json(raw or b"{}")
        except ValidationError as exc:
            raise ApiError(422, "invalid", str(exc.errors(include_url=False)[0]["msg"])) from exc

    def decided_by(operator: str | None, body: DecisionBody) -> str:
        """The token's operator; with the admin token (``operator`` None), the named local user."""
        if operator is None:
            return decisions.local_decider(body.operator)
        if body.operator is not None:
            raise ApiError(
                422, "invalid", "only the admin token names who decides; this token is an operator's"
            )
        return operator

    @app.get("/v1/runs/{run}/incidents")
    def list_incidents(run: str, request: Request) -> Response:
        require_run(request, run)
        with service.engine.connect() as connection:
            incidents = queries.list_incidents(connection, queries.IncidentFilter(run=run))
        return json_response({"run": run, "incidents": incidents})

    return app
