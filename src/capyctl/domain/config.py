"""The server configuration file: what ``capyctl start standalone --config FILE`` reads.

Strict, like every file CapyCTL owns: an unknown or duplicate key is an
error naming the key and its line. Durations are written ``90s``, ``10m``,
``1h`` (or a bare number of seconds), sizes ``512MiB``, ``6GiB`` (or a bare
number of bytes). The same structs give the JSON Schema for editors
(``capyctl config schema``). ``resolve`` turns a file into the settings the
server runs with; command-line flags given explicitly win over the file.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from capyctl.domain.deployments import Strict, parse_duration
from capyctl.domain.limits import Limits, parse_size
from capyctl.domain.scheduling import QueueLimits

DURATION_PATTERN = r"^\s*\d+(\.\d+)?\s*(ms|s|m|h)?\s*$"
SIZE_PATTERN = r"^\s*\d+\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$"
Duration = Annotated[str, msgspec.Meta(pattern=DURATION_PATTERN, description="a duration: 90s, 10m, 1h, 250ms")] | Annotated[
    float, msgspec.Meta(gt=0, description="seconds")
]
Size = Annotated[str, msgspec.Meta(pattern=SIZE_PATTERN, description="a size: 64KiB, 4MiB, 6GiB")] | Annotated[
    int, msgspec.Meta(gt=0, description="bytes")
]
Count = Annotated[int, msgspec.Meta(gt=0)]
Limit = Annotated[int, msgspec.Meta(ge=0)]


class QueueConfig(Strict):
    """How long a request may take (LIFE-5, CAN-1)."""

    request_deadline: Duration = "30m"
    stream_idle_timeout: Duration = "120s"
    max_in_flight_per_instance: Count = 32  # requests at an engine instance at once; more wait in order
    max_pending_per_deployment: Limit = 64  # waiting per deployment; past it 429 queue_full; 0: never wait
    max_pending_total: Limit = 256  # waiting over all deployments
    max_open: Limit = 0  # open engine calls over all deployments (503 device_busy); 0: no limit


class LimitsConfig(Strict):
    """What one client or one engine may take (docs/errors.md, "Limits")."""

    max_body: Size = "32MiB"
    client_header_timeout: Duration = "10s"
    client_body_timeout: Duration = "60s"
    max_connections: Count = 4096
    max_event_size: Size = "4MiB"
    max_tool_calls: Count = 256


class ServerConfig(Strict):
    """The whole file. Every key is optional; an empty file is the defaults."""

    default_model: str | None = None  # MOD-3: the deployment a chat request without `model` goes to
    queue: QueueConfig = QueueConfig()
    limits: LimitsConfig = LimitsConfig()


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """What the server runs with, in seconds and bytes."""

    default_model: str | None
    request_deadline: float
    stream_idle_timeout: float
    limits: Limits
    queue: QueueLimits


def seconds(value: str | float, what: str) -> float:
    return float(value) if not isinstance(value, str) else parse_duration(value, what)


def size(value: str | int, what: str) -> int:
    return value if not isinstance(value, str) else parse_size(value, what)


def resolve(config: ServerConfig, overrides: dict[str, Any]) -> Settings:
    """The file's values with the command line's ``overrides`` (keys as in the file, dotted) on top."""
    q, lim = config.queue, config.limits

    def pick(key: str, value: Any) -> Any:
        return overrides[key] if overrides.get(key) is not None else value

    return Settings(
        default_model=pick("default_model", config.default_model),
        request_deadline=seconds(pick("queue.request_deadline", q.request_deadline), "queue.request_deadline"),
        stream_idle_timeout=seconds(pick("queue.stream_idle_timeout", q.stream_idle_timeout),
                                    "queue.stream_idle_timeout"),
        limits=Limits(
            max_body=size(pick("limits.max_body", lim.max_body), "limits.max_body"),
            header_timeout=seconds(pick("limits.client_header_timeout", lim.client_header_timeout),
                                   "limits.client_header_timeout"),
            body_timeout=seconds(pick("limits.client_body_timeout", lim.client_body_timeout),
                                 "limits.client_body_timeout"),
            max_connections=int(pick("limits.max_connections", lim.max_connections)),
            max_event=size(pick("limits.max_event_size", lim.max_event_size), "limits.max_event_size"),
            max_tool_calls=int(pick("limits.max_tool_calls", lim.max_tool_calls)),
        ),
        queue=QueueLimits(
            max_in_flight_per_instance=q.max_in_flight_per_instance,
            max_pending_per_deployment=q.max_pending_per_deployment,
            max_pending_total=q.max_pending_total,
            max_open=q.max_open,
        ),
    )


def schema() -> dict[str, Any]:
    """JSON Schema of the file, for editors (``capyctl config schema``)."""
    out = msgspec.json.schema(ServerConfig)
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["title"] = "CapyCTL server configuration"
    return out
