"""Trust between machines, in network namespaces: a host is the certificate it holds now, an ingress lets in the
server's own certificate only, and what reaches an ingress from a caller with a valid gate key is parsed
strictly.

- An impostor at a host's address, showing that host's revoked certificate (signed by the server's CA, in the
  host's name), receives no byte of any request; the client gets ``503 device_offline``, never an address.
- A TLS client without the server's certificate (none, or a host's) cannot complete a handshake with an
  ingress.
- With the server's certificate and a launch's gate key (``play_server.py`` plays the server to hold them): a
  short body times out with 408, a bare LF and ``Content-Length: +100`` get 400, two pipelined requests are
  both answered, and the engine sees only the whole requests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from capyctl.adapters.pki import CertificateAuthority, host_key_and_csr
from tests.fakes.standin_engine import read_timeline
from tests.fakes.standin_venv import make_standin_venv
from tests.integration.machines import CONTROL_PORT, INFERENCE_PORT, Machine, hosts, invite, joined, until
from tests.integration.netns import Lan
from tests.integration.several.test_serving import deploy, key_of

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]


def test_an_impostor_with_a_revoked_certificate_receives_no_byte(lan: Lan, server: Machine, tmp_path: Path) -> None:
    first = joined(lan, server, "gpu-a", tmp_path)
    revoked = tmp_path / "revoked-identity"
    shutil.copytree(first.state / "identity", revoked)  # what the impostor holds: gpu-a's certificate and key
    server.cli("revoke", "host", "gpu-a")
    until(lambda: first.process is not None and first.process.poll() is not None, 15, "the revoked agent's end")
    # gpu-a joins again: a new certificate; its agent's ingress listens on its loopback only, so that the
    # impostor can take gpu-a's address and the port the hello names
    again = Machine(lan.hosts["gpu-a"], tmp_path / "gpu-a-again")
    again.cli("join", "host", "--join-file", str(invite(server, lan, "gpu-a")))
    again.start("host", "--ingress-listen", "127.0.0.1:8444")
    until(lambda: hosts(server)["gpu-a"]["state"] == "online", 20, "gpu-a online with its new certificate")
    venv = make_standin_venv(tmp_path / "vllm", "vllm", "0.32.0")
    server.cli("engine", "add", str(venv), "--host", "gpu-a", "--name", "vllm")
    deploy(server, tmp_path, "chat-a", "vllm", "gpu-a", str(tmp_path / "model"))
    received = tmp_path / "impostor.bytes"
    impostor = lan.hosts["gpu-a"].popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import socket, ssl, sys
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain({str(revoked / "host-cert.pem")!r}, {str(revoked / "host-key.pem")!r})
        listener = socket.create_server(({lan.hosts["gpu-a"].address!r}, 8444))
        print("listening", flush=True)
        while True:
            conn, _ = listener.accept()
            conn.settimeout(5)
            try:
                with tls.wrap_socket(conn, server_side=True) as wrapped:
                    while data := wrapped.recv(65536):
                        with open({str(received)!r}, "ab") as out:
                            out.write(data)
            except (OSError, ssl.SSLError):
                pass
    """),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:
        assert impostor.stdout is not None and impostor.stdout.readline().strip() == b"listening"
        answer = httpx.post(
            f"http://{lan.server.address}:{INFERENCE_PORT}/v1/chat/completions",
            timeout=30,
            json={"model": "chat-a", "messages": [{"role": "user", "content": "secret prompt"}]},
            headers={"authorization": f"Bearer {key_of(server)}"},
        )
    finally:
        impostor.kill()
        impostor.wait()
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "device_offline" and error["model"] == "chat-a" and int(answer.headers["retry-after"]) >= 1
    assert "certificate" in error["message"]
    assert lan.hosts["gpu-a"].address not in answer.text and "8444" not in answer.text  # no internal address
    assert not received.exists() or received.read_bytes() == b""  # not a byte: no prompt, no gate key


def test_only_the_servers_certificate_completes_a_handshake_with_an_ingress(
    lan: Lan, server: Machine, tmp_path: Path
) -> None:
    a = joined(lan, server, "gpu-a", tmp_path)
    b = joined(lan, server, "gpu-b", tmp_path)
    ca = server.state / "identity" / "ca" / "ca-cert.pem"
    # another CA's certificate in gpu-a's name, too: what a stranger could make
    stranger_key, stranger_csr = host_key_and_csr("gpu-a")
    stranger = CertificateAuthority.load_or_create(tmp_path / "stranger-ca").sign_host(stranger_csr, "gpu-a")
    (tmp_path / "stranger-cert.pem").write_bytes(stranger)
    (tmp_path / "stranger-key.pem").write_bytes(stranger_key)
    clients = {
        "none": None,
        "gpu-a's own": a.state / "identity",
        "gpu-b's": b.state / "identity",
        "a stranger's": tmp_path,
    }
    for label, identity in clients.items():
        chain = ""
        if identity is not None:
            prefix = "stranger" if identity == tmp_path else "host"
            cert, key = str(identity / f"{prefix}-cert.pem"), str(identity / f"{prefix}-key.pem")
            chain = f"tls.load_cert_chain({cert!r}, {key!r})"
        done = lan.server.run(
            [
                sys.executable,
                "-c",
                textwrap.dedent(f"""
            import socket, ssl
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            tls.load_verify_locations({str(ca)!r})
            tls.maximum_version = ssl.TLSVersion.TLSv1_2  # the handshake's own verdict, before any HTTP
            {chain}
            with socket.create_connection(({lan.hosts["gpu-a"].address!r}, 8444), timeout=10) as raw:
                try:
                    with tls.wrap_socket(raw, server_hostname="gpu-a") as conn:
                        print("handshake completed")
                except ssl.SSLError as error:
                    print("handshake failed:", error.reason)
        """),
            ],
            cwd=REPO,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("handshake failed"), f"{label}: {done.stdout}"


def test_a_caller_with_a_valid_gate_key_is_parsed_strictly(lan: Lan, tmp_path: Path) -> None:
    played = tmp_path / "played"
    played.mkdir()
    venv = make_standin_venv(tmp_path / "vllm", "vllm", "0.32.0")
    timeline = tmp_path / "timeline.jsonl"
    address = f"{lan.server_address_for['gpu-a']}:{CONTROL_PORT}"
    log = open(tmp_path / "play_server.log", "wb")  # noqa: SIM115 - closed below, after the process
    player = lan.server.popen(
        [
            sys.executable,
            "-m",
            "tests.integration.several.play_server",
            str(played),
            address,
            str(venv),
            str(tmp_path / "model"),
            str(timeline),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:
        until(lambda: (played / "gpu-a.join").exists() or player.poll() is not None, 30, "the join file")
        host = Machine(lan.hosts["gpu-a"], tmp_path / "gpu-a")
        host.cli("join", "host", "--join-file", str(played / "gpu-a.join"))
        (host.state / "config.yaml").write_text("limits:\n  client_body_timeout: 1s\n")
        host.start("host")
        until(lambda: (played / "results.json").exists() or player.poll() is not None, 90, "the probes' results")
        results = json.loads((played / "results.json").read_text())
    finally:
        player.terminate()
        player.wait(10)
        log.close()
    assert results["whole"] == [200]  # the gate key and the certificate are good
    assert results["short_body"] == [408]  # a body shorter than its length: timed out with a status
    assert results["bare_lf"] == [400] and results["plus_length"] == [400]
    assert results["pipelined"] == [200, 200]  # both answered, in order
    received = [line for line in read_timeline(timeline) if line["event"] == "received"]
    assert len(received) == 3  # the whole one and the two pipelined: nothing of the refused ones
