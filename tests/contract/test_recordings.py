"""What a client receives through CapyCTL for every recorded engine stream, pinned by snapshots."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
from syrupy.assertion import SnapshotAssertion

from tests.contract.conftest import Folder, JsonSnapshot, SseSnapshot, cases
from tests.integration.harness import CapyServer

CHUNK_SIZES = [1, 7, None]  # bytes per engine write; None: one write per event
Replayed = tuple[CapyServer, dict[str, Folder]]


METRICS = ": x-capyctl-metrics "


def neutral(figures: dict) -> dict:
    """Router-measured figures depend on this machine's timing: snapshots keep their presence, not values."""
    return {k: (v if v["source"] == "engine" else {**v, "value": "<measured>"}) for k, v in figures.items()}


def stable_sse(text: str) -> str:
    out = []
    for line in text.split("\n"):
        if line.startswith(METRICS):
            line = METRICS + msgspec.json.encode(neutral(msgspec.json.decode(line[len(METRICS) :]))).decode()
        out.append(line)
    return "\n".join(out)


def stable_json(answer: dict) -> str:
    if "capyctl" in answer:
        answer["capyctl"]["metrics"] = neutral(answer["capyctl"]["metrics"])
    return msgspec.json.format(msgspec.json.encode(answer), indent=2).decode() + "\n"


def ask(
    server: CapyServer, deployment: str, case: str, stream: bool, chunk: int | None, **extra: object
) -> httpx.Response:
    body = {
        "model": deployment,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "replay_case": case,
        **extra,
    }
    if chunk is not None:
        body["replay_chunk_size"] = chunk
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=server.headers(), timeout=30)


def events(text: str) -> list[str]:
    return [e for e in text.replace("\r\n", "\n").split("\n\n") if e]


def recorded_events(folder: Folder, case: str) -> list[str]:
    return events((folder.path / f"{case}.sse").read_text())


@pytest.mark.parametrize(("deployment", "case"), cases("ok"))
def test_streams_are_relayed_whatever_the_chunk_boundaries(
    replayed: Replayed, deployment: str, case: str, snapshot: SnapshotAssertion
) -> None:
    server, folders = replayed
    texts = []
    for chunk in CHUNK_SIZES:
        r = ask(server, deployment, case, True, chunk)
        assert r.status_code == 200, r.text
        texts.append(r.text)
    assert stable_sse(texts[0]) == stable_sse(texts[1]) == stable_sse(texts[2])
    relayed, recorded = events(texts[0]), recorded_events(folders[deployment], case)
    if "data: [DONE]" in recorded:  # CapyCTL's metrics comment comes just before [DONE]
        assert relayed[-2].startswith(METRICS) and relayed[-1] == "data: [DONE]"
        relayed = relayed[:-2] + relayed[-1:]
    assert len(relayed) == len(recorded)
    for mine, theirs in zip(relayed, recorded, strict=True):
        if mine == "data: [DONE]" or "[DONE]" in theirs:
            assert mine == theirs
            continue
        got, sent = msgspec.json.decode(mine[6:]), msgspec.json.decode(theirs[6:])
        if "model" in sent:
            assert got.pop("model") == deployment
            sent.pop("model")
        assert got == sent  # everything but `model` exactly as the engine sent it
    assert stable_sse(texts[0]) == snapshot(extension_class=SseSnapshot)


@pytest.mark.parametrize(("deployment", "case"), cases("ok"))
def test_assembled_answers(replayed: Replayed, deployment: str, case: str, snapshot: SnapshotAssertion) -> None:
    server, _ = replayed
    answers = [ask(server, deployment, case, False, chunk) for chunk in CHUNK_SIZES]
    assert {a.status_code for a in answers} == {200}, answers[0].text
    texts = [stable_json(a.json()) for a in answers]
    assert texts[0] == texts[1] == texts[2]
    answer = answers[0].json()
    assert answer["object"] == "chat.completion" and answer["model"] == deployment
    assert texts[0] == snapshot(extension_class=JsonSnapshot)


def stats(folder: Folder) -> dict:
    return httpx.get(folder.url + "/replay/stats", timeout=5).json()


@pytest.mark.parametrize(("deployment", "case"), cases("unverified_stream"))
def test_unverified_keys_end_the_stream_and_close_the_engine_connection(
    replayed: Replayed, deployment: str, case: str
) -> None:
    server, folders = replayed
    folder = folders[deployment]
    recorded = recorded_events(folder, case)
    allowed = set(server.cli_json("status", "deployment", deployment)["fields"]["delta_keys"])
    bad = next(i for i, e in enumerate(recorded) if e.startswith("data: {") and _unverified(allowed, e))
    for chunk in CHUNK_SIZES:
        before = stats(folder)["disconnected"]
        # paced, so that the engine is still sending when CapyCTL cuts the connection
        r = ask(server, deployment, case, True, chunk, replay_interval_ms=20)
        relayed = events(r.text)
        assert r.status_code == 200
        assert len(relayed) == bad + 1, "something of the bad chunk or after it was relayed"
        error = msgspec.json.decode(relayed[-1][6:])["error"]
        assert error["code"] == "unverified_stream" and error["key"] in recorded[bad]
        assert _closed_by_capyctl(folder, before) or len(recorded) == bad + 1
        plain = ask(server, deployment, case, False, chunk, replay_interval_ms=20)
        assert plain.status_code == 502 and plain.json()["error"]["code"] == "unverified_stream"
        assert "choices" not in plain.json()


def _unverified(allowed: set[str], event: str) -> bool:
    obj = msgspec.json.decode(event[6:])
    return any(set(c.get("delta") or {}) - allowed for c in obj.get("choices") or [])


def _closed_by_capyctl(folder: Folder, before: int) -> bool:
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        if stats(folder)["disconnected"] > before:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize(("deployment", "case"), cases("engine_error", stream_only=False))
def test_engine_errors_are_relayed_with_their_status(
    replayed: Replayed, deployment: str, case: str, snapshot: SnapshotAssertion
) -> None:
    server, folders = replayed
    folder = folders[deployment]
    answers = [ask(server, deployment, case, stream, None) for stream in (True, False)]
    headers = folder.path / f"{case}.headers"
    if headers.exists():  # an error answer before any stream: status and code as the engine gave them
        status = int(headers.read_text().split()[1])
        assert [a.status_code for a in answers] == [status, status]
        assert answers[0].json() == answers[1].json()
        assert answers[0].json()["error"]["type"] == answers[0].json()["error"]["code"]
        assert answers[0].text + "\n" == snapshot(extension_class=JsonSnapshot)
    else:  # an error in the middle of a stream: relayed as the engine sent it
        assert answers[0].status_code == 200
        assert stable_sse(answers[0].text) == snapshot(extension_class=SseSnapshot)
        assert answers[1].status_code >= 400 and "error" in answers[1].json()


def test_attached_engine_version_is_probed_when_not_declared(replayed: Replayed, tmp_path) -> None:
    server, folders = replayed
    folder = folders.get("vllm-0.32.0")
    assert folder is not None, "the captured vLLM 0.32.0 recordings are missing"
    path = tmp_path / "probe.yaml"
    path.write_bytes(msgspec.yaml.encode({"name": "probed", "engine": "vllm", "endpoint": folder.url}))
    server.cli("deploy", "model", "--file", str(path))
    status = server.cli_json("status", "deployment", "probed")
    assert status["engine_version"] == "0.32.0" and status["fields"]["verified"]
    server.cli("delete", "deployment", "probed")


def test_unverified_versions_are_reported(replayed: Replayed, tmp_path) -> None:
    server, folders = replayed
    folder = folders["vllm-0.32.0"]
    path = tmp_path / "future.yaml"
    path.write_bytes(
        msgspec.yaml.encode({"name": "future", "engine": "vllm", "endpoint": folder.url, "engine_version": "0.40.1"})
    )
    server.cli("deploy", "model", "--file", str(path))
    fields = server.cli_json("status", "deployment", "future")["fields"]
    assert not fields["verified"] and fields["row"] == "vllm 0.33"
    kinds = server.cli("events", "--deployment", "future", "--json").stdout
    assert "unverified_engine_version" in kinds
    server.cli("delete", "deployment", "future")
