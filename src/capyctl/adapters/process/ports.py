"""Free loopback ports and listening sockets."""

from __future__ import annotations

import socket

from capyctl.domain.errors import InvalidRequest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def parse_listen(value: str, option: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidRequest(f"{option} {value!r}: expected HOST:PORT, for example 127.0.0.1:8443")
    return host.strip("[]"), int(port)


def listen_socket(host: str, port: int, option: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidRequest(f"cannot listen on {host}:{port} ({exc.strerror}); choose another with {option}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock
