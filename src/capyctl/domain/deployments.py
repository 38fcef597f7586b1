"""Deployments: what an operator asked for, and the states an instance moves through.

A deployment is the operator's YAML (``DeploymentSpec``, decoded strictly) plus
one sticky flag: whether an operator stopped it. Its instances are the engine
processes serving it. The legal state changes are one table, ``TRANSITIONS``;
the controllers ask ``check_transition`` before it moves an instance.
"""

from __future__ import annotations

import enum
import re
from typing import Literal

import msgspec

from capyctl.domain.errors import InvalidConfig
from capyctl.domain.memory import Residency
from capyctl.domain.units import Duration, Size, SizeOrZero, seconds, size
from capyctl.domain.units import parse_duration as parse_duration  # re-exported: the CLI parses flags with it

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # whole names only: fullmatch


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base of everything CapyCTL owns: an unknown key is an error, never ignored.

    A typo in a deployment file (``contxt_length``) must be refused with its
    name, or the operator believes a setting that nothing applies.
    """


class EngineConfig(Strict, frozen=True):
    context_length: int | None = None
    extra_args: list[str] = []
    env: dict[str, str] = {}  # extra environment variables for the engine process


class Resources(Strict, frozen=True):
    """What the deployment holds on its device (LIFE-3); without ``memory`` it is not accounted."""

    memory: Size | None = None  # awake footprint: weights, KV cache, the engine's own
    parked_memory: SizeOrZero | None = None  # what stays on the device while parked (host_backed, deep)
    device: str | None = None  # one of the server's memory.devices; default: the only one

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory is None else size(self.memory, "resources.memory")

    @property
    def parked_bytes(self) -> int:
        return 0 if self.parked_memory is None else size(self.parked_memory, "resources.parked_memory", zero=True)


class IdleConfig(Strict, frozen=True):
    """Idle timers for this deployment; each unset key takes the server's (LIFE-5)."""

    park_after: Duration | None = None
    stop_after: Duration | None = None


class Placement(Strict, frozen=True):
    """Where a deployment's instances may run and how they are spread (several instances, several machines).

    ``hosts``: the hosts allowed (empty: any that has the engine); ``devices``: the device names allowed on
    each machine (empty: any); ``spread`` puts each new instance where the deployment has the fewest, ``pack``
    fills a machine before the next; ``max_per_host`` caps the instances on one machine."""

    hosts: list[str] = []
    devices: list[str] = []
    strategy: Literal["spread", "pack"] = "spread"
    max_per_host: int | None = None


MAX_INSTANCES = 64  # instances of one deployment


ENGINE_FAMILIES = ("vllm", "sglang", "llamacpp", "tensorfold")
URL_PATTERN = re.compile(r"^https?://[^/\s:]+(:\d{1,5})?(/[^\s]*)?$")


class DeploymentSpec(Strict, frozen=True):
    """A deployment file.

    Managed (the usual case): ``engine`` names a registered engine and
    ``model`` is what it loads; CapyCTL starts and stops the engine.
    Attached: ``endpoint`` is the URL of an engine running outside CapyCTL,
    ``engine`` its family, ``model`` the name that engine serves (default:
    the deployment's name) and ``engine_version`` its version when the engine
    does not tell it. CapyCTL routes, verifies and relays, but never starts
    or stops an attached engine.
    """

    name: str
    engine: str
    model: str | None = None
    api: Literal["chat", "decisions"] = "chat"
    endpoint: str | None = None
    engine_version: str | None = None
    engine_config: EngineConfig = EngineConfig()
    notes: str | None = None  # an operator's free text, shown in GET /v1/models (MOD-2)
    residency: Residency = Residency.RESTART_ONLY  # how it parks (LIFE-2)
    resources: Resources = Resources()
    idle: IdleConfig = IdleConfig()
    host: str | None = None  # the host whose engine runs it (several machines); None: the server places it
    instances: int = 1  # engines serving it, each placed apart (``placement``)
    placement: Placement = Placement()

    def __post_init__(self) -> None:
        if not NAME_PATTERN.fullmatch(self.name):
            raise InvalidConfig(
                f"deployment name {self.name!r} is not valid: use 1-64 letters, digits, '.', '_' "
                "or '-', starting with a letter or digit"
            )
        if self.engine_config.context_length is not None and self.engine_config.context_length <= 0:
            raise InvalidConfig("engine_config.context_length must be a positive number of tokens")
        memory, parked = self.resources.memory_bytes, self.resources.parked_bytes  # refuses a bad size
        if parked and self.residency is Residency.RESTART_ONLY:
            raise InvalidConfig(
                "resources.parked_memory applies to a residency that parks (host_backed or deep); "
                "restart_only parks by stopping, which leaves nothing on the device"
            )
        if parked and (memory is None or parked > memory):
            raise InvalidConfig("resources.parked_memory must be at most resources.memory")
        for key, value in (("idle.park_after", self.idle.park_after), ("idle.stop_after", self.idle.stop_after)):
            if value is not None:
                seconds(value, key)
        if self.host is not None and not NAME_PATTERN.fullmatch(self.host):
            raise InvalidConfig(f"host {self.host!r} is not a host's name (see: capyctl list hosts)")
        self._check_placement()
        if self.endpoint is None:
            if not self.model:
                raise InvalidConfig("model is required: the model file or directory the engine loads")
            if self.engine_version is not None:
                raise InvalidConfig("engine_version is only for attached deployments (with endpoint)")
            return
        if not URL_PATTERN.match(self.endpoint):
            raise InvalidConfig(f"endpoint {self.endpoint!r} is not an http(s)://host[:port] URL")
        if self.engine not in ENGINE_FAMILIES:
            raise InvalidConfig(f"with endpoint, engine names the engine's family: one of {', '.join(ENGINE_FAMILIES)}")
        if self.host is not None:
            raise InvalidConfig("host does not apply to an attached engine: its endpoint says where it runs")
        if self.instances != 1 or self.placement != Placement():
            raise InvalidConfig(
                "instances and placement do not apply to an attached engine: CapyCTL runs no engine for it; "
                "deploy each running engine as its own attached deployment"
            )
        if self.engine_config != EngineConfig():
            raise InvalidConfig("engine_config does not apply to an attached engine: CapyCTL does not start it")
        if self.residency is not Residency.RESTART_ONLY or self.resources != Resources() or self.idle != IdleConfig():
            raise InvalidConfig(
                "residency, resources and idle do not apply to an attached engine: "
                "CapyCTL neither starts, parks nor stops it"
            )

    def _check_placement(self) -> None:
        if not 1 <= self.instances <= MAX_INSTANCES:
            raise InvalidConfig(f"instances must be a whole number from 1 to {MAX_INSTANCES} (it is {self.instances})")
        placement = self.placement
        if placement.max_per_host is not None and placement.max_per_host < 1:
            raise InvalidConfig("placement.max_per_host must be at least 1 (leave it out for no limit)")
        for host in placement.hosts:
            if not NAME_PATTERN.fullmatch(host):
                raise InvalidConfig(f"placement.hosts: {host!r} is not a host's name (see: capyctl list hosts)")
        for key, names in (("placement.hosts", placement.hosts), ("placement.devices", placement.devices)):
            if len(set(names)) != len(names):
                raise InvalidConfig(f"{key} names the same entry twice")
        if self.host is not None and placement.hosts:
            raise InvalidConfig("host and placement.hosts both say where it runs: keep one (placement.hosts: [NAME])")
        if self.resources.device is not None and placement.devices:
            raise InvalidConfig(
                "resources.device and placement.devices both name devices: keep one (placement.devices: [NAME])"
            )

    @property
    def attached(self) -> bool:
        return self.endpoint is not None

    @property
    def allowed_hosts(self) -> list[str]:
        """The hosts its instances may run on (``host`` or ``placement.hosts``); empty: any."""
        return [self.host] if self.host is not None else list(self.placement.hosts)

    @property
    def allowed_devices(self) -> list[str]:
        """The devices its instances may use on a machine (``resources.device`` or ``placement.devices``)."""
        return [self.resources.device] if self.resources.device is not None else list(self.placement.devices)

    @property
    def served_model(self) -> str:
        """The model name CapyCTL sends to the engine."""
        return (self.model or self.name) if self.attached else self.name


def check_extra_args(extra_args: list[str], owned: dict[str, str]) -> None:
    """Refuse engine options CapyCTL sets itself (``owned`` maps flag -> what it controls)."""
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag in owned:
            raise InvalidConfig(
                f"engine_config.extra_args: {flag} is set by CapyCTL ({owned[flag]}) and cannot be "
                "overridden; remove it from the deployment file"
            )


def check_env(env: dict[str, str], owned: tuple[str, ...]) -> None:
    """Refuse engine environment variables CapyCTL controls (a name ending in '_' is a prefix)."""
    for name in env:
        for mine in owned:
            if name == mine or (mine.endswith("_") and name.startswith(mine)):
                raise InvalidConfig(
                    f"engine_config.env: {name} is controlled by CapyCTL for this engine and cannot be set; "
                    "remove it from the deployment file"
                )


FIRST_INSTANCE = 0  # the index of a deployment's first instance


def instance_id(deployment: str, index: int) -> str:
    """How a host and the logs name instance ``index`` of ``deployment``: the deployment's name for its first
    (as before a deployment had several), ``<deployment>/<index>`` for the others."""
    return deployment if index == FIRST_INSTANCE else f"{deployment}/{index}"


class InstanceState(enum.StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"
    UNAVAILABLE = "unavailable"  # an attached engine that does not answer
    PARKING = "parking"  # drained; the engine is letting go of its device memory
    PARKED = "parked"  # the engine sleeps, holding only its parked footprint (LIFE-2)
    WAKING = "waking"  # the engine is taking its memory back


S = InstanceState
# One table for managed and attached instances. A managed engine moves STOPPED -> STARTING -> READY and
# back through STOPPING; an attached one is only watched: UNAVAILABLE <-> READY, and STOPPED while an
# operator's stop holds (CapyCTL stops routing to it, the engine itself runs on).
TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    S.STOPPED: frozenset({S.STARTING, S.UNAVAILABLE}),
    S.STARTING: frozenset({S.READY, S.STOPPING, S.FAILED, S.STARTING}),
    # READY -> STARTING: a crash, and the restart; -> UNAVAILABLE, STOPPED: attached engines
    S.READY: frozenset({S.STOPPING, S.STARTING, S.UNAVAILABLE, S.STOPPED, S.PARKING}),
    S.STOPPING: frozenset({S.STOPPED}),
    S.FAILED: frozenset({S.STARTING, S.STOPPED}),
    S.UNAVAILABLE: frozenset({S.READY, S.STOPPED}),
    S.PARKING: frozenset({S.PARKED, S.READY, S.STOPPING, S.STARTING}),  # READY: the engine refused to sleep
    S.PARKED: frozenset({S.WAKING, S.STOPPING, S.STARTING}),
    S.WAKING: frozenset({S.READY, S.STOPPING, S.STARTING}),
}


def check_transition(current: InstanceState, new: InstanceState) -> None:
    if new not in TRANSITIONS[current]:
        raise ValueError(f"illegal instance transition {current} -> {new}")


class Desired(enum.StrEnum):
    """What a deployment's controller is asked to bring about; commands change it, the controller acts."""

    RUN = "run"  # keep an engine serving: an operator's start, or a request for the model
    ON_DEMAND = "on_demand"  # nothing runs until a request asks for the model
    PARK = "park"  # keep the engine asleep until a request (or an operator's start) wakes it
    STOP = "stop"  # an operator's stop: sticky, only an operator's start undoes it


class Step(enum.StrEnum):
    LAUNCH = "launch"  # start an engine (after the backoff its failures call for)
    FAIL = "fail"  # the start budget is spent: FAILED, with the last error, until an operator starts it
    SETTLE = "settle"  # no engine should run and none does: show STOPPED
    REST = "rest"  # nothing to do until a command or the engine changes something


def next_step(desired: Desired, state: InstanceState, failures: int, budget: int) -> Step:
    """The controller's decision for a managed deployment with no engine process running.

    ``failures`` counts launches in a row that never became ready (or crashed
    soon after); ``budget`` is how many of them end in FAILED. With no engine
    running, a deployment that should park is simply stopped: the next request
    starts it. (Parking and waking a running engine are the watcher's.)
    """
    if desired is not Desired.RUN:
        return Step.REST if state is S.STOPPED else Step.SETTLE
    if failures >= budget:
        return Step.REST if state is S.FAILED else Step.FAIL
    return Step.LAUNCH


class InstancePlace(msgspec.Struct, frozen=True, kw_only=True):
    """Where one instance runs: its machine (a host's name; None: the server's own) and its device there
    (by its name on that machine; None: not accounted, or the machine's only one)."""

    index: int
    host: str | None = None
    device: str | None = None


class Deployment(msgspec.Struct, kw_only=True):
    spec: DeploymentSpec
    operator_stopped: bool = False
    probed_version: str | None = None  # what an attached engine said its version was
    cold_starts: list[float] = []  # measured seconds from spawn to ready, the last 20 (MOD-2, Retry-After)
    wake_times: list[float] = []  # measured seconds from a wake's start to ready, the last 20
    placed_on: str | None = None  # (records written before instances: the host its one instance ran on)
    places: list[InstancePlace] = []  # where each placed instance runs, by index

    def place_of(self, index: int) -> InstancePlace:
        """Where instance ``index`` runs (an instance not placed yet: where the file says, or this machine)."""
        for place in self.places:
            if place.index == index:
                return place
        host = self.spec.host or (self.placed_on if index == FIRST_INSTANCE else None)
        return InstancePlace(index=index, host=host, device=self.spec.resources.device)

    @property
    def host(self) -> str | None:
        """The host whose engine runs its first instance; None: this machine."""
        return self.place_of(FIRST_INSTANCE).host


def restart_delay(consecutive_failures: int, base: float = 0.5, ceiling: float = 30.0) -> float:
    """Backoff before restarting a crashed engine: 0.5 s, 1 s, 2 s ... at most 30 s."""
    return min(ceiling, base * 2.0 ** max(0, consecutive_failures - 1))


# Citadel's model states (GET /v1/models), from CapyCTL's own.
LISTED_STATE = {
    "ready": "loaded",
    "starting": "starting",
    "stopping": "stopped",
    "stopped": "stopped",
    "failed": "unavailable",
    "unavailable": "unavailable",
    "parking": "stopped",
    "parked": "stopped",
    "waking": "starting",
}
_SLOT_FLAGS = {"llamacpp": ("--parallel", "-np"), "vllm": ("--max-num-seqs",), "sglang": ("--max-running-requests",)}


def engine_slots(family: str, extra_args: list[str]) -> int | None:
    """The engine's request slots when the deployment sets them (llama.cpp --parallel ...), else None."""
    flags = _SLOT_FLAGS.get(family, ())
    for i, arg in enumerate(extra_args):
        name, _, value = arg.partition("=")
        if name in flags:
            value = value or (extra_args[i + 1] if i + 1 < len(extra_args) else "")
            return int(value) if value.isdigit() else None
    return None
