"""Several instances of one model on three hosts, in network namespaces, with stand-in vLLM engines that log
every request they see (``STANDIN_HEADS``: each request's marker, the text of its last message):

- a burst of 64 streams is spread within 15 % of even; under sustained load an engine made slow (its
  running count stays high) gets measurably fewer;
- SIGKILL one host's agent (its engine goes with it) mid-run: every request sent elsewhere is answered in
  full, every stream that was at the killed host ends with an error event (none cut short silently), no
  request reaches two engines, and each ``router_failover`` names a cause where nothing was sent;
- SIGSTOP one host's agent: once it reads ``suspended`` no new request goes there; what was in flight there
  ends with ``device_offline`` within ``hosts.lost_after`` (plus the server's look), never later;
- drain a host: its instance moves (a replacement starts where there is room, the old one stops after its
  streams), ``list hosts`` shows draining then drained, no client sees an error; undrain; a host frozen past
  ``lost_after`` + ``replace_after`` has its instance replaced, and the old engine, which ran on all along,
  is stopped when the host comes back.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import msgspec
import pytest

from tests.fakes.standin_venv import make_standin_venv
from tests.integration.machines import INFERENCE_PORT, Machine, hosts, joined, until
from tests.integration.netns import Lan, available
from tests.integration.several.conftest import start_server
from tests.integration.several.test_serving import key_of

pytestmark = pytest.mark.integration
NAMES = ("gpu-a", "gpu-b", "gpu-c")
UNSENT = {"connection_refused", "tls_failed", "not_forwarded", "gate_closed", "host_away"}


class Three(NamedTuple):
    lan: Lan
    server: Machine
    hosts: dict[str, Machine]
    key: str
    timeline: Path


@pytest.fixture
def lan3() -> Iterator[Lan]:
    why = available()
    if why is not None:
        pytest.fail(why)
    with Lan(list(NAMES)) as made:
        yield made


def three_hosts(lan: Lan, tmp: Path, instances: int = 3) -> Three:
    """The server (``replace_after`` 3 s), three hosts with a stand-in vLLM each (5 ms a token), and ``chat``
    deployed with ``instances``, all ready."""
    server = start_server(lan, tmp, config="  replace_after: 3s\n")
    venv = make_standin_venv(tmp / "vllm", "vllm", "0.32.0")
    machines = {}
    for name in NAMES:
        machines[name] = joined(lan, server, name, tmp, env={"STANDIN_TOKEN_DELAY_MS": "5"})
        server.cli("engine", "add", str(venv), "--host", name, "--name", "vllm")
    timeline = tmp / "timeline.jsonl"
    document = {
        "name": "chat",
        "engine": "vllm",
        "model": str(tmp / "model"),
        "instances": instances,
        "engine_config": {"env": {"STANDIN_TIMELINE": str(timeline), "STANDIN_HEADS": "1"}},
    }
    path = tmp / "chat.yaml"
    path.write_bytes(msgspec.yaml.encode(document))
    server.cli("deploy", "model", "--file", str(path), "--activate", "--wait", timeout=180)
    return Three(lan, server, machines, key_of(server), timeline)


def status(three: Three) -> dict[str, Any]:
    return json.loads(three.server.cli("status", "deployment", "chat", "--json").stdout)  # type: ignore[no-any-return]


def events(three: Three, kind: str) -> list[dict[str, Any]]:
    lines = three.server.cli("events", "--deployment", "chat", "--json", timeout=120).stdout.splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def seen_by_engines(three: Three) -> list[dict[str, Any]]:
    """Each chat request an engine received, as its ``received`` line (``pid``, ``marker``)."""
    if not three.timeline.exists():
        return []
    lines = [json.loads(line) for line in three.timeline.read_text().splitlines() if line.strip()]
    return [line for line in lines if line.get("event") == "received" and line.get("path") == "/v1/chat/completions"]


class Outcome(NamedTuple):
    marker: str
    request_id: str | None
    began: float  # wall clock
    ended: float
    status: int  # 0: no answer at all
    kind: str  # done | error_event | error_status | truncated | transport
    code: str | None
    instance: int | None = None  # the instance an error names


def stream_one(three: Three, marker: str, client: httpx.Client, tokens: int = 16) -> Outcome:
    body = {"model": "chat", "messages": [{"role": "user", "content": marker}], "max_tokens": tokens, "stream": True}
    began = time.time()
    try:
        with client.stream(
            "POST",
            f"http://{three.lan.server.address}:{INFERENCE_PORT}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {three.key}"},
        ) as answer:
            request_id = answer.headers.get("x-capyctl-request-id")
            if answer.status_code != 200:
                answer.read()
                error = answer.json().get("error", {})
                return Outcome(
                    marker,
                    request_id,
                    began,
                    time.time(),
                    answer.status_code,
                    "error_status",
                    error.get("code"),
                    error.get("instance"),
                )
            text = "".join(answer.iter_text())
    except httpx.TransportError as error:
        return Outcome(marker, None, began, time.time(), 0, "transport", type(error).__name__)
    ended = time.time()
    frames = [frame for frame in text.split("\n\n") if frame.startswith("data: ")]
    if frames and frames[-1] == "data: [DONE]":
        return Outcome(marker, request_id, began, ended, 200, "done", None)
    errors = [json.loads(f[6:])["error"] for f in frames if f.startswith('data: {"error"')]
    if errors and frames[-1].startswith('data: {"error"'):
        last = errors[-1]
        return Outcome(marker, request_id, began, ended, 200, "error_event", last.get("code"), last.get("instance"))
    return Outcome(marker, request_id, began, ended, 200, "truncated", text[-200:])


class Traffic:
    """``workers`` clients, each sending streams one after the other until stopped (bounded: 5 minutes)."""

    def __init__(self, three: Three, workers: int, tag: str, tokens: int = 16) -> None:
        self.three, self.tag, self.tokens = three, tag, tokens
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]

    def _run(self, worker: int) -> None:
        ends = time.monotonic() + 300
        with httpx.Client(timeout=60) as client:
            n = 0
            while not self._stop.is_set() and time.monotonic() < ends:
                self.outcomes.append(stream_one(self.three, f"{self.tag}-{worker}-{n}", client, self.tokens))
                n += 1

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)


def final_hosts(three: Three) -> dict[str, str]:
    """Each request's last selection: CapyCTL's request ID -> the host it was finally sent to."""
    chosen: dict[str, str] = {}
    for event in events(three, "router_selection"):
        chosen[event["detail"]["capyctl_request_id"]] = event["detail"]["host"]
    return chosen


def no_request_reached_two_engines(three: Three) -> None:
    markers = Counter(line["marker"] for line in seen_by_engines(three))
    assert [m for m, count in markers.items() if count > 1] == []


def pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def test_streams_spread_evenly_and_a_slow_engine_gets_fewer(lan3: Lan, tmp_path: Path) -> None:
    three = three_hosts(lan3, tmp_path)
    burst: list[Outcome] = []
    start = threading.Barrier(64)

    def one(i: int) -> None:
        with httpx.Client(timeout=60) as client:
            start.wait(30)  # all 64 at once: concurrent streams
            burst.append(stream_one(three, f"burst-{i}", client, tokens=40))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [o.kind for o in burst] == ["done"] * 64, [o for o in burst if o.kind != "done"]
    sent = final_hosts(three)
    per_host = Counter(sent[o.request_id] for o in burst if o.request_id is not None)
    assert set(per_host) == set(NAMES) and sum(per_host.values()) == 64
    assert all(abs(count - 64 / 3) <= 0.15 * 64 / 3 for count in per_host.values()), per_host

    slow = three.hosts["gpu-c"]  # its agent again, its engines 60 ms a token from now on (12 times slower)
    assert slow.process is not None
    before_pid = next(i["pid"] for i in status(three)["instances"] if i["host"] == "gpu-c")
    slow.process.send_signal(signal.SIGTERM)
    slow.process.wait(30)
    slow.start("host", env={"STANDIN_TOKEN_DELAY_MS": "60"})
    until(
        lambda: (
            all(i["state"] == "ready" for i in status(three)["instances"])
            and next(i["pid"] for i in status(three)["instances"] if i["host"] == "gpu-c") not in (None, before_pid)
        ),
        60,
        "gpu-c's engine started again, slow",
    )
    before = set(final_hosts(three))
    with Traffic(three, workers=24, tag="load") as traffic:
        time.sleep(8)
    assert {o.kind for o in traffic.outcomes} == {"done"}, [o for o in traffic.outcomes if o.kind != "done"][:5]
    sent = final_hosts(three)
    per_host = Counter(sent[o.request_id] for o in traffic.outcomes if o.request_id and o.request_id not in before)
    fast = (per_host["gpu-a"] + per_host["gpu-b"]) / 2
    assert per_host["gpu-c"] < 0.5 * fast, per_host  # busy longer per request: fewer sent there
    chosen = [e["detail"]["inputs"] for e in events(three, "router_selection") if "inputs" in e["detail"]]
    assert any(any(s["engine"] is not None for s in inputs) for inputs in chosen)  # the engines' samples count
    no_request_reached_two_engines(three)


def test_a_killed_host_costs_only_the_streams_it_held_and_each_ends_with_an_error(lan3: Lan, tmp_path: Path) -> None:
    three = three_hosts(lan3, tmp_path)
    victim = three.hosts["gpu-b"]
    index = next(i["index"] for i in status(three)["instances"] if i["host"] == "gpu-b")
    assert victim.process is not None
    with Traffic(three, workers=18, tag="kill", tokens=40) as traffic:
        time.sleep(2)
        victim.process.send_signal(signal.SIGKILL)  # its engine goes with it (it dies with its parent)
        killed_at = time.time()
        time.sleep(4)
    outcomes = traffic.outcomes
    assert [o for o in outcomes if o.kind in ("truncated", "transport")] == []  # never cut short silently
    sent = final_hosts(three)
    elsewhere = [o for o in outcomes if o.request_id is not None and sent.get(o.request_id) != "gpu-b"]
    assert elsewhere and all(o.kind == "done" for o in elsewhere), [o for o in elsewhere if o.kind != "done"]
    failed = [o for o in outcomes if o.kind != "done"]
    assert failed, "a stream was at gpu-b when it was killed"
    for outcome in failed:  # each was at gpu-b, and ended with a clear error
        assert outcome.request_id is not None and sent[outcome.request_id] == "gpu-b", outcome
        assert outcome.kind in ("error_event", "error_status") and outcome.code == "device_offline", outcome
        assert outcome.instance == index, outcome  # the instance it was at, named
        assert outcome.began <= killed_at + 1.0, outcome
    after = [o for o in outcomes if o.began > killed_at + 1.0]
    assert after and all(o.kind == "done" for o in after)  # once it is known gone: nothing is lost
    no_request_reached_two_engines(three)
    for failover in events(three, "router_failover"):
        assert failover["detail"]["reason"] in UNSENT and failover["detail"]["host"] == "gpu-b", failover


def test_a_frozen_host_gets_no_new_request_once_suspended_and_its_streams_end_by_lost_after(
    lan3: Lan, tmp_path: Path
) -> None:
    three = three_hosts(lan3, tmp_path)
    frozen = three.hosts["gpu-a"]
    assert frozen.process is not None
    with Traffic(three, workers=12, tag="freeze", tokens=40) as traffic:
        time.sleep(1.5)
        frozen.process.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        until(lambda: hosts(three.server)["gpu-a"]["state"] == "suspended", 10, "gpu-a suspended")
        suspended_at = time.time()
        time.sleep(6)  # past lost_after (4 s)
    frozen.process.send_signal(signal.SIGCONT)
    outcomes = traffic.outcomes
    assert [o for o in outcomes if o.kind in ("truncated", "transport")] == []
    sent = final_hosts(three)
    selected = {e["detail"]["capyctl_request_id"]: e["at"] for e in events(three, "router_selection")}
    late = [o for o in outcomes if o.request_id is not None and selected.get(o.request_id, 0) > suspended_at]
    assert late and all(sent[o.request_id] != "gpu-a" for o in late if o.request_id)  # none sent there any more
    stuck = [o for o in outcomes if o.kind != "done"]
    assert stuck, "a stream was at gpu-a when it froze"
    for outcome in stuck:
        assert outcome.request_id is not None and sent[outcome.request_id] == "gpu-a", outcome
        assert outcome.code == "device_offline", outcome
        assert outcome.ended - max(outcome.began, stopped_at) <= 4.0 + 2.5, outcome  # lost_after, and the look
    no_request_reached_two_engines(three)
    until(lambda: hosts(three.server)["gpu-a"]["state"] == "online", 30, "gpu-a back")


def test_a_drained_host_hands_its_instance_over_and_a_frozen_one_is_replaced_then_stopped(
    lan3: Lan, tmp_path: Path
) -> None:
    three = three_hosts(lan3, tmp_path)
    server = three.server
    with Traffic(three, workers=6, tag="drain", tokens=24) as traffic:
        time.sleep(1)
        seen = [json.loads(server.cli("drain", "host", "gpu-b", "--json").stdout)["drain"]]
        until(lambda: seen.append(hosts(server)["gpu-b"]["drain"]) or seen[-1] == "drained", 60, "gpu-b drained")
        time.sleep(1)
    assert seen[0] == "draining" and seen[-1] == "drained"
    assert {o.kind for o in traffic.outcomes} == {"done"}, [o for o in traffic.outcomes if o.kind != "done"][:5]
    placed = status(three)["instances"]
    assert sorted(i["host"] for i in placed) == ["gpu-a", "gpu-a", "gpu-c"] and {i["state"] for i in placed} == {
        "ready"
    }
    assert "online, drained" in server.cli("list", "hosts").stdout
    server.cli("undrain", "host", "gpu-b")
    assert hosts(server)["gpu-b"]["drain"] is None

    frozen = three.hosts["gpu-c"]
    old = next(i for i in status(three)["instances"] if i["host"] == "gpu-c")
    assert frozen.process is not None
    frozen.process.send_signal(signal.SIGSTOP)  # the agent stops; its engine runs on
    until(lambda: events(three, "instance_moving"), 20, "gpu-c's instance moving (lost 4 s + replace_after 3 s)")
    until(
        lambda: (
            sorted(i["host"] for i in status(three)["instances"] if not i["retired"]) == ["gpu-a", "gpu-a", "gpu-b"]
            and all(i["state"] == "ready" for i in status(three)["instances"] if not i["retired"])
        ),
        60,
        "its replacement ready on gpu-b",
    )
    assert pid_alive(old["pid"]) and events(three, "instance_retired")[-1]["detail"]["host"] == "gpu-b"
    frozen.process.send_signal(signal.SIGCONT)  # back: the old engine is stopped now, on the host's word
    until(lambda: not pid_alive(old["pid"]), 30, "the old engine on gpu-c stopped")
    until(lambda: any(e["detail"]["host"] == "gpu-c" for e in events(three, "instance_retired")), 30, "retired")
    assert all(not i["retired"] for i in status(three)["instances"])
