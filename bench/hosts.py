"""Several machines' relay: server -> host's ingress (TLS) -> engine, against the engine reached directly from the
host and against two chained nginx (TLS between them) on the same path, in one run. Needs root (``ip netns``).

    sudo python bench/hosts.py [--rounds 3] [--seconds 2] [--concurrency 1,32] [--paced 30]

Two network namespaces stand for two machines: the server's and one host's (``gpu-a``), joined by a veth
pair (tests/integration/netns.py). CapyCTL runs as it would on two machines: ``capyctl start server`` in
the first, ``capyctl join host`` and ``capyctl start host`` in the second. The engine is the replay engine
(a recorded vLLM 0.32.0 stream) launched by the host as a deployment's engine, twice: ``fast`` (no waits:
CPU per chunk) and ``paced`` (the recording's own first-chunk and chunk gaps: time to first token).

Paths, each measured in the same rounds (the next round starts one path later):

- ``direct``: a client in the host's namespace, straight to the engine on the host's loopback;
- ``nginx chain``: a client in the server's namespace -> nginx (plain HTTP, server namespace) -> TLS, the
  host's certificate checked under its name against the server's CA -> nginx (host namespace) -> the engine;
  both with keep-alive pools, no buffering, one worker each;
- ``capyctl``: a client in the server's namespace -> CapyCTL's server (inference API, with its key) -> the
  host's ingress over TLS -> the engine.

Printed: added time to first token p50/p99 over ``--paced`` streams per path and round (path minus direct,
engine at its recorded pace), chunks/s at each concurrency, CPU µs per relayed chunk of the relay's own
processes (CapyCTL: the server and the host agent, whose ingress relays; nginx: both nginx, masters and
workers), and the ratios CapyCTL / nginx chain. nginx is Debian's nginx-light, as in bench/relay.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.relay import (  # noqa: E402
    NGINX_HTTP_BASICS,
    cpu_seconds,
    find_nginx,
    hang_up_delay,
    load,
    paced_ttft,
    tree_cpu_seconds,
)

if TYPE_CHECKING:
    from tests.integration.machines import Machine
    from tests.integration.netns import Node

RECORDING = ROOT / "tests/contract/recordings/vllm/0.32.0"
CASE = "chat_stream_usage"
_LISTENING = re.compile(r"listening on http://[\d.]+:(\d+)")


# --- the client, run inside a namespace: python bench/hosts.py client ... ---------------------------------------
def client(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    host, port, key, body = spec["host"], spec["port"], spec["key"], spec["body"].encode()
    if spec["what"] == "paced":
        firsts = [asyncio.run(paced_ttft(host, port, body, key)) for _ in range(spec["count"])]
        print(json.dumps({"firsts": firsts}))
    elif spec["what"] == "hangup":
        delays = [asyncio.run(hang_up_delay(host, port, body, key, spec["stats"])) for _ in range(spec["count"])]
        print(json.dumps({"delays": delays}))
    else:
        done = asyncio.run(load(host, port, body, key, spec["n"], spec["seconds"], spec["expect"]))
        print(json.dumps({"chunks": done["chunks"], "elapsed": done["elapsed"]}))


# --- the machines -------------------------------------------------------------------------------------------
def replay_venv(root: Path, pace: str) -> Path:
    """A virtualenv CapyCTL registers as vLLM 0.32.0 whose ``python -m vllm...`` runs the replay engine on the
    port CapyCTL gives it."""
    from tests.fakes.standin_venv import make_standin_venv

    make_standin_venv(root, "vllm", "0.32.0")
    python = root / "bin" / "python"
    python.write_text(f"""#!/bin/sh
# bench/hosts.py: vLLM's command line, served by CapyCTL's replay engine ({pace})
if [ "$1" != "-m" ]; then exec {sys.executable} "$@"; fi
port=""; previous=""
for arg in "$@"; do [ "$previous" = "--port" ] && port="$arg"; previous="$arg"; done
exec {sys.executable} -m capyctl.replay --dialect vllm --version 0.32.0 --recordings {RECORDING} \\
    --host 127.0.0.1 --port "$port" --pace {pace}
""")
    python.chmod(0o755)
    return root


NGINX_FRONT = """\
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
user root;
events {{ worker_connections 4096; }}
http {{
{basics}
    upstream back {{ server {upstream}; keepalive 64; }}
    server {{
        listen {listen};
        {certificate}
        location / {{
            proxy_pass {scheme}://back;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            {tls}
        }}
    }}
}}
"""


class ChainedNginx:
    """nginx in the server's namespace (plain HTTP in, TLS out) and nginx in the host's (TLS in, the engine out)."""

    def __init__(self, binary: str, tmp: Path) -> None:
        self.binary, self.tmp = binary, tmp
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        node: Node,
        name: str,
        listen: str,
        upstream: str,
        scheme: str = "http",
        tls: str = "",
        certificate: str = "",
    ) -> None:
        prefix = self.tmp / name
        prefix.mkdir()
        (prefix / "nginx.conf").write_text(
            NGINX_FRONT.format(
                prefix=prefix,
                basics=NGINX_HTTP_BASICS.format(prefix=prefix),
                listen=listen,
                upstream=upstream,
                scheme=scheme,
                tls=tls,
                certificate=certificate,
            )
        )
        with open(prefix / "stdout.log", "ab") as out:
            self.processes.append(
                node.popen(
                    [
                        self.binary,
                        "-p",
                        str(prefix),
                        "-e",
                        str(prefix / "error.log"),
                        "-c",
                        str(prefix / "nginx.conf"),
                        "-g",
                        "daemon off;",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )

    def cpu(self) -> float:
        return sum(tree_cpu_seconds(p.pid) for p in self.processes)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()


def until(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: {what}: not within {timeout} s")
        time.sleep(0.1)


def engine_port(server: Machine, name: str) -> int:
    status = json.loads(server.cli("status", "deployment", name, "--json").stdout)
    log = Path(status["instances"][0]["log"].split(":", 1)[1])
    until(
        lambda: _LISTENING.search(log.read_text(errors="replace")) if log.exists() else None,
        30,
        f"the {name} engine's port in its log",
    )
    match = _LISTENING.search(log.read_text(errors="replace"))
    assert match is not None
    return int(match.group(1))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds of load per path, N and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paced", type=int, default=30, help="paced streams per path and round (first token)")
    parser.add_argument("--hangups", type=int, default=20, help="client hang-ups to time per path (0: none)")
    parser.add_argument("--nginx", default=find_nginx())
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/hosts.py makes network namespaces: run it as root")
    if not args.nginx:
        raise SystemExit("nginx not found: apt-get install nginx-light, or pass --nginx PATH")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from tests.integration.machines import CONTROL_PORT, INFERENCE_PORT, Machine, hosts, invite
    from tests.integration.netns import Lan

    ns = [int(x) for x in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="capyctl-bench-hosts-"))
    nginx = ChainedNginx(args.nginx, tmp)
    with Lan(["gpu-a"]) as lan:
        try:
            server = Machine(lan.server, tmp / "server")
            server.state.mkdir()
            most = max(ns)
            (server.state / "config.yaml").write_text(
                f"queue:\n  max_in_flight_per_instance: {most}\n  max_pending_per_deployment: {most}\n"
                f"  max_pending_total: {most}\n"
            )
            server.start(
                "server", "--listen", f"0.0.0.0:{INFERENCE_PORT}", "--control-listen", f"0.0.0.0:{CONTROL_PORT}"
            )
            until(lambda: (server.state / "management.json").exists(), 30, "the server")
            host = Machine(lan.hosts["gpu-a"], tmp / "gpu-a")
            host.cli("join", "host", "--join-file", str(invite(server, lan, "gpu-a")))
            host.start("host")
            until(lambda: hosts(server)["gpu-a"]["state"] == "online", 30, "gpu-a online")
            for pace in ("fast", "recorded"):
                venv = replay_venv(tmp / f"replay-{pace}", pace)
                server.cli("engine", "add", str(venv), "--host", "gpu-a", "--name", f"replay-{pace}")
                name = "fast" if pace == "fast" else "paced"
                (tmp / f"{name}.yaml").write_text(f"name: {name}\nengine: replay-{pace}\nhost: gpu-a\nmodel: /m\n")
                server.cli("deploy", "model", "--file", str(tmp / f"{name}.yaml"), "--activate", "--wait", timeout=120)
            ports = {name: engine_port(server, name) for name in ("fast", "paced")}
            key = json.loads((server.state / "identity" / "server-credentials.json").read_text())["api_key"]
            identity = host.state / "identity"
            ca = server.state / "identity" / "ca" / "ca-cert.pem"
            address = lan.hosts["gpu-a"].address
            # one chain per engine: the host's nginx (TLS in, with the host's certificate), the server's (TLS out,
            # checking it as CapyCTL does: the server's CA, the host's name)
            certificate = (
                f"ssl_certificate {identity / 'host-cert.pem'}; ssl_certificate_key {identity / 'host-key.pem'};"
            )
            tls = (
                f"proxy_ssl_trusted_certificate {ca}; proxy_ssl_verify on; proxy_ssl_name gpu-a; "
                "proxy_ssl_server_name on; proxy_ssl_session_reuse on;"
            )
            for i, name in enumerate(("fast", "paced")):
                nginx.start(
                    lan.hosts["gpu-a"],
                    f"back-{name}",
                    f"{address}:{9444 + i} ssl",
                    f"127.0.0.1:{ports[name]}",
                    certificate=certificate,
                )
                nginx.start(lan.server, f"front-{name}", f"0.0.0.0:{9440 + i}", f"{address}:{9444 + i}", "https", tls)
            time.sleep(0.5)  # (nginx has no readiness signal; the warm-up below fails loudly if it is not up)
            server_pid = server.process.pid  # type: ignore[union-attr]
            agent_pid = host.process.pid  # type: ignore[union-attr]

            def body(model: str) -> str:
                messages = '[{"role":"user","content":"hi"}]'
                return f'{{"model":"{model}","stream":true,"replay_case":"{CASE}","messages":{messages}}}'

            expect = (RECORDING / f"{CASE}.sse").read_bytes().count(b"data: ")
            paths = {
                "direct": (
                    lan.hosts["gpu-a"],
                    "127.0.0.1",
                    {"fast": ports["fast"], "paced": ports["paced"]},
                    None,
                    None,
                ),
                "nginx chain": (lan.server, lan.server.address, {"fast": 9440, "paced": 9441}, None, nginx.cpu),
                "capyctl": (
                    lan.server,
                    lan.server.address,
                    {"fast": INFERENCE_PORT, "paced": INFERENCE_PORT},
                    key,
                    lambda: cpu_seconds(server_pid) + cpu_seconds(agent_pid),
                ),
            }

            def run_client(path: str, spec: dict) -> dict:
                node, where, port_of, auth, _ = paths[path]
                model = spec.pop("model")
                spec.update(host=where, port=port_of[model], key=auth, body=body(model), expect=expect)
                done = node.run(
                    [sys.executable, str(Path(__file__).resolve()), "client", json.dumps(spec)], timeout=600
                )
                if done.returncode != 0:
                    raise SystemExit(f"bench: the {path} client failed: {done.stdout}{done.stderr}")
                return json.loads(done.stdout)

            for path in paths:  # warm-up: connections, first-use code
                run_client(path, {"what": "load", "model": "fast", "n": 1, "seconds": 0.3})
                run_client(path, {"what": "paced", "model": "paced", "count": 2})
            firsts: dict[str, list[float]] = {p: [] for p in paths}
            added: dict[str, list[float]] = {p: [] for p in paths}
            rates: dict[tuple[str, int], list[float]] = {}
            cpu: dict[tuple[str, int], list[float]] = {}
            names = list(paths)
            for round_ in range(args.rounds):
                order = names[round_ % len(names) :] + names[: round_ % len(names)]
                medians = {}
                for path in order:
                    got = run_client(path, {"what": "paced", "model": "paced", "count": args.paced})["firsts"]
                    firsts[path] += got
                    medians[path] = statistics.median(got)
                for path in names:
                    added[path].append(medians[path] - medians["direct"])
                for n in ns:
                    for path in order:
                        reader = paths[path][4]
                        before = reader() if reader else 0.0
                        got = run_client(path, {"what": "load", "model": "fast", "n": n, "seconds": args.seconds})
                        spent = (reader() - before) if reader else 0.0
                        rates.setdefault((path, n), []).append(got["chunks"] / got["elapsed"])
                        if reader:
                            cpu.setdefault((path, n), []).append(spent / got["chunks"] * 1e6)
            print(
                f"several machines: server -> ingress (TLS) -> engine, {os.cpu_count()} cores, "
                f"{args.rounds} rounds, {args.paced} paced streams per path and round, {args.seconds} s of load "
                f"per path, N and round; nginx {args.nginx}"
            )
            head = f"{'path':<14}{'added TTFT p50 ms':>18}{'ttft p50/p99 ms':>18}" + "".join(
                f"{f'chunks/s @{n}':>15}{f'CPU µs/chunk @{n}':>18}" for n in ns
            )
            print(head)
            for path in names:
                line = f"{path:<14}"
                line += f"{'(baseline)' if path == 'direct' else f'{statistics.median(added[path]) * 1000:.3f}':>18}"
                ordered = sorted(firsts[path])
                p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
                line += f"{statistics.median(ordered) * 1000:>9.2f} /{p99 * 1000:>6.2f}"
                for n in ns:
                    line += f"{statistics.median(rates[(path, n)]):>15.0f}"
                    line += f"{statistics.median(cpu[(path, n)]):>18.1f}" if (path, n) in cpu else f"{'-':>18}"
                print(line)
            if args.hangups:  # from the host's machine: the client reaches the server, and reads the engine's count
                for path in ("nginx chain", "capyctl"):
                    _, _, port_of, auth, _ = paths[path]
                    paced_body = body("fast")[:-1] + ',"replay_pace":"recorded"}'
                    spec = {
                        "what": "hangup",
                        "host": lan.server_address_for["gpu-a"],
                        "port": port_of["fast"],
                        "key": auth,
                        "body": paced_body,
                        "count": args.hangups,
                        "stats": f"http://127.0.0.1:{ports['fast']}/replay/stats",
                    }
                    done = lan.hosts["gpu-a"].run(
                        [sys.executable, str(Path(__file__).resolve()), "client", json.dumps(spec)], timeout=600
                    )
                    if done.returncode != 0:
                        raise SystemExit(f"bench: the {path} hang-up client failed: {done.stdout}{done.stderr}")
                    delays = sorted(json.loads(done.stdout)["delays"])
                    print(
                        f"client hang-up at the {'server' if path == 'capyctl' else 'front nginx'} -> the engine's "
                        f"connection on the host closed, {path}: p50 {statistics.median(delays) * 1000:.2f} ms, "
                        f"p99 {delays[min(len(delays) - 1, int(0.99 * len(delays)))] * 1000:.2f} ms over "
                        f"{len(delays)} streams (includes one stats poll)"
                    )
            capy, chain = statistics.median(added["capyctl"]), statistics.median(added["nginx chain"])
            ratios = f"ratio capyctl / nginx chain: added first token {capy / chain:.2f}" if chain > 0 else ""
            for n in ns:
                ratios += (
                    f", CPU per chunk @{n} "
                    f"{statistics.median(cpu[('capyctl', n)]) / statistics.median(cpu[('nginx chain', n)]):.2f}"
                )
            print(ratios)
            print(
                "(added TTFT: per round, the path's median minus direct's, then the median over rounds; CPU: "
                "the relay's own processes, /proc utime+stime, per relayed data chunk)"
            )
        finally:
            nginx.stop()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
