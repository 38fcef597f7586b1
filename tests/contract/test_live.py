"""Live contract checks: a real engine reached directly and through CapyCTL gives the same stream.

Always run against a real llama-server (SmolLM2) started here; add your own
engines with ``--live-engine FAMILY[@VERSION]=URL``. Greedy decoding and no
prompt cache make the engine's answers repeatable, so what CapyCTL relays
can be compared with what the engine sends directly.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.integration.harness import CapyServer, free_port, llama_paths

VOLATILE = ("id", "created", "system_fingerprint", "timings", "metrics", "model")
REQUEST = {
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 24,
    "temperature": 0,
    "seed": 1,
}


@pytest.fixture(scope="module")
def live_capy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CapyServer]:
    server = CapyServer(tmp_path_factory.mktemp("live") / "state").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def engine(live_target: object, tmp_path: Path) -> Iterator[tuple[str, str | None, str, dict]]:
    """(family, declared version, URL, extra request fields) of the engine under test."""
    if live_target != "spawned-llama-server":
        family, version, url = live_target  # type: ignore[misc]
        yield family, version, url, {}
        return
    paths, port = llama_paths(), free_port()
    probe = subprocess.run([str(paths.server), "--version"], capture_output=True, text=True)
    assert "version: 0.6.0" in probe.stdout + probe.stderr, "the live contract run expects llama.cpp 0.6.0"
    process = subprocess.Popen(
        [
            str(paths.server),
            "-m",
            str(paths.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics",
            "-c",
            "2048",
            "--parallel",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield "llamacpp", "0.6.0", url, {"cache_prompt": False}
    finally:
        process.terminate()
        process.wait(10)


def _stream(url: str, body: dict, headers: dict[str, str]) -> list[dict | str]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    out: list[dict | str] = []
    for event in (e for e in text.split("\n\n") if e.startswith("data: ")):
        out.append("[DONE]" if event == "data: [DONE]" else msgspec.json.decode(event[6:]))
    return out


def _stable(event: dict | str) -> dict | str:
    return event if isinstance(event, str) else {k: v for k, v in event.items() if k not in VOLATILE}


def test_live_engine_relayed_unchanged(live_capy: CapyServer, engine: tuple, tmp_path: Path) -> None:
    family, version, url, extra = engine
    name = f"live-{family}"
    engine_model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    doc = {"name": name, "engine": family, "endpoint": url, "model": engine_model}
    if version:
        doc["engine_version"] = version
    path = tmp_path / "live.yaml"
    path.write_bytes(msgspec.yaml.encode(doc))
    live_capy.cli("deploy", "model", "--file", str(path))
    served_as = live_capy.cli_json("status", "deployment", name)
    for stream_options in (None, {"include_usage": True}):
        body = {**REQUEST, **extra, "stream": True}
        if stream_options:
            body["stream_options"] = stream_options
        direct = _stream(url, {**body, "model": engine_model}, {})
        relayed = _stream(live_capy.base_url, {**body, "model": name}, live_capy.headers())
        assert all(isinstance(e, str) or "error" not in e for e in relayed), relayed[-1]
        assert [_stable(e) for e in relayed] == [_stable(e) for e in direct]
        assert all(e["model"] == name for e in relayed if isinstance(e, dict))
    plain = httpx.post(
        live_capy.base_url + "/v1/chat/completions",
        headers=live_capy.headers(),
        timeout=120,
        json={**REQUEST, **extra, "model": name},
    ).json()
    text = "".join(
        (e["choices"][0]["delta"].get("content") or "") for e in direct if isinstance(e, dict) and e["choices"]
    )
    assert plain["choices"][0]["message"]["content"] == text
    assert plain["model"] == name and plain["usage"]["completion_tokens"] > 0
    assert served_as["fields"]["verified"], served_as["fields"]
    live_capy.cli("delete", "deployment", name)
