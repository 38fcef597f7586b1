"""Several machines, for real: a server and two hosts in network namespaces, joining and keeping their links.

Each machine is a namespace (``tests/integration/netns.py``); CapyCTL runs there as separate processes,
exactly as on separate machines: the server with its control listener, each host's agent with the
identity it got by joining. What is checked is what a user sees: the CLI's answers and exit codes, the
files' modes, ``capyctl list hosts``.
"""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import llama_paths
from tests.integration.machines import CONTROL_PORT, INFERENCE_PORT, Machine, _listed, hosts, invite, joined, until
from tests.integration.netns import Lan

pytestmark = pytest.mark.integration


def test_two_hosts_join_and_are_listed_online(lan: Lan, server: Machine, tmp_path: Path) -> None:
    a = joined(lan, server, "gpu-a", tmp_path)
    b = joined(lan, server, "gpu-b", tmp_path)
    listed = hosts(server)
    for name, host in (("gpu-a", a), ("gpu-b", b)):
        assert listed[name]["state"] == "online"
        assert listed[name]["address"] == host.node.address  # the link comes from the host's own address
        assert listed[name]["version"]
        assert listed[name]["last_heartbeat"] is not None
        # the host keeps its key for its owner only
        assert stat.S_IMODE((host.state / "identity" / "host-key.pem").stat().st_mode) == 0o600
    text = server.cli("list", "hosts").stdout
    assert "gpu-a" in text and "online" in text
    # the join file was for the host's eyes only, and the server's credentials file names the API key
    assert stat.S_IMODE((server.state.parent / "gpu-a.join").stat().st_mode) == 0o600
    credentials = server.state / "identity" / "server-credentials.json"
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
    key = json.loads(credentials.read_text())["api_key"]
    sed = subprocess.run(
        ["sed", "-n", r's/.*"api_key": *"\([^"]*\)".*/\1/p', str(credentials)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert sed.stdout.strip() == key
    models = httpx.get(
        f"http://{lan.server.address}:{INFERENCE_PORT}/v1/models",
        headers={"authorization": f"Bearer {key}"},
        timeout=10,
    )
    assert models.status_code == 200, models.text  # the key of that file opens the server's inference API


def test_join_files_are_refused_once_used_expired_forged_or_for_another_host(
    lan: Lan, server: Machine, tmp_path: Path
) -> None:
    a = joined(lan, server, "gpu-a", tmp_path)
    used = server.state.parent / "gpu-a.join"
    again = a.cli("join", "host", "--join-file", str(used), "--state-dir", str(tmp_path / "again"), check=False)
    assert again.returncode != 0 and "error [join_refused]" in again.stderr and "used" in again.stderr

    expiring = invite(server, lan, "gpu-b", "--ttl", "1s")
    ends = json.loads(expiring.read_text())["expires_at"]
    until(lambda: time.time() > ends + 0.2, 5, "the invitation's end")
    b = Machine(lan.hosts["gpu-b"], tmp_path / "gpu-b")
    late = b.cli("join", "host", "--join-file", str(expiring), check=False)
    assert late.returncode != 0 and "error [join_refused]" in late.stderr and "expired" in late.stderr

    fresh = json.loads(invite(server, lan, "gpu-b").read_text())
    forged = tmp_path / "forged.join"
    forged.write_text(json.dumps({**fresh, "secret": "A" * 43}))
    refused = b.cli("join", "host", "--join-file", str(forged), check=False)
    assert refused.returncode != 0 and "error [join_refused]" in refused.stderr
    other = tmp_path / "other.join"
    other.write_text(json.dumps({**fresh, "host": "gpu-z"}))
    wrong = b.cli("join", "host", "--join-file", str(other), check=False)
    assert wrong.returncode != 0 and "error [join_refused]" in wrong.stderr
    # a file pinning another CA: the server is refused before the secret is sent, and the file still works
    stranger = a.cli("invite", "host", "nobody", check=False)  # a host has no management API to ask
    assert stranger.returncode != 0
    foreign = tmp_path / "foreign.join"
    foreign.write_text(json.dumps({**fresh, "ca_pem": _another_ca(tmp_path)}))
    pinned = b.cli("join", "host", "--join-file", str(foreign), check=False)
    assert pinned.returncode != 0 and "not signed by the CA pinned" in pinned.stderr
    good = tmp_path / "good.join"
    good.write_text(json.dumps(fresh))
    b.cli("join", "host", "--join-file", str(good))


def test_a_silent_host_is_suspended_then_lost_and_online_again_when_it_speaks(
    lan: Lan, server: Machine, tmp_path: Path
) -> None:
    a = joined(lan, server, "gpu-a", tmp_path)
    assert a.process is not None
    a.process.send_signal(signal.SIGSTOP)
    until(lambda: hosts(server)["gpu-a"]["state"] == "suspended", 6, "gpu-a suspended after SIGSTOP")
    a.process.send_signal(signal.SIGCONT)
    until(lambda: hosts(server)["gpu-a"]["state"] == "online", 6, "gpu-a online after SIGCONT")
    assert a.process.poll() is None  # the same agent, not a new one

    a.node.link_down()
    until(lambda: hosts(server)["gpu-a"]["state"] == "lost", 10, "gpu-a lost with its link down")
    a.node.link_up()
    until(lambda: hosts(server)["gpu-a"]["state"] == "online", 30, "gpu-a online once its link is back")


def test_a_revoked_host_is_cut_off_and_refused_for_ever(lan: Lan, server: Machine, tmp_path: Path) -> None:
    a = joined(lan, server, "gpu-a", tmp_path)
    assert a.process is not None
    server.cli("revoke", "host", "gpu-a")
    assert hosts(server)["gpu-a"]["state"] == "revoked"
    until(lambda: a.process.poll() is not None, 10, "the revoked host's agent exits")  # type: ignore[union-attr]
    assert a.process.returncode != 0
    assert "error [host_revoked]" in a.read_log()
    assert "Traceback" not in a.read_log()  # said in one line, no asyncio traceback on the way out
    again = a.start("host")
    until(lambda: again.poll() is not None, 15, "a revoked host's agent, started again, exits")
    assert again.returncode != 0
    assert hosts(server)["gpu-a"]["state"] == "revoked"
    missing = server.cli("revoke", "host", "gpu-q", check=False)
    assert missing.returncode != 0 and "error [host_not_found]" in missing.stderr


def _another_ca(tmp: Path) -> str:
    from capyctl.adapters.pki import CertificateAuthority

    return CertificateAuthority.load_or_create(tmp / "another-ca").cert_pem.decode()


def test_an_engine_is_registered_from_the_hosts_own_disk(lan: Lan, server: Machine, tmp_path: Path) -> None:
    a = joined(lan, server, "gpu-a", tmp_path)
    binary = str(llama_paths().server)
    added = json.loads(server.cli("engine", "add", binary, "--host", "gpu-a", "--name", "llama", "--json").stdout)
    assert (added["name"], added["family"], added["host"], added["path"]) == ("llama", "llamacpp", "gpu-a", binary)
    assert added["version"]  # read by the host from the binary
    assert [e["name"] for e in hosts(server)["gpu-a"]["engines"]] == ["llama"]
    assert "llama" not in server.cli("engine", "list").stdout  # the server's own engines are not the host's

    missing = server.cli("engine", "add", "/nowhere/llama-server", "--host", "gpu-a", check=False)
    assert missing.returncode == 6 and "error [invalid_engine]" in missing.stderr and "/nowhere" in missing.stderr
    twice = server.cli("engine", "add", binary, "--host", "gpu-a", "--name", "llama", check=False)
    assert twice.returncode == 5 and "error [already_exists]" in twice.stderr
    unknown = server.cli("engine", "add", binary, "--host", "gpu-q", check=False)
    assert unknown.returncode == 4 and "error [host_not_found]" in unknown.stderr

    assert a.process is not None
    a.process.send_signal(signal.SIGSTOP)
    until(lambda: hosts(server)["gpu-a"]["state"] == "suspended", 6, "gpu-a suspended")
    offline = server.cli("engine", "add", binary, "--host", "gpu-a", "--name", "other", check=False)
    assert offline.returncode != 0 and "error [device_offline]" in offline.stderr and "suspended" in offline.stderr
    a.process.send_signal(signal.SIGCONT)
    until(lambda: hosts(server)["gpu-a"]["state"] == "online", 6, "gpu-a online")
    # registered engines are the server's record: kept across a restart of the server
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(30)
    server.start(
        "server", "--listen", f"{lan.server.address}:{INFERENCE_PORT}", "--control-listen", f"0.0.0.0:{CONTROL_PORT}"
    )
    until(lambda: _listed(server, "gpu-a") == "online", 40, "gpu-a linked to the restarted server")
    assert [e["name"] for e in hosts(server)["gpu-a"]["engines"]] == ["llama"]
    assert a.process.poll() is None  # the same agent dialled again


_INGRESS_PROBE = """
import json, socket, ssl, sys
ca, address, port, name = sys.argv[1:5]
context = ssl.create_default_context(cafile=ca)
try:
    with socket.create_connection((address, int(port)), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=name) as tls:
            tls.sendall(b"POST /v1/chat/completions HTTP/1.1\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
            answer = b""
            while chunk := tls.recv(4096):
                answer += chunk
    print(answer.split(b"\\r\\n")[0].decode() if answer else "no answer")
except ssl.SSLCertVerificationError as exc:
    print("refused:", exc.verify_message)
except (ssl.SSLError, OSError) as exc:
    print("closed:", type(exc).__name__)
"""


def test_the_hosts_ingress_is_known_by_the_hosts_name_and_answers_no_stranger(
    lan: Lan, server: Machine, tmp_path: Path
) -> None:
    joined(lan, server, "gpu-a", tmp_path)
    listed = hosts(server)["gpu-a"]
    assert listed["ingress"] == f"{lan.hosts['gpu-a'].address}:8444"
    ca = str(server.state / "identity" / "ca" / "ca-cert.pem")
    address = lan.hosts["gpu-a"].address

    def probe(name: str) -> str:
        return server.node.run([sys.executable, "-c", _INGRESS_PROBE, ca, address, "8444", name]).stdout.strip()

    # the server's CA vouches for gpu-a; but a caller without the server's own certificate gets no answer
    # (tests/integration/several/test_trust.py: its handshake fails)
    assert probe("gpu-a") in ("no answer", "closed: SSLError")
    assert probe("gpu-b").startswith("refused: Hostname mismatch")  # not the host it means to reach
