"""The inference API (port 8443): the front door's paths (chat, decisions) are the server's own handlers; the
rest (models, metrics, health, unknown paths) is this Litestar application."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from typing import Any

from litestar import Litestar, Request, Response, get, route
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.exceptions import HTTPException
from litestar.handlers.base import BaseRouteHandler
from litestar.params import SkipValidation

from capyctl.adapters.http.asgi import REQUEST_ID_KEY, with_request_ids
from capyctl.adapters.http.errors import envelope, status_of
from capyctl.adapters.http.prometheus import CONTENT_TYPE as PROMETHEUS_TYPE
from capyctl.adapters.http.prometheus import RequestStats
from capyctl.adapters.http.views import FleetDep
from capyctl.domain.deployments import LISTED_STATE, InstanceState, engine_slots
from capyctl.domain.errors import CapyError, Forbidden, InternalError, InvalidJson, MethodNotAllowed, NotFound
from capyctl.domain.keys import ApiKey
from capyctl.domain.ports import Clock
from capyctl.services.admission import AdmissionService
from capyctl.services.controllers import Controller, InstanceStatus
from capyctl.services.fleet import Fleet
from capyctl.services.keys import Keyring

StatsDep = NamedDependency[SkipValidation[RequestStats]]
StartedDep = NamedDependency[SkipValidation[float]]
AdmissionDep = NamedDependency[SkipValidation[AdmissionService]]
log = logging.getLogger("capyctl.http")


def capy_error_response(
    _: Request[Any, Any, Any], error: CapyError, headers: dict[str, str] | None = None
) -> Response[dict[str, Any]]:
    return Response(
        envelope(error), status_code=status_of(error), headers={"cache-control": "no-store", **(headers or {})}
    )


def http_error_response(request: Request[Any, Any, Any], error: HTTPException) -> Response[dict[str, Any]]:
    if error.status_code == 404:
        return capy_error_response(request, NotFound(f"no such endpoint: {request.method} {request.url.path}"))
    if error.status_code == 405:  # RFC 9110: a 405 names the methods the path takes (Litestar's router lists them)
        allow = (error.headers or {}).get("allow")
        refused = MethodNotAllowed(
            f"{request.method} is not allowed on {request.url.path}" + (f"; it takes {allow}" if allow else "")
        )
        return capy_error_response(request, refused, {"allow": allow} if allow else None)
    wrapped = CapyError(str(error.detail))
    wrapped.code = "invalid_request" if error.status_code < 500 else "internal_error"
    return capy_error_response(request, wrapped)


def unexpected_error_response(request: Request[Any, Any, Any], error: Exception) -> Response[dict[str, Any]]:
    request_id = str(request.scope.get(REQUEST_ID_KEY, "-"))  # a str: with_request_ids set it
    log.error("request %s: internal error on %s %s", request_id, request.method, request.url.path, exc_info=error)
    return capy_error_response(request, InternalError(request_id))


def too_deep_response(request: Request[Any, Any, Any], _: RecursionError) -> Response[dict[str, Any]]:
    """A request body nested deeper than the JSON decoder goes is the client's error, not CapyCTL's."""
    return capy_error_response(
        request, InvalidJson("JSON nested too deeply (CapyCTL decodes up to several hundred levels)")
    )


def error_handlers() -> dict[Any, Any]:
    return {
        CapyError: capy_error_response,
        HTTPException: http_error_response,
        RecursionError: too_deep_response,
        Exception: unexpected_error_response,
    }


def require_key(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """The request's API key, checked (401 otherwise) and kept for the handler; listing never counts."""
    connection.state.key = connection.app.state.keyring.authenticate(connection.headers.get("authorization"))


def require_unscoped_key(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """A key limited to some models may not read what concerns the others (CapyCTL's metrics)."""
    require_key(connection, handler)
    key: ApiKey = connection.state.key
    if key.models is not None:
        raise Forbidden(
            f"the key {key.name!r} is limited to some models and may not read {connection.url.path}; "
            "use a key without a model scope (such as the key named default)"
        )


@get("/v1/models", guards=[require_key], sync_to_thread=False)
def list_models(
    request: Request[Any, Any, Any], fleet: FleetDep, started: StartedDep, admission: AdmissionDep
) -> Response[dict[str, Any]]:
    """Lists deployments with their state, queue and measured start time; never starts, wakes or loads
    anything. A key limited to some models sees only them."""
    key: ApiKey = request.state.key
    data = [model_entry(s, started, admission) for s in fleet.leads() if key.sees(s.name)]
    return Response({"object": "list", "data": data}, headers={"cache-control": "no-store"})


def cold_start_estimate(status: InstanceStatus) -> float | None:
    """Seconds the transition the model's state needs would take, by the median of its measured ones:
    0 when it is ready, a wake when it is parked, a start otherwise; None until one was measured."""
    if status.state is InstanceState.READY:
        return 0.0
    wakes = status.state in (InstanceState.PARKING, InstanceState.PARKED, InstanceState.WAKING)
    measured = status.wake_times if wakes else status.cold_starts
    return round(statistics.median(measured), 1) if measured else None


def model_entry(runner: Controller, started: float, admission: AdmissionService) -> dict[str, Any]:
    """One model as GET /v1/models lists it: Citadel's top-level fields, CapyCTL's own under ``capyctl``."""
    spec, status = runner.deployment.spec, runner.status
    state = str(status.state)
    family = str(runner.engine.family)
    cold = cold_start_estimate(status)
    return {
        "id": runner.name,
        "object": "model",
        "created": int(started),
        "owned_by": "capyctl",
        "engine": family,
        "state": LISTED_STATE.get(state, "unavailable"),
        "loaded": state == "ready",
        "context_length": spec.engine_config.context_length,
        "cold_start_s": cold,
        "notes": spec.notes,
        "capyctl": {
            "api": spec.api,
            "engine": family,
            "engine_version": runner.engine.version,
            "state": state,
            "instances": 1,
            "max_concurrent": engine_slots(family, spec.engine_config.extra_args),
            "queue": {
                "in_flight": admission.state.in_flight(runner.name),
                "waiting": admission.state.waiting(runner.name),
            },
        },
    }


@get("/metrics", guards=[require_unscoped_key], sync_to_thread=False)
def prometheus_metrics(stats: StatsDep) -> Response[bytes]:
    """CapyCTL's own metrics in Prometheus text format (scrape with the API key as bearer token)."""
    return Response(stats.exposition(), media_type=PROMETHEUS_TYPE, headers={"cache-control": "no-store"})


@get("/health", sync_to_thread=False)
def health() -> dict[str, str]:
    return {"status": "ok"}


@route(
    "/v1/{rest:path}",
    http_method=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
    guards=[require_key],
    sync_to_thread=False,
)
def unknown_v1(rest: str) -> None:
    """Any other /v1/ path: the key is checked first (a caller without one learns nothing), then 404."""
    raise NotFound(
        f"no endpoint /v1{rest}; CapyCTL answers POST /v1/chat/completions, POST /v1/systemone and GET /v1/models"
    )


def create_inference_app(
    fleet: Fleet,
    clock: Clock,
    keys: Keyring,
    stats: RequestStats,
    admission: AdmissionService,
) -> Callable[..., Any]:
    started = clock.wall()  # "created" of every model: when this server started
    models = Litestar(
        route_handlers=[list_models, prometheus_metrics, health, unknown_v1],
        dependencies={
            "fleet": Provide(lambda: fleet, sync_to_thread=False),
            "clock": Provide(lambda: clock, sync_to_thread=False),
            "stats": Provide(lambda: stats, sync_to_thread=False),
            "started": Provide(lambda: started, sync_to_thread=False),
            "admission": Provide(lambda: admission, sync_to_thread=False),
        },
        exception_handlers=error_handlers(),
        openapi_config=None,
        logging_config=None,
        state=State({"keyring": keys}),
    )

    return with_request_ids(models)
