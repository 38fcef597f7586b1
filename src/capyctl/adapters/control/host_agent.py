"""The host's side of the control link: joining once, then one link to the server kept up.

``join`` makes the host's key and CSR, checks the server against the CA
pinned in the join file (the TLS handshake fails on any other certificate,
before a byte of the secret leaves), spends the invitation and keeps the
certificate it gets (``HostIdentity``). ``HostAgent.run`` dials the server
with that certificate (mutual TLS), says hello and what it has, sends a
heartbeat every second, and dials again with jittered backoff whenever the
link drops, until it is stopped or the server says the host is revoked.
"""

from __future__ import annotations

import logging
import random
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from capyctl import __version__
from capyctl.adapters.control.frames import beat, send_quietly
from capyctl.adapters.pki import client_ssl_context, fingerprint, host_key_and_csr, write_private
from capyctl.domain.errors import CapyError, InvalidConfig
from capyctl.domain.hosts import CommandLedger, Verdict
from capyctl.domain.joining import JoinFile
from capyctl.domain.link import (
    PROTOCOL_VERSION,
    Callers,
    Command,
    CommandResult,
    Goodbye,
    Hello,
    Inventory,
    JoinAccepted,
    JoinRequest,
    Message,
    RunningInstance,
    decode,
    encode,
)

log = logging.getLogger("capyctl.host")
SERVER_NAME = "capyctl-server"  # the name in the server's control certificate, checked by every host
HEARTBEAT = 1.0
SERVER_SILENCE = 10.0  # seconds without a word from the server before the link is given up and dialled anew
BACKOFF_FIRST, BACKOFF_MOST = 0.5, 10.0  # seconds before dialling again: doubled each failure, jittered
MAX_MESSAGE = 4 << 20
IDENTITY = "identity/host.json"
KEY = "identity/host-key.pem"
CERT = "identity/host-cert.pem"


class LinkRefused(CapyError):
    """The server refused the link for good (the host is revoked): dialling again would not help."""

    code = "host_revoked"


class HostIdentity(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What a joined host keeps beside its key (``identity/host.json``)."""

    name: str
    server: str  # the control address, host:port
    ca_pem: str
    fingerprint: str  # of its certificate

    @staticmethod
    def load(state: Path) -> tuple[HostIdentity, bytes, bytes]:
        """The identity, certificate and key under ``state``; a clear error where the host has not joined."""
        path = state / IDENTITY
        if not path.exists():
            raise InvalidConfig(
                f"this machine has not joined a server ({path} is missing); run "
                "`capyctl join host --join-file FILE` first"
            )
        try:
            identity = msgspec.json.decode(path.read_bytes(), type=HostIdentity)
        except msgspec.DecodeError as exc:
            raise InvalidConfig(f"{path}: {exc}") from exc
        return identity, (state / CERT).read_bytes(), (state / KEY).read_bytes()


async def join(join_file: JoinFile, state: Path, timeout: float = 30.0) -> HostIdentity:
    """Join the server of ``join_file`` as its host; the identity is written under ``state``."""
    key_pem, csr_pem = host_key_and_csr(join_file.host)
    tls = client_ssl_context(join_file.ca_pem.encode(), server_name=SERVER_NAME)
    request = JoinRequest(host=join_file.host, secret=join_file.secret, csr_pem=csr_pem.decode())
    try:
        with anyio.fail_after(timeout):
            async with _dial(join_file.server, tls) as conn:
                await conn.send(encode(request))
                answer = decode(await conn.recv(decode=False))
    except TimeoutError as exc:
        raise CapyError(f"the server at {join_file.server} did not answer within {timeout:g} s") from exc
    except ssl.SSLCertVerificationError as exc:
        raise CapyError(
            f"the server at {join_file.server} is not the one of this join file (its certificate "
            f"is not signed by the CA pinned there: {exc.verify_message}); nothing was sent"
        ) from exc
    except (OSError, InvalidHandshake) as exc:
        raise CapyError(f"could not reach the server at {join_file.server}: {exc}") from exc
    if isinstance(answer, Goodbye):
        error = CapyError(answer.message)
        error.code = answer.code
        raise error
    if not isinstance(answer, JoinAccepted):
        raise CapyError(f"the server answered the join with {type(answer).__name__}, not a certificate")
    identity = HostIdentity(
        name=join_file.host,
        server=join_file.server,
        ca_pem=join_file.ca_pem,
        fingerprint=fingerprint(answer.cert_pem.encode()),
    )
    write_private(state / KEY, key_pem)
    write_private(state / CERT, answer.cert_pem.encode())
    write_private(state / IDENTITY, msgspec.json.encode(identity))
    return identity


def _dial(server: str, tls: ssl.SSLContext) -> connect:
    return connect(
        f"wss://{server}",
        ssl=tls,
        server_hostname=SERVER_NAME,
        max_size=MAX_MESSAGE,
        ping_interval=None,
        compression=None,
        open_timeout=10,
        close_timeout=2,
        user_agent_header=None,
        proxy=None,
    )


class HostAgent:
    def __init__(
        self,
        state: Path,
        inventory: Callable[[], Inventory],
        handle: Callable[[Command], Awaitable[CommandResult]] | None = None,
        heartbeat: float = HEARTBEAT,
        ingress_port: int | None = None,
        running: Callable[[], list[RunningInstance]] = list,
        callers: Callable[[bytes], None] | None = None,
        leaving: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``callers``: given the certificate the server's calls to the ingress will show (sent first on each
        link); ``leaving``: run when the agent is asked to stop while linked, after its goodbye and before the
        link closes, so that what it says (its engines' ends) still reaches the server."""
        self._identity, cert, key = HostIdentity.load(state)
        self._tls = client_ssl_context(self._identity.ca_pem.encode(), cert, key, server_name=SERVER_NAME)
        self._inventory = inventory
        self._heartbeat = heartbeat
        self._ingress_port = ingress_port
        self._running = running
        self._callers = callers
        self._leaving = leaving
        self._conn: ClientConnection | None = None  # the link, while it is up
        self._handle = handle or _unsupported
        self._ledger = CommandLedger()
        self.name = self._identity.name
        self.server = self._identity.server

    async def run(self, stopping: anyio.Event) -> None:
        """Keeps the link up until ``stopping``; raises ``LinkRefused`` when the server refuses the host."""
        delay = BACKOFF_FIRST
        while not stopping.is_set():
            try:
                async with _dial(self.server, self._tls) as conn:
                    delay = BACKOFF_FIRST
                    log.info("linked to the server at %s as host %s", self.server, self.name)
                    await self._session(conn, stopping)
            except LinkRefused:
                raise
            except (OSError, InvalidHandshake, ConnectionClosed, TimeoutError) as exc:
                log.warning(
                    "the link to the server at %s is down (%s); dialling again in %.1f s",
                    self.server,
                    exc or type(exc).__name__,
                    delay,
                )
            if stopping.is_set():
                return
            with anyio.move_on_after(delay * random.uniform(0.5, 1.0)):
                await stopping.wait()
            delay = min(delay * 2, BACKOFF_MOST)

    async def tell(self, message: Message) -> None:
        """``message`` to the server now if the link is up; dropped otherwise (the next hello says what runs)."""
        if self._conn is not None:
            await send_quietly(self._conn, message)

    async def _run(self, conn: ClientConnection, command: Command) -> None:
        """One command from the server: applied once (the ledger answers a replay with the recorded result,
        and refuses a stale generation), its result sent back."""
        decision = self._ledger.decide(command)
        if decision.verdict == Verdict.PENDING:
            return  # a copy of a command under way: its result goes out when it is done
        if decision.result is not None:
            await send_quietly(conn, decision.result)
            return
        try:
            result = await self._handle(command)
        except CapyError as error:
            result = CommandResult(
                id=command.id, generation=command.generation, ok=False, code=error.code, message=error.message
            )
        except Exception as error:  # a bug of this host's: said to the server, not a dead link
            log.exception("command %s (%s) failed", command.id, command.action)
            result = CommandResult(
                id=command.id,
                generation=command.generation,
                ok=False,
                code="internal_error",
                message=f"{type(error).__name__}: {error}",
            )
        self._ledger.record(result)
        await send_quietly(conn, result)

    async def _session(self, conn: ClientConnection, stopping: anyio.Event) -> None:
        try:
            await conn.send(
                encode(
                    Hello(
                        host=self.name,
                        version=__version__,
                        protocol=PROTOCOL_VERSION,
                        capabilities=["inspect_engine", "gates", "engines"],
                        running=self._running(),
                        ingress_port=self._ingress_port,
                    )
                )
            )
            await conn.send(encode(self._inventory()))
        except ConnectionClosed:
            pass  # what the server said before it closed is still read below
        heard = [anyio.current_time()]
        self._conn = conn
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(beat, conn, self._heartbeat)
            tasks.start_soon(self._close_when, stopping, conn)
            tasks.start_soon(_close_if_silent, conn, heard)
            try:
                async for data in conn:
                    heard[0] = anyio.current_time()
                    try:
                        message = decode(data if isinstance(data, bytes) else data.encode())
                    except CapyError as error:  # a server of another version: logged, the link dialled again
                        log.warning("the server sent what this host cannot read (%s); closing the link", error.message)
                        break
                    if isinstance(message, Goodbye):
                        log.warning("the server closed the link: %s", message.message)
                    elif isinstance(message, Callers):  # taken before any later message: commands follow it
                        if self._callers is not None:
                            self._callers(message.cert_pem.encode())
                    elif isinstance(message, Command):
                        tasks.start_soon(self._run, conn, message)
            except ConnectionClosed:
                pass
            finally:
                self._conn = None
                tasks.cancel_scope.cancel()
        if conn.close_reason == "host_revoked":  # the server's refusal for good (see the listener)
            raise LinkRefused(
                f"the server refused host {self.name}: it is revoked or its certificate was "
                f"replaced; invite it again (capyctl invite host {self.name}) and join with the new file"
            )
        if not stopping.is_set():
            raise ConnectionResetError(f"the server closed the link ({conn.close_reason or 'no reason given'})")

    async def _close_when(self, stopping: anyio.Event, conn: ClientConnection) -> None:
        """Once asked to stop: goodbye first (the server routes nothing more here from that instant), then
        ``leaving`` (the engines stopped, each end told), then the link closed."""
        await stopping.wait()
        await send_quietly(conn, Goodbye(code="agent_stopping", message=f"host {self.name}'s agent is stopping"))
        if self._leaving is not None:
            with anyio.CancelScope(shield=True):
                await self._leaving()
        await conn.close()


async def _unsupported(command: Command) -> CommandResult:
    raise CapyError(f"this host does not run {command.action!r} commands yet")


async def _close_if_silent(conn: ClientConnection, heard: list[float]) -> None:
    """Closes a link the server has not spoken on for ``SERVER_SILENCE`` s (it beats every second): a link
    whose network vanished is dialled anew rather than waited on."""
    while anyio.current_time() - heard[0] < SERVER_SILENCE:
        await anyio.sleep(1.0)
    log.warning("the server has been silent for %.0f s: dialling again", SERVER_SILENCE)
    await conn.close()
