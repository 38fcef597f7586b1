"""Network namespaces for tests of several machines: a server and hosts, each in a namespace of its own.

The test process stays in the root namespace and reaches the server over a veth pair (root
``10.<n>.0.1`` and server ``10.<n>.0.2``); each host has a veth pair to the server (server ``10.<n>.<i>.1``,
host ``10.<n>.<i>.2``), so a host reaches the server and the server each host, and nothing else routes
anywhere: no default route, no forwarding between the pairs, traffic only to addresses inside the
namespaces. Every namespace has its loopback up, where its engines listen.

Needs root (CI runs as root). ``Lan`` is a context manager: on the way out, whatever still runs in a
namespace is killed and the namespaces are deleted (which deletes their veth ends), also when the test
failed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_NUMBERS = itertools.count()


def available() -> str | None:
    """None where namespaces can be made here; else why not (the tests then fail with that reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the suite as root)"
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        return "the `ip` command (iproute2) is missing"
    return None


def _ip(*args: str, namespace: str | None = None) -> None:
    argv = ["ip", *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


@dataclass
class Node:
    """One machine: a namespace, its address as the others reach it, and the veth on its side."""

    name: str
    namespace: str
    address: str
    link: str  # its end of the veth pair towards the server (for the server: towards the test)

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """``argv`` started inside this machine's namespace."""
        return subprocess.Popen(self.argv(argv), **kwargs)

    def run(self, argv: Sequence[str], timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def pids(self) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True)
        return [int(pid) for pid in done.stdout.split()]

    def link_down(self) -> None:
        """Cut this machine off (its side of the veth pair down): packets are dropped, nothing is closed."""
        _ip("link", "set", self.link, "down", namespace=self.namespace)

    def link_up(self) -> None:
        _ip("link", "set", self.link, "up", namespace=self.namespace)


class Lan:
    """A server namespace and ``hosts`` host namespaces, wired as the module says."""

    def __init__(self, hosts: Sequence[str]) -> None:
        number = 200 + (os.getpid() + next(_NUMBERS)) % 50  # 10.200-249.x.x, apart per process and per Lan
        self._tag = f"c{os.getpid() % 10000}{next(_NUMBERS)}"
        self._made: list[str] = []
        self._host_names = list(hosts)
        self.server = Node("server", f"{self._tag}-server", f"10.{number}.0.2", f"{self._tag}s0")
        self.test_address = f"10.{number}.0.1"
        self.hosts: dict[str, Node] = {}
        self.server_address_for: dict[str, str] = {}  # the server's address on each host's pair
        for i, name in enumerate(self._host_names, start=1):
            self.hosts[name] = Node(name, f"{self._tag}-{name}", f"10.{number}.{i}.2", f"{self._tag}h{i}")
            self.server_address_for[name] = f"10.{number}.{i}.1"

    def __enter__(self) -> Lan:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("link", "set", "lo", "up", namespace=name)

    def _make(self) -> None:
        server = self.server
        self._namespace(server.namespace)
        root_end = f"{self._tag}r0"
        _ip("link", "add", root_end, "type", "veth", "peer", "name", server.link, "netns", server.namespace)
        _ip("addr", "add", f"{self.test_address}/24", "dev", root_end)
        _ip("link", "set", root_end, "up")
        _ip("addr", "add", f"{server.address}/24", "dev", server.link, namespace=server.namespace)
        _ip("link", "set", server.link, "up", namespace=server.namespace)
        for i, (name, host) in enumerate(self.hosts.items(), start=1):
            self._namespace(host.namespace)
            server_end = f"{self._tag}x{i}"
            _ip(
                "link",
                "add",
                server_end,
                "netns",
                server.namespace,
                "type",
                "veth",
                "peer",
                "name",
                host.link,
                "netns",
                host.namespace,
            )
            _ip("addr", "add", f"{self.server_address_for[name]}/24", "dev", server_end, namespace=server.namespace)
            _ip("link", "set", server_end, "up", namespace=server.namespace)
            _ip("addr", "add", f"{host.address}/24", "dev", host.link, namespace=host.namespace)
            _ip("link", "set", host.link, "up", namespace=host.namespace)

    def close(self) -> None:
        nodes = [self.server, *self.hosts.values()]
        for node in nodes:
            if node.namespace in self._made:
                _kill_all(node)
        for namespace in reversed(self._made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._made.clear()
        # the root end of the test's pair went with the server namespace's peer


def _kill_all(node: Node, grace: float = 5.0) -> None:
    """SIGCONT then SIGTERM to everything in the namespace, SIGKILL to what is left after ``grace``."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for pid in node.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    deadline = time.monotonic() + grace
    while node.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in node.pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
