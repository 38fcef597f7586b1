"""The server's role in several machines, composed (the host's is in ``host_role``): its CA, its control
certificate, the registry of hosts, the control listener, invitations, and ``identity/server-credentials.json``."""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from capyctl.adapters.control.host_agent import SERVER_NAME
from capyctl.adapters.control.server_listener import ControlListener
from capyctl.adapters.http.management import Hosts
from capyctl.adapters.pki import (
    CertificateAuthority,
    caller_certificate,
    client_ssl_context,
    server_ssl_context,
    write_private,
)
from capyctl.adapters.storage.state_dir import StateDir
from capyctl.domain.errors import InvalidRequest
from capyctl.domain.joining import SECRET_BYTES, JoinFile, secret_text
from capyctl.entrypoints.container import Container

SERVER_CREDENTIALS = "identity/server-credentials.json"


def server_role(
    state: StateDir, container: Container, control: tuple[str, int], advertised: str | None
) -> tuple[Hosts, ControlListener]:
    authority = CertificateAuthority.load_or_create(state.root / "identity" / "ca")
    names = [SERVER_NAME] + ([control[0]] if control[0] not in ("0.0.0.0", "::", "") else [])
    cert_pem, key_pem = authority.server_certificate(names)
    tls = server_ssl_context(cert_pem, key_pem, authority.cert_pem, require_client=False)
    registry = container.hosts()
    assert registry is not None, "the container was built for a CapyCTL that runs alone"
    # the engines on hosts are reached through their ingresses: each host held to the certificate it holds now,
    # and this server known there by a certificate of its own, made afresh at each start and handed to each
    # host over its link (no host's certificate, all of this CA's, opens an ingress)
    caller_pem, caller_key = caller_certificate(SERVER_NAME)
    container.engine_session().trust(
        client_ssl_context(authority.cert_pem, caller_pem, caller_key, names_checked=True), registry.fingerprint
    )
    write_server_credentials(state)

    def invite(name: str, ttl: float, server: str | None) -> dict[str, Any]:
        address = server or advertised
        if address is None:
            raise InvalidRequest(
                "the server does not know the address hosts reach it at: give --server ADDR:PORT, "
                "or start the server with --control-advertise ADDR:PORT",
                param="server",
            )
        secret = secrets.token_bytes(SECRET_BYTES)
        made = registry.invite(name, secret, ttl)
        join = JoinFile(
            host=name,
            server=address,
            ca_pem=authority.cert_pem.decode(),
            secret=secret_text(secret),
            expires_at=made.expires_at,
        )
        document: dict[str, Any] = msgspec.to_builtins(join)
        return document

    return Hosts(registry, invite), ControlListener(registry, authority, tls, caller_pem)


def write_server_credentials(state: StateDir) -> None:
    """``{"api_key": ...}`` (0600) for the scripts of a server machine; rewritten when the key changed."""
    key = state.read_api_key()
    path = state.root / SERVER_CREDENTIALS
    if key is None:
        if path.exists():
            path.unlink()  # the key named default was revoked: no file names a dead key
        return
    text = msgspec.json.encode({"api_key": key}).decode() + "\n"
    if not path.exists() or path.read_text() != text:
        write_private(path, text.encode())
