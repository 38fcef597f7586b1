"""The server configuration file: what ``capyctl start standalone --config FILE`` reads.

Strict, like every file CapyCTL owns: an unknown or duplicate key is an
error naming the key and its line. Durations are written ``90s``, ``10m``,
``1h`` (or a bare number of seconds), sizes ``512MiB``, ``6GiB`` (or a bare
number of bytes); each is more than zero except a device's ``reserve`` and
``switching.admission_window``, which may be zero. The same structs give the JSON Schema for editors
(``capyctl config schema``). ``resolve`` turns a file into the settings the
server runs with; command-line flags given explicitly win over the file.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from capyctl.domain.deployments import Strict
from capyctl.domain.errors import InvalidConfig
from capyctl.domain.hosts import LinkTimings
from capyctl.domain.limits import Limits
from capyctl.domain.memory import Device, Idle
from capyctl.domain.request_rows import RecordSettings, Retention
from capyctl.domain.scheduling import QueueLimits
from capyctl.domain.units import Duration, DurationOrZero, Size, SizeOrZero, seconds, size

Count = Annotated[int, msgspec.Meta(gt=0)]
Limit = Annotated[int, msgspec.Meta(ge=0)]


class QueueConfig(Strict, frozen=True):
    """How long a request may take (LIFE-5, CAN-1)."""

    request_deadline: Duration = "30m"
    stream_idle_timeout: Duration = "120s"
    max_in_flight_per_instance: Count = 32  # requests at an engine instance at once; more wait in order
    max_pending_per_deployment: Limit = 64  # waiting per deployment; past it 429 queue_full; 0: never wait
    max_pending_total: Limit = 256  # waiting over all deployments
    max_open: Limit = 0  # open engine calls over all deployments (503 device_busy); 0: no limit


class LimitsConfig(Strict, frozen=True):
    """What one client or one engine may take (docs/errors.md, "Limits")."""

    max_body: Size = "32MiB"
    client_header_timeout: Duration = "10s"
    client_body_timeout: Duration = "60s"
    max_connections: Count = 4096
    max_event_size: Size = "4MiB"
    max_tool_calls: Count = 256


class DeviceConfig(Strict, frozen=True):
    """One GPU (or other accelerator) whose memory CapyCTL hands out to deployments."""

    name: str
    capacity: Size
    reserve: SizeOrZero | None = None  # kept free for the driver and other programs


class MemoryConfig(Strict, frozen=True):
    """The devices deployments are charged against (LIFE-3). Empty: no memory limit applies."""

    devices: list[DeviceConfig] | Literal["auto"] = []  # "auto": read the GPUs at start


class SwitchingConfig(Strict, frozen=True):
    """How a model that holds the room gives it up to one that needs it (LIFE-5)."""

    admission_window: DurationOrZero = "2s"  # a victim still admits its own traffic this long, then drains
    drain_timeout: Duration = "30s"  # past it the switch fails and the victim keeps serving


class IdleConfig(Strict, frozen=True):
    """Idle timers for every deployment that does not set its own; both off by default."""

    park_after: Duration | None = None
    stop_after: Duration | None = None


class RecordsConfig(Strict, frozen=True):
    """The request records (docs/observability.md, "Request records"): how many are kept, for how long."""

    max_count: Count = 100_000  # rows kept at most; the oldest go first
    max_age: Duration = "168h"  # a row older than this is deleted (7 days)
    buffer: Count = 10_000  # rows waiting to be written at most; past it a row is dropped and counted


class HostsConfig(Strict, frozen=True):
    """Several machines: when a silent host stops taking requests, and when it is counted lost."""

    suspend_after: Duration = "5s"  # no heartbeat for this long: suspended (takes no new request)
    lost_after: Duration = "30s"  # no heartbeat for this long: lost (its charges stay until it proves what runs)
    replace_after: DurationOrZero = "5m"  # lost this long: its instances are placed elsewhere (0s: never)


class ServerConfig(Strict, frozen=True):
    """The whole file. Every key is optional; an empty file is the defaults."""

    default_model: str | None = None  # MOD-3: the deployment a chat request without `model` goes to
    queue: QueueConfig = QueueConfig()
    limits: LimitsConfig = LimitsConfig()
    memory: MemoryConfig = MemoryConfig()
    switching: SwitchingConfig = SwitchingConfig()
    idle: IdleConfig = IdleConfig()
    records: RecordsConfig = RecordsConfig()
    hosts: HostsConfig = HostsConfig()


class Switching(msgspec.Struct, frozen=True, kw_only=True):
    admission_window: float = 2.0
    drain_timeout: float = 30.0


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """What the server runs with, in seconds and bytes."""

    default_model: str | None
    request_deadline: float
    stream_idle_timeout: float
    limits: Limits
    queue: QueueLimits
    devices: tuple[Device, ...] | Literal["auto"] = ()
    switching: Switching = Switching()
    idle: Idle = Idle()
    records: RecordSettings = RecordSettings()
    hosts: LinkTimings = LinkTimings()


def resolve(config: ServerConfig, overrides: dict[str, Any]) -> Settings:
    """The file's values with the command line's ``overrides`` (keys as in the file, dotted) on top."""
    q, lim = config.queue, config.limits

    def pick(key: str, value: Any) -> Any:
        return overrides[key] if overrides.get(key) is not None else value

    return Settings(
        default_model=pick("default_model", config.default_model),
        request_deadline=seconds(pick("queue.request_deadline", q.request_deadline), "queue.request_deadline"),
        stream_idle_timeout=seconds(
            pick("queue.stream_idle_timeout", q.stream_idle_timeout), "queue.stream_idle_timeout"
        ),
        limits=Limits(
            max_body=size(pick("limits.max_body", lim.max_body), "limits.max_body"),
            header_timeout=seconds(
                pick("limits.client_header_timeout", lim.client_header_timeout), "limits.client_header_timeout"
            ),
            body_timeout=seconds(
                pick("limits.client_body_timeout", lim.client_body_timeout), "limits.client_body_timeout"
            ),
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
        devices=devices(config.memory.devices),
        switching=Switching(
            admission_window=seconds(config.switching.admission_window, "switching.admission_window", zero=True),
            drain_timeout=seconds(config.switching.drain_timeout, "switching.drain_timeout"),
        ),
        idle=Idle(
            park_after=None if config.idle.park_after is None else seconds(config.idle.park_after, "idle.park_after"),
            stop_after=None if config.idle.stop_after is None else seconds(config.idle.stop_after, "idle.stop_after"),
        ),
        records=RecordSettings(
            retention=Retention(
                max_count=config.records.max_count, max_age=seconds(config.records.max_age, "records.max_age")
            ),
            buffer=config.records.buffer,
        ),
        hosts=LinkTimings(
            suspend_after=seconds(config.hosts.suspend_after, "hosts.suspend_after"),
            lost_after=seconds(config.hosts.lost_after, "hosts.lost_after"),
            replace_after=seconds(config.hosts.replace_after, "hosts.replace_after", zero=True),
        ),
    )


def devices(declared: list[DeviceConfig] | Literal["auto"]) -> tuple[Device, ...] | Literal["auto"]:
    if declared == "auto":
        return "auto"
    out = []
    for i, d in enumerate(declared):
        where = f"memory.devices[{i}]"
        device = Device(
            name=d.name,
            capacity=size(d.capacity, f"{where}.capacity"),
            reserve=0 if d.reserve is None else size(d.reserve, f"{where}.reserve", zero=True),
        )
        if device.reserve >= device.capacity:
            raise InvalidConfig(f"{where}.reserve must be smaller than its capacity")
        out.append(device)
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise InvalidConfig(f"memory.devices: each device needs its own name ({', '.join(names)})")
    return tuple(out)


def schema() -> dict[str, Any]:
    """JSON Schema of the file, for editors (``capyctl config schema``)."""
    out = msgspec.json.schema(ServerConfig)
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["title"] = "CapyCTL server configuration"
    return out
