"""The server's hosts: invitations, joins, the state of each control link, revocation.

What is kept (``HostStore``): each host's record (the fingerprint of the
certificate it joined with, and every fingerprint ever revoked for its name)
and the invitations (the hashes of their secrets, never a secret). What is
live (memory only): whether a host is connected, when it was last heard,
what it said in its hello, inventory and load samples. A host's state is
read from those by ``domain.hosts.link_state``; ``watch`` turns its changes
into events.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import AlreadyExists, CapyError, DeviceOffline, HostAnswerInvalid, HostNotFound, HostRevoked
from capyctl.domain.hosts import HostRecord, HostState, LinkFacts, LinkTimings, link_state, replacement_due
from capyctl.domain.joining import DEFAULT_TTL, Invite, invite_for, redeem, secret_hash
from capyctl.domain.link import (
    Action,
    Command,
    CommandResult,
    Goodbye,
    Hello,
    InstanceLoad,
    Inventory,
    LoadSample,
    Message,
    ProcessExit,
    RunningInstance,
)
from capyctl.domain.memory import Device
from capyctl.domain.ports import Clock, HostStore
from capyctl.services.events import Events

if TYPE_CHECKING:
    from capyctl.services.server_remote_engines import ExitWatcher

WATCH_EVERY = 0.25  # seconds between two looks at the links' states
COMMAND_TIMEOUT = 30.0  # seconds a host has to answer a command


@dataclass
class _Link:
    """A host's live link, as the server sees it."""

    session: int = 0
    connected: bool = False
    address: str | None = None
    last_heard: float | None = None  # monotonic
    last_heard_wall: float | None = None
    hello: Hello | None = None
    inventory: Inventory | None = None
    loads: dict[str, tuple[InstanceLoad, float]] = field(default_factory=dict)  # instance -> its last, heard at
    close: Callable[[str], Awaitable[None]] | None = None  # closes the link, saying why
    send: Callable[[Message], Awaitable[None]] | None = None  # sends a message on the link
    state: HostState | None = None  # as last told in an event
    exits: list[ProcessExit] = field(default_factory=list)
    inventoried: int = 0  # the session whose inventory came (the link is whole from then on)
    leaving: bool = False  # the host said goodbye on this link: it takes nothing new, its last words still count


class HostRegistry:
    def __init__(self, store: HostStore, clock: Clock, events: Events, timings: LinkTimings = LinkTimings()) -> None:
        self._store = store
        self._clock = clock
        self._events = events
        self.timings = timings
        self._records = {record.name: record for record in store.list_hosts()}
        self._links: dict[str, _Link] = {}
        self._since = clock.monotonic()  # a host not heard since the server started is silent from here
        self._sessions = 0
        self._waiting: dict[str, tuple[str, anyio.Event, list[CommandResult]]] = {}  # command ID -> its answer
        self._on_linked: list[Callable[[str, list[RunningInstance]], None]] = []
        self._exit_watchers: dict[str, weakref.WeakSet[ExitWatcher]] = {}  # host -> its engines' effects

    # --- invitations and joins ---------------------------------------------------------------------
    def invite(self, name: str, secret: bytes, ttl: float = DEFAULT_TTL) -> Invite:
        """An invitation for ``name`` (its secret made by the caller); only the secret's hash is kept."""
        now = self._clock.wall()
        invite = invite_for(name, secret, now, ttl)
        self._store.prune_invites(now)
        self._store.put_invite(invite)
        self._events.emit(None, "host_invited", host=name, expires_at=invite.expires_at)
        return invite

    def redeem(self, name: str, secret: bytes) -> None:
        """Spend the invitation ``secret`` belongs to, for host ``name``; ``JoinRefused`` says why not."""
        used = redeem(self._store.get_invite(secret_hash(secret)), name, secret, self._clock.wall())
        self._store.put_invite(used)

    def joined(self, name: str, fingerprint: str) -> None:
        """``name`` joined with the certificate of ``fingerprint``: it replaces any the name had before, and
        that one is refused from now on."""
        old = self._records.get(name)
        revoked = list(old.revoked) if old is not None else []
        if old is not None and old.fingerprint not in revoked:
            revoked.append(old.fingerprint)
        record = HostRecord(
            name=name,
            fingerprint=fingerprint,
            joined_at=self._clock.wall(),
            revoked=revoked,
            engines=old.engines if old is not None else [],
        )
        self._put(record)
        self._events.emit(None, "host_joined", host=name, fingerprint=fingerprint)

    # --- the control link ---------------------------------------------------------------------------
    def admit(self, name: str, fingerprint: str) -> None:
        """Raises ``HostRevoked`` unless ``name``'s current certificate is the one of ``fingerprint``."""
        record = self._records.get(name)
        if record is None or fingerprint in record.revoked:
            raise HostRevoked(name)
        if record.revoked_at is not None or record.fingerprint != fingerprint:
            raise HostRevoked(name)

    def connected(
        self,
        name: str,
        address: str,
        hello: Hello,
        close: Callable[[str], Awaitable[None]],
        send: Callable[[Message], Awaitable[None]] | None = None,
    ) -> tuple[int, Callable[[str], Awaitable[None]] | None]:
        """The host's link is up (its hello read); returns the session, which later calls name, and how to
        close the link this one replaces (None when there was none)."""
        self._sessions += 1
        link = self._links.setdefault(name, _Link())
        replaced = link.close if link.connected else None
        link.session, link.connected, link.address, link.hello, link.close = self._sessions, True, address, hello, close
        link.send, link.leaving = send, False
        self._exit_news(name)  # its hello says what runs there now
        self._heard(link)
        record = self._records.get(name)
        if record is not None and record.linked_at is None:  # its first link since it joined: joined no more
            self._put(msgspec.structs.replace(record, linked_at=self._clock.wall()))
        self._events.emit(None, "host_connected", host=name, address=address, version=hello.version)
        self._tell(name, link)
        return link.session, replaced

    def on_linked(self, told: Callable[[str, list[RunningInstance]], None]) -> None:
        """``told(host, what its hello said runs there)`` each time a host's link comes up, once the host has
        sent its inventory too (its devices known: what runs can be charged there)."""
        self._on_linked.append(told)

    def heard(self, name: str, session: int, message: Message) -> None:
        link = self._links.get(name)
        if link is None or link.session != session:
            return  # a link that was replaced: its late messages change nothing
        self._heard(link)
        if isinstance(message, Inventory):
            link.inventory = message
            if link.inventoried != session and link.hello is not None:  # the link's first: it is up, whole
                link.inventoried = session
                for told in self._on_linked:
                    told(name, link.hello.running)
        elif isinstance(message, LoadSample):
            heard = self._clock.monotonic()
            link.loads = {load.instance: (load, heard) for load in message.loads}
        elif isinstance(message, ProcessExit):
            link.exits.append(message)
            del link.exits[:-64]
            self._exit_news(name)
        elif isinstance(message, CommandResult):
            waiting = self._waiting.get(message.id)
            if waiting is not None and waiting[0] == name:
                waiting[2].append(message)
                waiting[1].set()
        elif isinstance(message, Goodbye):  # its agent is stopping: nothing new goes there from now on
            link.leaving = True
        self._tell(name, link)

    def disconnected(self, name: str, session: int, why: str) -> None:
        link = self._links.get(name)
        if link is None or link.session != session:
            return
        link.connected, link.close, link.send = False, None, None
        for host, done, _ in self._waiting.values():
            if host == name:
                done.set()  # no result: the command's caller answers device_offline
        self._events.emit(None, "host_disconnected", host=name, reason=why)
        self._tell(name, link)  # not online from this instant: a closed link is known at once

    def _put(self, record: HostRecord) -> None:
        self._store.put_host(record)
        self._records[record.name] = record

    def _heard(self, link: _Link) -> None:
        link.last_heard, link.last_heard_wall = self._clock.monotonic(), self._clock.wall()

    # --- commands -----------------------------------------------------------------------------------
    async def command(
        self,
        name: str,
        action: Action,
        args: dict[str, Any],
        instance: str = "",
        generation: int = 0,
        timeout: float = COMMAND_TIMEOUT,
    ) -> CommandResult:
        """``action`` run by host ``name``, its result; ``DeviceOffline`` when the host is not online, its link
        closes first, or it does not answer within ``timeout`` s."""
        state = self.state(name)
        link = self._links.get(name)
        if state != HostState.ONLINE or link is None or link.send is None:
            raise DeviceOffline(name, state.value)
        command = Command(id=uuid.uuid4().hex, generation=generation, instance=instance, action=action, args=args)
        done = anyio.Event()
        answer: list[CommandResult] = []
        self._waiting[command.id] = (name, done, answer)
        try:
            await link.send(command)
            with anyio.move_on_after(timeout):
                await done.wait()
        finally:
            del self._waiting[command.id]
        if not answer:
            raise DeviceOffline(name, self.state(name).value if done.is_set() else "not answering")
        return answer[0]

    async def run(
        self,
        name: str,
        action: Action,
        args: dict[str, Any],
        instance: str = "",
        generation: int = 0,
        timeout: float = COMMAND_TIMEOUT,
    ) -> dict[str, Any]:
        """``command``, and the detail of its result; a refusal by the host is raised with the host's own code
        (``invalid_engine``: no engine at that path ...)."""
        result = await self.command(name, action, args, instance, generation, timeout)
        if not result.ok:
            failure = CapyError(f"host {name!r}: {result.message or f'could not {action}'}", host=name)
            failure.code = result.code or "internal_error"
            raise failure
        return result.detail

    async def until_online(self, name: str) -> None:
        """Returns once host ``name`` is online and linked (at once when it is)."""
        while not self._linked(name):
            await anyio.sleep(WATCH_EVERY)

    def _linked(self, name: str) -> bool:
        link = self._links.get(name)
        return link is not None and link.send is not None and self.state(name) == HostState.ONLINE

    async def add_engine(self, name: str, path: str, engine: str | None, family: str | None) -> EngineInstall:
        """The installation at ``path`` on host ``name``'s own disk, inspected there and registered for it."""
        record = self._records.get(name)
        if record is None:
            raise HostNotFound(name)
        if engine is not None and any(e.name == engine for e in record.engines):
            raise AlreadyExists(f"host {name!r} has an engine named {engine!r} already; pick another --name")
        detail = await self.run(name, "inspect_engine", {"path": path, "name": engine, "family": family})
        try:
            install = msgspec.convert(detail, EngineInstall)
        except msgspec.ValidationError as exc:
            raise HostAnswerInvalid(name, f"the engine's inspection: {exc}") from exc
        record = self._records[name]
        if any(e.name == install.name for e in record.engines):
            raise AlreadyExists(f"host {name!r} has an engine named {install.name!r} already; pick another --name")
        record = msgspec.structs.replace(record, engines=[*record.engines, install])
        self._put(record)
        self._events.emit(
            None, "engine_added", engine=install.name, family=str(install.family), version=install.version, host=name
        )
        return install

    # --- what the server's deployments on hosts read -----------------------------------------------
    def engine(self, name: str, engine: str) -> EngineInstall | None:
        """The engine named ``engine`` that host ``name`` has (``add_engine``); None when it has none."""
        record = self._records.get(name)
        if record is None:
            raise HostNotFound(name)
        return next((e for e in record.engines if e.name == engine), None)

    def devices(self, name: str) -> list[Device]:
        """The devices host ``name`` reported in its inventory (none before it has, since the server started)."""
        link = self._links.get(name)
        if link is None or link.inventory is None:
            return []
        return [Device(name=d.name, capacity=d.capacity, reserve=d.reserve) for d in link.inventory.devices]

    def hosts_with(self, engine: str) -> list[tuple[str, HostState]]:
        """Each host that has an engine named ``engine``, and its state."""
        return [
            (name, self.state(name))
            for name, record in sorted(self._records.items())
            if any(e.name == engine for e in record.engines)
        ]

    def ingress(self, name: str) -> tuple[str, int]:
        """Where host ``name``'s ingress answers: its address on the link, the port its hello named."""
        link = self._links.get(name)
        if link is None or link.address is None or link.hello is None or not link.hello.ingress_port:
            raise DeviceOffline(name, "not linked, or runs no ingress")
        return link.address, link.hello.ingress_port

    def offline(self, name: str, model: str) -> DeviceOffline | None:
        """Why a request for ``model`` on host ``name`` cannot go there now; None while the host is online."""
        state = self.state(name)
        if state == HostState.ONLINE:
            return None
        # a closed link is dialled again at once (an agent restarting takes a second or so); silence takes longer
        soon = state in (HostState.DISCONNECTED, HostState.JOINED)
        return DeviceOffline(
            name, state.value, model=model, retry_after=1 if soon else max(1, round(self.timings.suspend_after))
        )

    def fingerprint(self, name: str) -> str | None:
        """The SHA-256 of the certificate host ``name`` holds now; None when it is revoked or unknown: what the
        server pins the host's ingress to (a certificate the CA signed for the name before is not it)."""
        record = self._records.get(name)
        return None if record is None or record.revoked_at is not None else record.fingerprint

    def proven(self, name: str) -> tuple[int, list[RunningInstance]] | None:
        """(the link's session, what the host said runs in its hello) while host ``name`` is linked."""
        link = self._links.get(name)
        if link is None or not link.connected or link.hello is None:
            return None
        return link.session, link.hello.running

    def session(self, name: str) -> int:
        """The current link's session number (0: never linked since the server started)."""
        link = self._links.get(name)
        return link.session if link is not None else 0

    def exit_of(self, name: str, instance: str, pid: int) -> ProcessExit | None:
        """What host ``name`` told of the end of ``instance``'s process ``pid`` (its status, its cause); None if
        it told nothing."""
        link = self._links.get(name)
        for told in reversed(link.exits if link is not None else []):
            if told.instance == instance and told.pid == pid:
                return told
        return None

    def load_of(self, name: str, instance: str) -> tuple[InstanceLoad, float] | None:
        """The load host ``name`` last told for ``instance`` and when it came (this server's monotonic clock);
        None when its last report had none."""
        link = self._links.get(name)
        return link.loads.get(instance) if link is not None else None

    def watch_exits(self, name: str, watcher: ExitWatcher) -> None:
        """``watcher.exit_news()`` each time host ``name`` tells an engine's end, links (its hello says what
        runs there) or is revoked, for as long as ``watcher`` lives (held weakly: a deployment deleted, its
        effects go)."""
        self._exit_watchers.setdefault(name, weakref.WeakSet()).add(watcher)

    def _exit_news(self, name: str) -> None:
        for watcher in list(self._exit_watchers.get(name, ())):
            watcher.exit_news()

    # --- states -------------------------------------------------------------------------------------
    def state(self, name: str) -> HostState:
        return link_state(self._facts(name), self._clock.monotonic(), self.timings)

    def _facts(self, name: str) -> LinkFacts:
        record = self._records.get(name)
        if record is None:
            raise HostNotFound(name)
        link = self._links.get(name)
        return LinkFacts(
            revoked=record.revoked_at is not None,
            ever_linked=record.linked_at is not None,
            linked=link is not None and link.connected and not link.leaving,
            last_heard=link.last_heard if link is not None else None,
            since=self._since,
        )

    def replacement_due(self, name: str) -> bool:
        """Whether host ``name``'s instances are to be placed elsewhere now (lost for ``hosts.replace_after``,
        or revoked)."""
        return replacement_due(self._facts(name), self._clock.monotonic(), self.timings)

    def draining(self, name: str) -> bool:
        """Whether an operator drained host ``name`` (and has not undrained it)."""
        record = self._records.get(name)
        if record is None:
            raise HostNotFound(name)
        return record.draining

    def drain(self, name: str, draining: bool) -> HostRecord:
        """Host ``name`` drained (nothing new placed there) or undrained; said once as an event."""
        record = self._records.get(name)
        if record is None:
            raise HostNotFound(name)
        if record.draining != draining:
            record = msgspec.structs.replace(record, draining=draining)
            self._put(record)
            self._events.emit(None, "host_drained" if draining else "host_undrained", host=name)
        return record

    def _tell(self, name: str, link: _Link) -> None:
        """An event when the host's state is not the one last told."""
        state = self.state(name)
        if state != link.state:
            before, link.state = link.state, state
            self._events.emit(
                None, "host_state", host=name, state=state.value, before=before.value if before is not None else None
            )

    async def watch(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Tells each host's state changes as time passes (a silent host is suspended, then lost)."""
        task_status.started()
        while True:
            for name in list(self._records):
                self._tell(name, self._links.setdefault(name, _Link()))
            await anyio.sleep(WATCH_EVERY)

    async def revoke(self, name: str) -> HostRecord:
        """``name`` is revoked: its certificate and invitations are refused for ever, its link closes now."""
        record = self._records.get(name)
        if record is None:
            raise HostNotFound(name)
        revoked = list(record.revoked)
        if record.fingerprint not in revoked:
            revoked.append(record.fingerprint)
        record = msgspec.structs.replace(record, revoked=revoked, revoked_at=self._clock.wall())
        self._put(record)
        self._events.emit(None, "host_revoked", host=name)
        self._exit_news(name)  # its agent, cut off, ends its engines: they count gone
        link = self._links.get(name)
        if link is not None and link.close is not None:
            await link.close("host_revoked")
        if link is not None:
            self._tell(name, link)
        return record

    # --- views --------------------------------------------------------------------------------------
    def view(self, name: str) -> dict[str, Any]:
        record = self._records.get(name)
        if record is None:
            raise HostNotFound(name)
        link = self._links.get(name) or _Link()
        hello, inventory = link.hello, link.inventory
        heard = link.last_heard
        return {
            "name": name,
            "state": self.state(name).value,
            "address": link.address,
            "connected": link.connected,
            "last_heartbeat": link.last_heard_wall,
            "silent_s": None if heard is None else round(self._clock.monotonic() - heard, 3),
            "version": hello.version if hello else None,
            "ingress": f"{link.address}:{hello.ingress_port}"
            if hello and hello.ingress_port and link.address
            else None,
            "devices": [
                {"name": d.name, "capacity_bytes": d.capacity, "reserve_bytes": d.reserve} for d in inventory.devices
            ]
            if inventory
            else [],
            "engines": [
                {"name": e.name, "family": str(e.family), "version": e.version, "path": e.path} for e in record.engines
            ],
            "instances": [i.instance for i in hello.running] if hello else [],
            "exits": [
                {"instance": e.instance, "pid": e.pid, "returncode": e.returncode, "at": e.at, "cause": e.cause}
                for e in link.exits[-8:]
            ],
            "joined_at": record.joined_at,
            "revoked_at": record.revoked_at,
            "draining": record.draining,
        }

    def views(self) -> list[dict[str, Any]]:
        return [self.view(name) for name in sorted(self._records)]
