"""Deployments' lifecycle through the CLI and the HTTP surface, on real llama-server processes."""

import os
import stat
import threading
import time
from pathlib import Path

import httpx
import msgspec

from tests.integration.harness import CapyServer, LlamaPaths, deployment_file, engine_metric, pid_alive, started_at

HELLO = [{"role": "user", "content": "Hello"}]
LONG = {"max_tokens": 1500, "ignore_eos": True, "messages": [{"role": "user", "content": "Count to 1000."}]}


def deploy(capy: CapyServer, llama: LlamaPaths, tmp_path: Path, *flags: str) -> None:
    capy.cli("engine", "add", str(llama.server), "--name", "llama-server")
    capy.cli(
        "deploy", "model", "--file", str(deployment_file(tmp_path, "smollm2", "llama-server", llama.model)), *flags
    )


def status(capy: CapyServer) -> dict:
    return capy.cli_json("status", "deployment", "smollm2")


def test_credentials_are_private_and_survive_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = CapyServer(state).start()
    try:
        key = first.api_key
        credentials = state / "identity" / "credentials"
        assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
        assert stat.S_IMODE(credentials.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE((state / "identity" / "admin-token").stat().st_mode) == 0o600
        assert len(key) >= 22 and key not in first.log()  # >= 128 bits, never logged
    finally:
        assert first.stop() == 0
    second = CapyServer(state).start()
    try:
        assert second.api_key == key
        assert httpx.get(second.base_url + "/v1/models", headers=second.headers()).status_code == 200
    finally:
        second.stop()


def test_listing_never_starts_but_a_request_does(capy: CapyServer, llama: LlamaPaths, tmp_path: Path) -> None:
    deploy(capy, llama, tmp_path)
    listed = httpx.get(capy.base_url + "/v1/models", headers=capy.headers()).json()
    assert listed["object"] == "list"
    assert [(m["id"], m["object"], m["capyctl"]["api"]) for m in listed["data"]] == [("smollm2", "model", "chat")]
    assert status(capy)["state"] == "stopped" and status(capy)["instances"][0]["pid"] is None
    assert status(capy)["desired"] == "on_demand"
    asked = time.time()  # the three status calls above took well over the half second the test once slept
    r = httpx.post(
        capy.base_url + "/v1/chat/completions",
        headers=capy.headers(),
        timeout=120,
        json={"model": "smollm2", "messages": HELLO, "max_tokens": 8},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert (status(capy)["state"], status(capy)["desired"]) == ("ready", "run")  # the request asked for it
    # the proof that the listing started nothing: the engine's one start came after the request was sent
    events = map(msgspec.json.decode, capy.cli("events", "--deployment", "smollm2", "--json").stdout.splitlines())
    starts = [e["at"] for e in events if e["kind"] == "state_changed" and e["detail"]["state"] == "starting"]
    assert len(starts) == 1 and starts[0] >= asked, (starts, asked)


def test_operator_stop_is_sticky_until_started(capy: CapyServer, llama: LlamaPaths, tmp_path: Path) -> None:
    deploy(capy, llama, tmp_path, "--wait")
    pid = status(capy)["instances"][0]["pid"]
    capy.cli("stop", "deployment", "smollm2")
    assert not pid_alive(pid)
    r = httpx.post(
        capy.base_url + "/v1/chat/completions",
        headers=capy.headers(),
        json={"model": "smollm2", "messages": HELLO, "max_tokens": 4},
    )
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "deployment_stopped"
    assert "capyctl start deployment smollm2" in r.json()["error"]["message"]
    assert (status(capy)["state"], status(capy)["desired"]) == ("stopped", "stop")
    shown = capy.cli("status", "deployment", "smollm2").stdout
    assert "desired     stop  (an operator's stop: only `capyctl start deployment` starts it)" in shown
    capy.cli("start", "deployment", "smollm2", "--wait")
    assert status(capy)["desired"] == "run"
    r = httpx.post(
        capy.base_url + "/v1/chat/completions",
        headers=capy.headers(),
        timeout=60,
        json={"model": "smollm2", "messages": HELLO, "max_tokens": 4},
    )
    assert r.status_code == 200


def test_a_crashed_engine_is_restarted_and_its_requests_get_502(
    capy: CapyServer, llama: LlamaPaths, tmp_path: Path
) -> None:
    deploy(capy, llama, tmp_path, "--wait")
    before = status(capy)["instances"][0]
    results: dict[str, object] = {}

    def non_streamed() -> None:
        results["plain"] = httpx.post(
            capy.base_url + "/v1/chat/completions",
            headers=capy.headers(),
            timeout=60,
            json={"model": "smollm2", **LONG},
        )

    def streamed() -> None:
        with httpx.stream(
            "POST",
            capy.base_url + "/v1/chat/completions",
            headers=capy.headers(),
            timeout=60,
            json={"model": "smollm2", "stream": True, **LONG},
        ) as r:
            results["stream_status"] = r.status_code
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                streaming.set()
            results["stream"] = "\n".join(lines)

    streaming = threading.Event()
    threads = [threading.Thread(target=non_streamed), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    assert streaming.wait(60), "the stream never started"
    port = before["port"]
    deadline = time.monotonic() + 30
    while engine_metric(port, "llamacpp:requests_processing") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # both requests are generating
    os.kill(before["pid"], 9)
    for t in threads:
        t.join(60)
    plain = results["plain"]
    assert plain.status_code == 502 and plain.json()["error"]["code"] == "engine_restarted"
    assert plain.json()["error"]["model"] == "smollm2"
    assert results["stream_status"] == 200
    last = [e for e in str(results["stream"]).split("\n") if e][-1]
    assert msgspec.json.decode(last[len("data: ") :])["error"]["code"] == "engine_restarted"
    deadline = time.monotonic() + 30
    while (after := status(capy)["instances"][0])["state"] != "ready" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after["state"] == "ready" and after["restarts"] == 1 and after["pid"] != before["pid"]
    assert "exited with status -9" in after["last_error"]
    kinds = [
        e["kind"]
        for e in map(msgspec.json.decode, capy.cli("events", "--deployment", "smollm2", "--json").stdout.splitlines())
    ]
    assert "engine_crashed" in kinds and kinds.count("engine_started") == 2
    r = httpx.post(
        capy.base_url + "/v1/chat/completions",
        headers=capy.headers(),
        timeout=60,
        json={"model": "smollm2", "messages": HELLO, "max_tokens": 4},
    )
    assert r.status_code == 200


def test_sigterm_stops_every_engine(capy: CapyServer, llama: LlamaPaths, tmp_path: Path) -> None:
    deploy(capy, llama, tmp_path, "--wait")
    pid = status(capy)["instances"][0]["pid"]
    assert pid_alive(pid)
    assert capy.stop() == 0
    assert not pid_alive(pid)
    assert "every engine is stopped" in capy.log()


def test_engine_log_files_are_per_launch(capy: CapyServer, llama: LlamaPaths, tmp_path: Path) -> None:
    deploy(capy, llama, tmp_path, "--wait")
    first = status(capy)["instances"][0]["log"]
    capy.cli("stop", "deployment", "smollm2")
    capy.cli("start", "deployment", "smollm2", "--wait")
    second = status(capy)["instances"][0]["log"]
    assert first != second
    assert Path(first).parent == Path(second).parent == capy.state_dir / "logs" / "smollm2"
    assert "llama" in Path(second).read_text(errors="replace").lower()


def test_no_orphan_engine_when_capyctl_is_killed(capy: CapyServer, llama: LlamaPaths, tmp_path: Path) -> None:
    deploy(capy, llama, tmp_path, "--wait")
    pid = status(capy)["instances"][0]["pid"]
    started = started_at(pid)  # the engine's own start: a later process given the same pid is not it
    assert started is not None
    capy.process.kill()  # SIGKILL: CapyCTL gets no chance to stop its engines itself
    capy.process.wait()
    deadline = time.monotonic() + 10
    while pid_alive(pid, started) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid, started):
        with open(f"/proc/{pid}/status") as proc:
            state = [line for line in proc.read().splitlines() if line.startswith(("State", "SigCgt", "SigPnd"))]
        raise AssertionError(f"the engine outlived CapyCTL: {state}")
