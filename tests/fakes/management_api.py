"""A stand-in for CapyCTL's management API on loopback, for the tests of the CLI's client: a real HTTP server
in a thread that records each request it is sent and answers what the test's ``respond`` says, its address
written into a state directory as a running server writes it."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from capyctl.adapters.storage.state_dir import StateDir


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@contextmanager
def management_api(state: StateDir, respond: Callable[[Seen], tuple[int, bytes]]) -> Iterator[list[Seen]]:
    """The stand-in serving until the block ends; yields the requests it was sent, in order. ``respond``
    gives each one's status and JSON body."""
    seen: list[Seen] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            request = Seen(
                self.command,
                self.path,
                {k.lower(): v for k, v in self.headers.items()},
                self.rfile.read(length) if length else b"",
            )
            seen.append(request)
            status, body = respond(request)
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.write_management(f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
