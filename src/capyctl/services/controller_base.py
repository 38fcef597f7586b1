"""What both kinds of controller share: what the chat path may ask (``Serving``), the instance's status, and
the base that holds the deployment, its engine and its settlement."""

from __future__ import annotations

from typing import Protocol

import msgspec

from capyctl.domain.balancing import Sample
from capyctl.domain.deployments import (
    FIRST_INSTANCE,
    Deployment,
    DeploymentSpec,
    Desired,
    InstancePlace,
    InstanceState,
    check_transition,
    instance_id,
)
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import CapyError, EngineUnavailable
from capyctl.domain.fields import RowChoice
from capyctl.domain.ports import Clock, EngineAdapter, EngineLoad
from capyctl.domain.requests import RequestRecord
from capyctl.domain.scheduling import Loading, Route
from capyctl.services.events import Events
from capyctl.services.settling import Settlement
from capyctl.services.switching import Occupant

S = InstanceState


class Serving(Protocol):
    """What the chat path may ask of a deployment's controller."""

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> DeploymentSpec: ...
    @property
    def engine(self) -> EngineInstall: ...
    @property
    def fields(self) -> RowChoice: ...
    @property
    def ready(self) -> bool: ...
    @property
    def host(self) -> str | None:
        """The host its engine runs on (several machines); None: this machine."""

    @property
    def index(self) -> int:
        """Which instance of its deployment it runs (``FIRST_INSTANCE`` for the first)."""

    in_flight: int  # the requests CapyCTL has at this instance now (the router counts them)
    left: int  # how many of them have left it so far: what a load sample counted and has ended since
    sample: Sample | None  # the engine's latest load sample, None when none stands
    draining: bool  # it takes no new request (it is being removed)

    def ask(self) -> None:
        """A request wants the model: start it unless it runs, an operator's stop holds, or it FAILED."""

    async def route(self, timeout: float) -> Route:
        """Wait until the engine is ready (asking for it); raises DeploymentStopped, LlmUnavailable,
        EngineUnavailable or DeadlineExceeded."""

    def route_now(self) -> Route | None:
        """The engine's route while it is ready (what ``route`` returns at once then); None otherwise."""

    async def lost(self, route: Route, notice: float, broke: EngineUnavailable) -> CapyError | None:
        """After a broken engine connection (``broke``): the error that says why, when the engine of ``route``
        is gone (waiting up to ``notice`` seconds to see it exit) or its machine is out of reach (a host's:
        at once when ``broke`` says so); None while it still runs and can be reached."""

    def loading(self) -> Loading: ...

    def cut(self, record: RequestRecord) -> None:
        """A request sent to this deployment's engine was cut: it stays counted until settled."""

    def held(self) -> CapyError | None:
        """Why the engine that runs cannot be reached now (its host is not online); None when it can."""


class Room(Protocol):
    """Where a managed controller asks for room on its device before each launch (``Switchboard``)."""

    async def claim(self, occupant: Occupant) -> None: ...


class ControllerSettings(msgspec.Struct, kw_only=True, frozen=True):
    startup_timeout: float = 600.0
    stop_grace: float = 10.0
    poll_interval: float = 0.05
    ready_poll: float = 0.01  # seconds between readiness checks of a starting engine (a waiting request pays it)
    max_start_failures: int = 5  # launches in a row that failed to start, or crashed soon after, before FAILED
    stable_after: float = 60.0  # seconds ready after which a crash no longer counts as a failed start


class InstanceStatus(msgspec.Struct, kw_only=True):
    index: int = FIRST_INSTANCE
    state: InstanceState = S.STOPPED
    pid: int | None = None
    port: int | None = None  # the engine's, on its machine's loopback
    ingress_port: int | None = None  # on a host: its ingress's, where the server reaches the engine
    started_at: float | None = None
    ready_at: float | None = None
    restarts: int = 0
    last_error: str | None = None
    log_path: str | None = None
    cold_starts: list[float] = msgspec.field(default_factory=list)  # seconds from spawn to ready, last 20
    wake_times: list[float] = msgspec.field(default_factory=list)  # seconds from a wake's start to ready, last 20


def initial_desire(deployment: Deployment) -> Desired:
    return Desired.STOP if deployment.operator_stopped else Desired.ON_DEMAND


def move(status: InstanceStatus, state: InstanceState, name: str, clock: Clock, events: Events) -> None:
    """Move an instance along the transition table, and say so."""
    check_transition(status.state, state)
    previous, status.state = status.state, state
    if state is S.READY:
        status.ready_at = clock.wall()
    events.emit(name, "state_changed", instance=status.index, previous=str(previous), state=str(state))


class ControllerBase:
    """The deployment, its engine and the settlement of its cut requests; each kind keeps its own state."""

    def __init__(
        self,
        deployment: Deployment,
        engine: EngineInstall,
        adapter: EngineAdapter,
        clock: Clock,
        events: Events,
        fields: RowChoice,
        index: int = FIRST_INSTANCE,
    ) -> None:
        self.deployment = deployment
        self.engine = engine
        self.adapter = adapter
        self.fields = fields
        self.index = index  # which instance of its deployment it runs
        self.place: InstancePlace = deployment.place_of(index)
        self.in_flight = 0  # requests at this instance now, counted by the router
        self.left = 0  # requests that have left this instance, all told
        self.draining = False  # takes no new request (it is being removed)
        self.sample: Sample | None = None  # the engine's latest load sample (the fleet's sampler takes them)
        self._clock = clock
        self._events = events
        self.settlement = Settlement(self.name, index, self.read_load, clock, events)

    @property
    def name(self) -> str:
        return self.deployment.spec.name

    @property
    def spec(self) -> DeploymentSpec:
        return self.deployment.spec

    @property
    def base_url(self) -> str:
        raise NotImplementedError

    @property
    def status(self) -> InstanceStatus:
        raise NotImplementedError

    @property
    def desired(self) -> Desired:
        raise NotImplementedError

    @property
    def host(self) -> str | None:
        return self.place.host

    @property
    def device(self) -> str | None:
        """The device it was placed on, by its name on its machine; None: the only one, or not accounted."""
        return self.place.device

    @property
    def holder(self) -> str:
        """The instance's own name (``instance_id``): what its device's charges and its host know it by."""
        return instance_id(self.name, self.index)

    @property
    def ended_by(self) -> str | None:
        """Why the latest engine ended, when that was not its own doing (its host's agent stopped ...); None
        after a crash, or while it runs."""
        return None

    def held(self) -> CapyError | None:
        """Why the engine that runs cannot be reached now (its host is not online): it is held, neither serving
        nor released; None when it can be reached, or none runs."""
        return None

    async def read_load(self) -> EngineLoad | None:
        """The engine's running and waiting counts, as its adapter reads them (what settles cut requests)."""
        return await self.adapter.load(self.base_url)

    @property
    def ready(self) -> bool:
        return self.status.state is S.READY

    def cut(self, record: RequestRecord) -> None:
        self.settlement.cut(record)
