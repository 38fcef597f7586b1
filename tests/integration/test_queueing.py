"""Queueing on the real llama-server: slots, bounded waiting, refusals with Retry-After, X-LLM-Wait."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import CapyServer, LlamaPaths, deployment_file, engine_metric

pytestmark = pytest.mark.integration
LONG = {
    "messages": [{"role": "user", "content": "Count from one to one hundred in words."}],
    "max_tokens": 48,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def queued(tmp_path_factory: pytest.TempPathFactory, llama: LlamaPaths) -> Iterator[CapyServer]:
    """CapyCTL with 2 slots per instance and 16 places in line, before llama-server --parallel 2."""
    tmp = tmp_path_factory.mktemp("queued")
    config = tmp / "server.yaml"
    config.write_text("queue:\n  max_in_flight_per_instance: 2\n  max_pending_per_deployment: 16\n")
    server = CapyServer(tmp / "state", "--config", str(config)).start()
    try:
        server.cli("engine", "add", str(llama.server), "--name", "llama-server")
        server.cli(
            "deploy", "model", "--file", str(deployment_file(tmp, "smollm2", "llama-server", llama.model)), "--wait"
        )
        yield server
    finally:
        server.stop()


def listed(server: CapyServer) -> dict[str, dict]:
    data = httpx.get(server.base_url + "/v1/models", headers=server.headers(), timeout=10).json()["data"]
    return {m["id"]: m for m in data}


def engine_port(server: CapyServer) -> int:
    return server.cli_json("status", "deployment", "smollm2")["instances"][0]["port"]


class Watcher(threading.Thread):
    """Reads the engine's own count of requests processing until stopped; keeps the largest."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.most, self.reads = port, 0.0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.most = max(self.most, engine_metric(self.port, "llamacpp:requests_processing"))
                self.reads += 1
            except (httpx.HTTPError, AssertionError):
                pass
            self.done.wait(0.05)


def test_forty_at_once_get_eighteen_answers_and_twenty_two_queue_full(queued: CapyServer) -> None:
    watcher = Watcher(engine_port(queued))
    watcher.start()

    async def ask(client: httpx.AsyncClient, n: int) -> httpx.Response:
        return await client.post(
            "/v1/chat/completions",
            json={"model": "smollm2", **LONG, "stream": n % 2 == 0},
            headers={"X-Request-Id": f"q-{n}"},
        )

    async def all_at_once() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=queued.base_url, headers=queued.headers(), timeout=300, limits=limits
        ) as client:
            return await asyncio.gather(*(ask(client, n) for n in range(40)))

    try:
        answers = asyncio.run(all_at_once())
    finally:
        watcher.done.set()
        watcher.join(5)
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 429]
    assert (len(ok), len(refused)) == (18, 22), sorted(r.status_code for r in answers)
    for r in refused:
        error = r.json()["error"]
        assert error["code"] == "queue_full" and "max_pending_per_deployment" in error["reason"]
        assert int(r.headers["retry-after"]) >= 1 and error["retry_after_s"] == int(r.headers["retry-after"])
    for r in ok:  # every answer whole, each its own
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.endswith("data: [DONE]\n\n")
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert len({r.headers["x-capyctl-request-id"] for r in answers}) == 40
    assert sorted(r.headers["x-request-id"] for r in answers) == sorted(f"q-{n}" for n in range(40))
    assert watcher.reads > 0 and 1 <= watcher.most <= 2, (watcher.reads, watcher.most)


def test_x_llm_wait_0_on_a_stopped_model_answers_model_loading_and_starts_it(
    queued: CapyServer, llama: LlamaPaths, tmp_path: Path
) -> None:
    notes = "SmolLM2-135M on CPU: two slots"
    queued.cli(
        "deploy", "model", "--file", str(deployment_file(tmp_path, "cold", "llama-server", llama.model, notes=notes))
    )
    assert queued.cli_json("status", "deployment", "cold")["state"] == "stopped"  # deployed, never started
    before = listed(queued)["cold"]
    assert queued.cli_json("status", "deployment", "cold")["state"] == "stopped"  # listing starts nothing
    assert (before["state"], before["loaded"], before["cold_start_s"]) == ("stopped", False, None)
    assert (before["engine"], before["context_length"], before["notes"]) == ("llamacpp", 4096, notes)
    assert before["capyctl"]["state"] == "stopped" and before["capyctl"]["max_concurrent"] == 2
    assert before["capyctl"]["queue"] == {"in_flight": 0, "waiting": 0}
    r = httpx.post(
        queued.base_url + "/v1/chat/completions",
        timeout=30,
        headers={**queued.headers(), "X-LLM-Wait": "0"},
        json={"model": "cold", **LONG},
    )
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "model_loading" and error["model"] == "cold" and error["state"] == "starting"
    assert int(r.headers["retry-after"]) >= 1 and error["retry_after_s"] == int(r.headers["retry-after"])
    deadline = time.monotonic() + 120  # no other request: it becomes ready by itself
    while (
        state := queued.cli_json("status", "deployment", "cold")["state"]
    ) != "ready" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert state == "ready"
    after = listed(queued)["cold"]
    assert (after["state"], after["loaded"], after["capyctl"]["state"]) == ("loaded", True, "ready")
    assert after["cold_start_s"] == 0.0  # ready: nothing to wait for
    assert after["created"] == before["created"] <= time.time()  # the server's start, not "now"
    r = httpx.post(
        queued.base_url + "/v1/chat/completions",
        timeout=60,
        headers={**queued.headers(), "X-LLM-Wait": "0"},
        json={"model": "cold", **LONG},
    )
    assert r.status_code == 200 and r.json()["model"] == "cold"
    queued.cli("stop", "deployment", "cold")
    stopped = listed(queued)["cold"]
    assert isinstance(stopped["cold_start_s"], float) and stopped["cold_start_s"] > 0  # the start it measured


@pytest.mark.parametrize("value", ["901", "-1", "1.5", "soon", ""])
def test_a_bad_x_llm_wait_is_refused_before_anything_starts(queued: CapyServer, value: str) -> None:
    r = httpx.post(
        queued.base_url + "/v1/chat/completions",
        timeout=30,
        headers={**queued.headers(), "X-LLM-Wait": value},
        json={"model": "smollm2", **LONG},
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_request" and r.json()["error"]["param"] == "X-LLM-Wait"


def scrape(server: CapyServer) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics", headers=server.headers(), timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_waits_and_refusals_are_counted(queued: CapyServer) -> None:
    before = scrape(queued)
    bad_key = httpx.post(
        queued.base_url + "/v1/chat/completions",
        timeout=30,
        headers={"authorization": "Bearer nope"},
        json={"model": "smollm2", **LONG},
    )
    assert bad_key.status_code == 401
    unknown = httpx.post(
        queued.base_url + "/v1/chat/completions", timeout=30, headers=queued.headers(), json={"model": "nope", **LONG}
    )
    assert unknown.status_code == 404

    async def burst() -> list[int]:
        async with httpx.AsyncClient(
            base_url=queued.base_url, headers=queued.headers(), timeout=300, limits=httpx.Limits(max_connections=64)
        ) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json={"model": "smollm2", **LONG}) for _ in range(24))
            )
            return [r.status_code for r in answers]

    statuses = asyncio.run(burst())
    after = scrape(queued)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("capyctl_refusals_total", code="invalid_api_key") == 1
    assert grew("capyctl_refusals_total", code="model_not_found") == 1
    assert grew("capyctl_refusals_total", code="queue_full") == statuses.count(429) == 24 - 18
    assert grew("capyctl_queue_wait_seconds_count", deployment="smollm2") == 16  # those that waited in line
    assert after[("capyctl_requests_waiting", (("deployment", "smollm2"),))] == 0
    assert after[("capyctl_requests_in_flight", (("deployment", "smollm2"),))] == 0
