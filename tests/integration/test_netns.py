"""The namespaces the several-machines tests run in: who reaches whom, and that nothing is left behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.integration.netns import Lan, Node, available

pytestmark = pytest.mark.integration

_LISTEN = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(b"hello from " + sys.argv[1].encode())
    conn.close()
"""

_CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as conn:
        print(conn.recv(100).decode())
except OSError as exc:
    print("refused" if isinstance(exc, ConnectionRefusedError) else f"failed: {exc!r}")
"""


@pytest.fixture
def lan():
    why = available()
    if why is not None:
        pytest.fail(why)
    with Lan(["gpu-a", "gpu-b"]) as made:
        yield made


def _listen(node: Node, address: str, port: int) -> subprocess.Popen[bytes]:
    process = node.popen([sys.executable, "-c", _LISTEN, address, str(port)], stdout=subprocess.PIPE)
    assert process.stdout is not None
    assert process.stdout.readline() == b"listening\n"
    return process


def _connect(node: Node, address: str, port: int, timeout: float = 5.0) -> str:
    return node.run([sys.executable, "-c", _CONNECT, address, str(port), str(timeout)]).stdout.strip()


def test_server_and_hosts_reach_each_other_and_nothing_else(lan: Lan) -> None:
    a, b = lan.hosts["gpu-a"], lan.hosts["gpu-b"]
    _listen(a, a.address, 9000)
    _listen(a, "127.0.0.1", 9001)  # an engine on the host's loopback
    _listen(lan.server, "0.0.0.0", 9002)

    assert _connect(lan.server, a.address, 9000) == f"hello from {a.address}"
    assert _connect(a, lan.server_address_for["gpu-a"], 9002) == "hello from 0.0.0.0"
    # the engine's port is the host's own: the server's 127.0.0.1 is another machine's loopback
    assert _connect(lan.server, "127.0.0.1", 9001) == "refused"
    assert _connect(a, "127.0.0.1", 9001) == "hello from 127.0.0.1"
    # hosts do not reach each other, and the test reaches only the server's address
    assert _connect(b, a.address, 9000, timeout=1.0).startswith("failed")
    with socket.create_connection((lan.server.address, 9002), timeout=5) as conn:
        assert conn.recv(100) == b"hello from 0.0.0.0"


def test_a_link_down_drops_traffic_until_it_is_up_again(lan: Lan) -> None:
    a = lan.hosts["gpu-a"]
    _listen(a, a.address, 9000)
    a.link_down()
    assert _connect(lan.server, a.address, 9000, timeout=1.0).startswith("failed")
    a.link_up()
    deadline = time.monotonic() + 10
    while (answer := _connect(lan.server, a.address, 9000, timeout=1.0)) != f"hello from {a.address}":
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)


def test_closing_kills_what_runs_inside_and_deletes_the_namespaces() -> None:
    why = available()
    if why is not None:
        pytest.fail(why)
    with Lan(["gpu-a"]) as made:
        host = made.hosts["gpu-a"]
        stopped = host.popen(["sleep", "600"])
        spawned = host.popen(["sh", "-c", "kill -STOP $$; sleep 600"])  # a stopped process is killed too
        namespaces = [made.server.namespace, host.namespace]
        deadline = time.monotonic() + 10
        while not set(host.pids()) >= {stopped.pid, spawned.pid}:  # each entered the namespace
            assert time.monotonic() < deadline, host.pids()
            time.sleep(0.05)
    assert stopped.wait(timeout=10) is not None and spawned.wait(timeout=10) is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in namespaces)
