"""Ports: what the domain and services ask of the outside world.

Each is a ``typing.Protocol`` named for its role. Adapters implement them
with real technology; tests use fakes with observable state.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from capyctl.domain.deployments import Deployment, DeploymentSpec
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import CapyError
from capyctl.domain.hosts import HostRecord
from capyctl.domain.joining import Invite
from capyctl.domain.keys import ApiKey
from capyctl.domain.lifecycle import EngineAddress, Launched
from capyctl.domain.memory import Residency
from capyctl.domain.request_rows import Entry, RequestRow, Retention, RowFilter
from capyctl.domain.streams import Relayed, StreamEvent


class EngineLoad(NamedTuple):
    """What an engine says of its load: requests running and waiting, and the share of its KV cache in use
    (0..1; None where it does not say)."""

    running: int
    waiting: int
    kv_usage: float | None = None


class Clock(Protocol):
    def wall(self) -> float:
        """Seconds since the Unix epoch."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; for durations only."""


class Store(Protocol):
    """Durable state: engines, deployments, events. Calls are short and blocking."""

    def put_engine(self, engine: EngineInstall) -> None: ...
    def get_engine(self, name: str) -> EngineInstall | None: ...
    def list_engines(self) -> list[EngineInstall]: ...
    def delete_engine(self, name: str) -> None: ...
    def put_deployment(self, deployment: Deployment) -> None: ...
    def get_deployment(self, name: str) -> Deployment | None: ...
    def list_deployments(self) -> list[Deployment]: ...
    def delete_deployment(self, name: str) -> None: ...
    def add_event(self, at: float, deployment: str | None, kind: str, detail: dict[str, Any]) -> None: ...
    def list_events(self, deployment: str | None, after_id: int, limit: int) -> list[dict[str, Any]]: ...


class KeyStore(Protocol):
    """Durable API keys (as digests) and their daily counts. Calls are short and blocking, except
    ``note_key_use``, which only queues the newest figures of a key for writing."""

    def list_keys(self) -> list[tuple[ApiKey, float | None]]: ...
    def add_key(self, key: ApiKey) -> None: ...
    def delete_key(self, key_id: str) -> None: ...
    def key_usage(self, day: str) -> dict[str, int]: ...
    def note_key_use(self, key_id: str, day: str, used: int, last_used: float | None) -> None: ...
    def get_meta(self, name: str) -> str | None: ...
    def set_meta(self, name: str, value: str) -> None: ...


class RequestStore(Protocol):
    """Durable request records (``domain/request_rows``). Every call is blocking and may be slow or raise
    (a full disk): CapyCTL calls them from a worker thread, never on a request's path."""

    def add_requests(self, entries: list[Entry]) -> None:
        """Write rows and settlements in one go, in order (a settlement updates a row written before it)."""

    def prune_requests(self, retention: Retention, now: float) -> None:
        """Delete what ``retention`` no longer keeps at wall time ``now``."""

    def list_requests(self, where: RowFilter) -> list[RequestRow]:
        """The rows ``where`` picks, newest first."""

    def get_request(self, request_id: str) -> RequestRow | None: ...


class HostStore(Protocol):
    """Where the server keeps its hosts (their certificates' fingerprints, revocations) and invitations
    (hashes of their secrets only)."""

    def put_host(self, host: HostRecord) -> None: ...
    def list_hosts(self) -> list[HostRecord]: ...
    def put_invite(self, invite: Invite) -> None: ...
    def get_invite(self, secret_hash: str) -> Invite | None: ...
    def prune_invites(self, before: float) -> None: ...


class ProcessHandle(Protocol):
    pid: int

    def returncode(self) -> int | None:
        """The exit status, or None while the process runs. Never blocks."""

    async def terminate(self, grace: float) -> int:
        """SIGTERM the whole process group, SIGKILL it after ``grace`` seconds; returns the status.

        Safe to call on a process that already exited, and under cancellation
        (the caller shields it).
        """


class ProcessControl(Protocol):
    async def spawn(self, argv: Sequence[str], log_path: Path, env: dict[str, str | None] | None) -> ProcessHandle:
        """Start ``argv`` in its own process group, its output appended to ``log_path``.

        The child gets CapyCTL's environment changed by ``env`` (None removes a variable).
        """


class EngineAdapter(Protocol):
    """What CapyCTL knows about one engine family."""

    family: EngineFamily
    owned_options: dict[str, str]  # flag -> what CapyCTL controls with it
    owned_env: tuple[str, ...]  # environment variables CapyCTL controls; a trailing "_" makes a prefix

    def recognises(self, path: Path) -> bool:
        """True when ``path`` is an installation of this family (cheap, no process started)."""

    def probe(self, path: Path) -> tuple[str, str]:
        """Return (version, the installation's own version text); raise InvalidEngine."""

    def command(self, engine: EngineInstall, spec: DeploymentSpec, port: int) -> list[str]:
        """The engine's command line, CapyCTL's forced flags included."""

    def environment(self, engine: EngineInstall, spec: DeploymentSpec) -> dict[str, str | None]:
        """Environment changes for the engine process: a value sets a variable, None removes it."""

    async def probe_version(self, base_url: str) -> str | None:
        """The version a running engine reports about itself (attached engines), None if it does not tell."""

    async def ready(self, base_url: str) -> bool:
        """True once the engine answers requests; False while it loads. Never raises for I/O."""

    async def load(self, base_url: str) -> EngineLoad | None:
        """Running and waiting requests (and the KV cache's use, where it says) as the engine reports them,
        None if unreadable."""

    def serves_decisions(self, engine: EngineInstall) -> bool:
        """True when this installation answers ``POST /v1/systemone`` (no process started)."""

    async def park(self, base_url: str, residency: Residency) -> None:
        """Free the device memory the engine's residency lets go (after CapyCTL drained it); raises
        ``EngineError`` or ``EngineUnavailable`` when the engine refuses or cannot be reached."""

    async def wake(self, base_url: str, residency: Residency, model: str) -> None:
        """Undo ``park``: the engine answers as before it parked once this returns."""

    async def parked(self, base_url: str) -> bool | None:
        """The engine's own word on whether it sleeps; None when it has no way to tell."""


class EngineEffects(Protocol):
    """What a managed deployment's controller does to its engines: everything that touches a process or the
    engine itself, wherever the engine runs (a child process here; a later host agent's engine elsewhere).

    One object per deployment, which knows the deployment's spec and engine. The controller decides; this
    only acts and reports, and never changes the controller's state. Each call but ``launch`` names the
    launch it acts on. Every call may be cancelled; ``stop`` is called shielded and must end the engine even
    so. Park and wake raise ``EngineError`` or ``EngineUnavailable`` when the engine refuses or cannot be
    reached; the others raise only for a fault of their own (a launch that cannot fork: a failed start).
    """

    async def launch(self, number: int) -> Launched:
        """Start the deployment's engine, its launch ``number``; returns once it was started, not ready."""

    def exited(self, engine: Launched) -> int | None:
        """The engine's exit status once its process is gone; None while it runs. Never blocks."""

    def watch_exits(self, told: Callable[[], None]) -> bool:
        """Asks for ``told()`` each time what ``exited`` answers may have changed (a host told an engine's end,
        linked again, or was revoked). True: the effects tell, so ``exited`` need not be looked at again and
        again; False: an exit is found only by looking (a child process on this machine)."""

    def ended_by(self, engine: Launched) -> str | None:
        """Why an engine that is gone ended, when it was not by itself: ``agent_stopped`` (its host's agent was
        stopped, and stopped its engines), ``host_revoked``, ``not_on_host`` (its host came back without it);
        None for an engine that exited on its own (a crash, a kill) or still runs. Never blocks."""

    async def ready(self, engine: Launched) -> bool:
        """True once the engine answers requests; False while it loads or cannot be reached."""

    async def stop(self, engine: Launched, grace: float) -> int:
        """End the engine (asked first, forced after ``grace`` seconds); returns its exit status once it is
        gone. Safe on an engine that already exited, and more than once."""

    async def park(self, engine: Launched) -> None:
        """Ask the engine to free what its residency lets go (CapyCTL drained it first)."""

    async def wake(self, engine: Launched) -> None:
        """Undo ``park``: the engine answers as before it parked once this returns."""

    async def parked(self, engine: Launched) -> bool | None:
        """The engine's own word on whether it sleeps; None when it has no way to tell."""

    async def canary(self, engine: Launched) -> str | None:
        """The engine's answer to the fixed canary request (``services/canary``); None when none is sent."""

    async def load(self, engine: Launched) -> EngineLoad | None:
        """The engine's running and waiting counts (they settle cut requests) and its KV cache's use, read now;
        None when it cannot tell or cannot be reached."""

    def offline(self) -> CapyError | None:
        """Why the engine's machine cannot be reached now (a host that is not online); None when it can.
        Never blocks: it is asked on each request's way to the engine."""

    @property
    def host(self) -> str | None:
        """The host the engines run on; None: this machine."""

    async def reprove(self) -> None:
        """The engines' host linked again: an engine it kept running while away serves again once it answers
        as ready on the new link (on this machine: nothing to prove)."""

    def leave(self) -> None:
        """The server stops: its engines on a host are left running, for the next server to adopt (on this
        machine: nothing; they end with the server)."""


class EngineAnswer(Protocol):
    async def pump(self, deliver: Callable[[list[StreamEvent]], Relayed], drain: Callable[[], Awaitable[None]]) -> bool:
        """Hand the answer's events to ``deliver`` in batches, one per network read, as each read arrives.

        ``deliver`` says what became of each batch (``Relayed``): MORE, FULL
        (reading pauses until ``drain()`` returns) or ENDED. Returns True once
        ``deliver`` said ENDED, False when the answer ended first; raises what
        ``deliver`` raises, ``EdgeError`` for a broken stream (an event past
        the size limit) and ``EngineUnavailable`` when the connection breaks.
        """


class EngineStream(AbstractAsyncContextManager[EngineAnswer], Protocol):
    def abandon(self) -> None:
        """Give up a stream that will never be entered: a request the session wrote already is cut."""


class EngineSession(Protocol):
    def chat_stream(self, address: EngineAddress, body: bytes) -> EngineStream:
        """POST a streamed chat request to the engine; entering gives its answer (``EngineAnswer``).

        The request may be written at once, when the session holds a kept-alive
        connection to the engine idle (the engine works on it while the caller
        finishes what it does before entering); a stream never entered must be
        given up with ``abandon()``.

        Entering raises ``EngineError`` when the engine refuses the request
        (its status and body are kept) and ``EngineUnavailable`` when it
        cannot be reached. Leaving the context, normally or by cancellation,
        closes the engine connection at once: that is how CapyCTL asks an
        engine to stop work on a request.
        """

    async def decide(self, address: EngineAddress, body: bytes) -> bytes:
        """POST a decision request (``/v1/systemone``); the engine's whole 200 answer.

        Raises ``EngineError`` when the engine refuses it, ``EngineUnavailable``
        when it cannot be reached. A cancellation closes the engine connection.
        """
