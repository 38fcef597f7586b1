"""Parking and waking through a real CapyCTL, with the stand-in engine managed as vLLM 0.32.0 (host_backed).

The stand-in (tests/fakes/standin_engine.py) speaks vLLM's sleep routes and
writes a timeline of its states and of every control call it receives, so
the tests read the exact order of the park and wake sequences, and check
that the engines' footprints never exceeded the device.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.fakes.standin_engine import calls, expected_text, intervals, read_timeline
from tests.fakes.standin_venv import make_standin_venv
from tests.integration.harness import CapyServer

pytestmark = pytest.mark.integration
GiB = 2**30
CAPACITY = 7 * GiB  # two awake stand-ins of 4 GiB do not fit; one awake and one parked (1 GiB) do
AWAKE, PARKED = 4 * GiB, 1 * GiB
QUESTION = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 6, "temperature": 0}


class Parking:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.timeline = tmp / "timeline.jsonl"
        config = tmp / "server.yaml"
        config.write_text(
            "memory:\n  devices:\n    - name: gpu0\n      capacity: 7GiB\nswitching:\n  admission_window: 500ms\n"
        )
        self.server = CapyServer(tmp / "state", "--config", str(config))

    def deploy(self, name: str, residency: str = "host_backed", **env: str) -> None:
        path = self.tmp / f"{name}.yaml"
        path.write_bytes(
            msgspec.yaml.encode(
                {
                    "name": name,
                    "engine": "vllm",
                    "model": str(self.tmp / "model"),
                    "residency": residency,
                    "resources": {"memory": "4GiB", "parked_memory": "1GiB"},
                    "engine_config": {"env": {"STANDIN_TIMELINE": str(self.timeline), "STANDIN_LOAD_S": "0.3", **env}},
                }
            )
        )
        self.server.cli("deploy", "model", "--file", str(path))

    def ask(self, name: str, **extra: Any) -> httpx.Response:
        return httpx.post(
            self.server.base_url + "/v1/chat/completions",
            headers=self.server.headers(),
            json={"model": name, **QUESTION, **extra},
            timeout=60,
        )

    def status(self, name: str) -> dict[str, Any]:
        return self.server.cli_json("status", "deployment", name)

    def events(self, kind: str) -> list[dict[str, Any]]:
        out = self.server.cli("events", "--json").stdout
        return [
            e for e in (msgspec.json.decode(line) for line in out.splitlines() if line.strip()) if e["kind"] == kind
        ]

    def lines(self) -> list[dict[str, Any]]:
        return read_timeline(self.timeline)


@pytest.fixture(scope="module")
def parking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parking]:
    tmp = tmp_path_factory.mktemp("parking")
    (tmp / "model").mkdir()
    world = Parking(tmp)
    world.server.start()
    try:
        venv = make_standin_venv(tmp / "vllm-venv", "vllm", "0.32.0")
        world.server.cli("engine", "add", str(venv), "--name", "vllm")
        world.deploy("alpha")
        world.deploy("beta")
        world.deploy("gamma", STANDIN_MODE="wrong_after_wake")
        world.deploy("delta", "deep")
        yield world
    finally:
        world.server.stop()


def most_charged(lines: list[dict[str, Any]]) -> int:
    """The largest sum of footprints at any moment, from the stand-ins' own timelines."""
    changes: list[tuple[float, int]] = []
    for _name, _pid, state, start, end in intervals(lines):
        size = PARKED if state == "asleep" else AWAKE
        changes.append((start, size))
        if end is not None:
            changes.append((end, -size))
    most = now = 0
    for _at, delta in sorted(changes, key=lambda c: (c[0], c[1])):  # ends before starts at the same instant
        now += delta
        most = max(most, now)
    return most


def until(condition: Any, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_switch_parks_the_idle_model_and_a_request_wakes_it_with_the_same_answers(parking: Parking) -> None:
    first = parking.ask("alpha")
    assert first.status_code == 200, first.text
    text = first.json()["choices"][0]["message"]["content"]
    assert text == expected_text({"model": "alpha", **QUESTION})
    assert parking.ask("beta").status_code == 200  # no room for two awake: alpha parks (host_backed)
    assert parking.status("alpha")["state"] == "parked"
    memory = parking.status("alpha")["memory"]
    assert (memory["holding"], memory["charged_bytes"]) == ("parked", PARKED)
    alpha_calls = calls(parking.lines(), "alpha")
    assert ("/sleep", "level=1&mode=wait") in alpha_calls  # never the default mode, which aborts
    again = parking.ask("alpha")  # wakes alpha, parking beta
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == text
    sequence = [c for c in calls(parking.lines(), "alpha") if c[0] != "/sleep"]
    assert sequence[-3:] == [("/wake_up", "tags=weights"), ("/wake_up", "tags=kv_cache"), ("/reset_prefix_cache", "")]
    assert parking.status("alpha")["state"] == "ready" and parking.status("beta")["state"] == "parked"
    assert parking.events("woken") and parking.events("parked") and parking.events("switch_completed")
    assert not parking.events("wake_mismatch")
    devices = parking.server.cli_json("list", "devices")
    assert devices[0]["charged_bytes"] == AWAKE + PARKED
    assert {h["deployment"]: h["bytes"] for h in devices[0]["holders"]} == {"alpha": AWAKE, "beta": PARKED}


def test_an_operators_park_then_start_wakes_it(parking: Parking) -> None:
    assert parking.ask("alpha").status_code == 200
    parked = parking.server.cli_json("park", "deployment", "alpha")
    assert parked["state"] == "parked" and parked["desired"] == "park"
    woken = parking.server.cli_json("start", "deployment", "alpha", "--wait")
    assert woken["state"] == "ready"
    assert parking.ask("alpha").json()["choices"][0]["message"]["content"] == expected_text(
        {"model": "alpha", **QUESTION}
    )


def test_a_park_waits_for_the_requests_at_the_engine_and_aborts_none(parking: Parking) -> None:
    import threading

    assert parking.ask("alpha").status_code == 200
    got: dict[str, Any] = {}

    def long_stream() -> None:  # about a second of tokens at the stand-in's 5 ms a token
        with httpx.stream(
            "POST",
            parking.server.base_url + "/v1/chat/completions",
            headers=parking.server.headers(),
            json={"model": "alpha", **QUESTION, "max_tokens": 200, "stream": True},
            timeout=60,
        ) as r:
            got["status"] = r.status_code
            got["body"] = "".join(r.iter_text())
            got["ended"] = time.time()

    reader = threading.Thread(target=long_stream)
    reader.start()
    until(lambda: "status" in got)
    parking.server.cli("park", "deployment", "alpha")
    parked_at = time.time()
    reader.join(60)
    assert got["status"] == 200 and got["body"].rstrip().endswith("data: [DONE]")
    assert '"finish_reason":"length"' in got["body"]  # the whole answer: nothing was cut
    assert got["ended"] <= parked_at  # the park came back only after the stream had ended
    assert not [line for line in parking.lines() if line.get("event") == "aborted"]  # the engine aborted nothing
    assert parking.status("alpha")["state"] == "parked"


def test_a_woken_engine_that_answers_differently_is_stopped_with_wake_mismatch(parking: Parking) -> None:
    assert parking.ask("gamma").status_code == 200
    pid = parking.status("gamma")["instances"][0]["pid"]
    parking.server.cli("park", "deployment", "gamma")
    r = parking.ask("gamma")  # the wake's canary differs: that engine is stopped, a fresh one answers
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == expected_text({"model": "gamma", **QUESTION})
    (mismatch,) = parking.events("wake_mismatch")
    assert mismatch["deployment"] == "gamma"
    assert parking.status("gamma")["instances"][0]["pid"] != pid  # a new engine process
    stopped = [line for line in parking.lines() if line["pid"] == pid and line["state"] == "stopped"]
    assert stopped  # the mismatched engine is gone


def test_a_deep_park_drops_the_weights_and_the_wake_reloads_them(parking: Parking) -> None:
    assert parking.ask("delta").status_code == 200
    parking.server.cli("park", "deployment", "delta")
    r = parking.ask("delta")
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == expected_text({"model": "delta", **QUESTION})
    sequence = calls(parking.lines(), "delta")
    assert sequence[-5:] == [
        ("/sleep", "level=2&mode=wait"),
        ("/wake_up", "tags=weights"),
        ("/collective_rpc", ""),
        ("/wake_up", "tags=kv_cache"),
        ("/reset_prefix_cache", ""),
    ]
    assert not [e for e in parking.events("wake_mismatch") if e["deployment"] == "delta"]


def test_prometheus_counts_parks_wakes_switches_and_memory(parking: Parking) -> None:
    text = httpx.get(parking.server.base_url + "/metrics", headers=parking.server.headers(), timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['capyctl_parks_total{deployment="alpha",why="switch"}'] >= 1
    assert samples['capyctl_parks_total{deployment="alpha",why="operator"}'] >= 1
    assert samples['capyctl_wakes_total{deployment="alpha"}'] >= 2
    assert (
        samples['capyctl_wake_seconds_count{deployment="alpha"}'] == samples['capyctl_wakes_total{deployment="alpha"}']
    )
    assert samples['capyctl_switches_total{device="gpu0",outcome="completed"}'] >= 2
    assert samples['capyctl_memory_capacity_bytes{device="gpu0",kind="capacity"}'] == CAPACITY
    charged = sum(v for k, v in samples.items() if k.startswith("capyctl_memory_charged_bytes{"))
    assert 0 < charged <= CAPACITY
    assert charged == parking.server.cli_json("list", "devices")[0]["charged_bytes"]


def test_the_engines_footprints_never_exceeded_the_device(parking: Parking) -> None:
    """Runs last in this module: everything the tests above did, read back from the stand-ins' timelines."""
    lines = parking.lines()
    assert len({line["pid"] for line in lines}) >= 4  # several engines came and went
    assert AWAKE + PARKED <= most_charged(lines) <= CAPACITY
    shown = parking.server.cli("status", "deployment", "alpha").stdout
    assert "switch      last on gpu0: for" in shown and "memory      " in shown
