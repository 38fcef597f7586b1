"""The server's control listener (``--control-listen``, 0.0.0.0:7445 by default): where hosts join and link.

One TLS port, WebSocket messages (the ``websockets`` library: a maintained,
pure-asyncio implementation with keep-alive pings, flow control and size
limits, and nothing more than one connection per host needs; gRPC would
add code generation and HTTP/2 for no gain here), each message one of
``domain.link``'s typed structs.

- A connection without a client certificate may only join: one
  ``JoinRequest`` (host name, the invitation's secret, a CSR), answered with
  ``JoinAccepted`` (the host's certificate) or ``Goodbye`` saying why not,
  then closed. The host checked this server against the CA pinned in its
  join file before it sent the secret.
- A connection with a certificate the CA signed is a host's link: it must
  be the certificate the server holds for that host (not replaced, not
  revoked), and the first message must be the host's ``Hello`` under the
  same name. The server answers with ``Callers`` (the certificate its calls
  to the host's ingress will show: the ingress lets nobody else in), then
  both sides send heartbeats; the host sends its inventory, load samples
  and process exits; the registry keeps what it says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import Any

import anyio
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from capyctl.adapters.control.frames import beat, send_quietly
from capyctl.adapters.pki import CertificateAuthority, fingerprint, host_name_of
from capyctl.domain.errors import CapyError, InvalidRequest
from capyctl.domain.joining import secret_bytes
from capyctl.domain.link import Callers, Goodbye, Hello, JoinAccepted, JoinRequest, Message, decode, encode
from capyctl.services.server_hosts import HostRegistry

log = logging.getLogger("capyctl.hosts")
HEARTBEAT = 1.0  # seconds between two heartbeats the server sends each host
MAX_MESSAGE = 4 << 20  # bytes of one message (a CSR, an inventory)
_OPEN_TIMEOUT = 10.0


class _TlsConnection(ServerConnection):
    """A WebSocket connection that keeps its peer's certificate (DER), read when TLS is up."""

    peer_der: bytes | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tls = transport.get_extra_info("ssl_object")
        self.peer_der = tls.getpeercert(binary_form=True) if tls is not None else None
        super().connection_made(transport)


class ControlListener:
    def __init__(
        self,
        registry: HostRegistry,
        authority: CertificateAuthority,
        tls: ssl.SSLContext,
        callers_pem: bytes,
        heartbeat: float = HEARTBEAT,
    ) -> None:
        self._registry = registry
        self._callers = Callers(cert_pem=callers_pem.decode())
        self._authority = authority
        self._tls = tls
        self._heartbeat = heartbeat
        self._closing: set[asyncio.Task[None]] = set()  # goodbyes under way (a task is kept until it ends)

    async def serve(self, sock: socket.socket, stopping: anyio.Event) -> None:
        async with serve(
            self._handle,
            sock=sock,
            ssl=self._tls,
            create_connection=_TlsConnection,
            max_size=MAX_MESSAGE,
            open_timeout=_OPEN_TIMEOUT,
            close_timeout=2,
            ping_interval=None,
            compression=None,
            server_header=None,
        ):
            await stopping.wait()

    async def _handle(self, conn: ServerConnection) -> None:
        der = conn.peer_der if isinstance(conn, _TlsConnection) else None
        try:
            if der is None:
                await self._join(conn)
            else:
                await self._link(conn, der)
        except ConnectionClosed:
            pass

    async def _join(self, conn: ServerConnection) -> None:
        try:
            with anyio.fail_after(_OPEN_TIMEOUT):
                request = decode(await conn.recv(decode=False))
            if not isinstance(request, JoinRequest):
                raise InvalidRequest("a connection without a host certificate may only join")
            secret = secret_bytes(request.secret)
            cert = self._authority.sign_host(request.csr_pem.encode(), request.host)  # a bad CSR spends nothing
            self._registry.redeem(request.host, secret)
            self._registry.joined(request.host, fingerprint(cert))
            log.info("host %s joined from %s", request.host, _address(conn))
            await conn.send(encode(JoinAccepted(host=request.host, cert_pem=cert.decode())))
        except TimeoutError:
            await _refuse(conn, InvalidRequest("no join request within 10 s"))
        except CapyError as error:
            log.warning("refused a join from %s: %s", _address(conn), error.message)
            await _refuse(conn, error)

    async def _link(self, conn: ServerConnection, der: bytes) -> None:
        name = "?"
        try:
            name = host_name_of(der)
            self._registry.admit(name, fingerprint(der))
            with anyio.fail_after(_OPEN_TIMEOUT):
                hello = decode(await conn.recv(decode=False))
            if not isinstance(hello, Hello) or hello.host != name:
                raise InvalidRequest(f"the first message of host {name!r}'s link must be its hello, in its name")
            await conn.send(encode(self._callers))  # before anything else can be sent on the link: a command
        except TimeoutError:
            await _refuse(conn, InvalidRequest("no hello within 10 s"))
            return
        except CapyError as error:
            log.warning("refused host %s's link from %s: %s", name, _address(conn), error.message)
            await _refuse(conn, error)
            return

        async def goodbye(why: str) -> None:
            with contextlib.suppress(ConnectionClosed):
                await conn.send(encode(Goodbye(code=why, message=f"the server closed the link: {why}")))
                await conn.close(code=1008, reason=why)

        async def close(why: str) -> None:  # returns at once: a dead link's close must not hold its caller
            self._closing.add(task := asyncio.get_running_loop().create_task(goodbye(why)))
            task.add_done_callback(self._closing.discard)

        async def send(message: Message) -> None:  # a link that is going: the registry fails what waits on it
            await send_quietly(conn, message)

        session, replaced = self._registry.connected(name, _address(conn), hello, close, send)
        if replaced is not None:  # the host dialled again: its old link, half-open or not, is closed
            await replaced("replaced")
        log.info("host %s linked from %s (capyctl %s)", name, _address(conn), hello.version)
        why = "closed by the host"
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(beat, conn, self._heartbeat)
                try:
                    async for data in conn:
                        self._registry.heard(name, session, decode(data if isinstance(data, bytes) else data.encode()))
                except ConnectionClosed as closed:
                    why = str(closed)
                except CapyError as error:  # a message that is not one of the link's
                    why = error.message
                    await _refuse(conn, error)
                finally:
                    tasks.cancel_scope.cancel()
        finally:
            self._registry.disconnected(name, session, why)
            log.info("host %s's link closed: %s", name, why)


async def _refuse(conn: ServerConnection, error: CapyError) -> None:
    try:
        await conn.send(encode(Goodbye(code=error.code, message=error.message)))
        await conn.close(code=1008, reason=error.code)
    except ConnectionClosed:
        pass


def _address(conn: ServerConnection) -> str:
    remote: Any = conn.remote_address
    return str(remote[0]) if remote else "?"
