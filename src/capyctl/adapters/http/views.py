"""JSON views of engines and deployments, shared by the management API and /v1/models."""

from __future__ import annotations

from typing import Annotated, Any

from litestar.params import Dependency

from capyctl.domain.deployments import InstanceState
from capyctl.domain.engines import EngineInstall
from capyctl.domain.ports import Clock
from capyctl.services.controllers import Controller
from capyctl.services.fleet import Fleet


def engine_view(engine: EngineInstall) -> dict[str, Any]:
    return {
        "name": engine.name,
        "family": str(engine.family),
        "version": engine.version,
        "path": engine.path,
        "version_text": engine.version_text,
    }


def deployment_view(controller: Controller, now: float) -> dict[str, Any]:
    spec = controller.deployment.spec
    status = controller.status
    running = status.state in (InstanceState.READY, InstanceState.STARTING) and status.started_at
    return {
        "name": spec.name,
        "api": spec.api,
        "engine": spec.engine,
        "engine_family": str(controller.engine.family),
        "engine_version": controller.engine.version,
        "model": spec.model,
        "endpoint": spec.endpoint,
        "state": str(status.state),
        "fields": controller.fields.describe(controller.engine.version),
        "desired": str(controller.desired),
        "operator_stopped": controller.deployment.operator_stopped,
        "engine_config": {
            "context_length": spec.engine_config.context_length,
            "extra_args": list(spec.engine_config.extra_args),
        },
        "instances": [
            {
                "index": status.index,
                "state": str(status.state),
                "pid": status.pid,
                "port": status.port,
                "uptime_s": round(now - status.ready_at, 1)
                if status.state is InstanceState.READY and status.ready_at
                else None,
                "started_at": status.started_at if running else None,
                "restarts": status.restarts,
                "last_error": status.last_error,
                "log": status.log_path,
                "unsettled": controller.settlement.ledger.counts(),
            }
        ],
    }


# Handler parameters for services: Litestar must not try to validate them as data.
FleetDep = Annotated[Fleet, Dependency(skip_validation=True)]
ClockDep = Annotated[Clock, Dependency(skip_validation=True)]
