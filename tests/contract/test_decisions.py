"""POST /v1/systemone through a real CapyCTL, for every recorded decision case, pinned by snapshots.

Each recording folder with a ``systemone/`` subfolder (see ``recordings/synthesize_decisions.py``)
gets, on its replay engine, one ``api: decisions`` deployment per model its cases name: the folder's
model as ``<engine>-<version>-decisions``, any other (a name the engine does not know, a model that
is not a decision model) as ``<engine>-<version>-decisions-<model>``. Every case is sent to the
deployment of its model; the replay engine's decision log shows what reached the engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from syrupy.assertion import SnapshotAssertion

from capyctl.replay.decisions import request_key
from tests.contract.conftest import Folder, JsonSnapshot, folders
from tests.contract.test_recordings import neutral
from tests.integration.harness import CapyServer

Replayed = tuple[CapyServer, dict[str, Folder]]
ULID = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}$")
KEPT_HEADERS = ("content-type", "cache-control", "retry-after", "x-request-id", "x-capyctl-request-id")
PNG = "data:image/png;base64,iVBORw0KGgo="
CALLER_ID = "caller-7"


def meta(folder: Folder) -> dict[str, Any] | None:
    path = folder.path / "systemone" / "metadata.json"
    return msgspec.json.decode(path.read_bytes()) if path.exists() else None


def decision_folders() -> list[Folder]:
    return [f for f in folders() if meta(f) is not None]


def request_of(folder: Folder, case: str) -> bytes:
    return (folder.path / "systemone" / f"{case}.request.json").read_bytes()


def model_of(folder: Folder, case: str) -> str | None:
    try:
        obj = msgspec.json.decode(request_of(folder, case))
    except msgspec.DecodeError:
        return None  # not JSON: CapyCTL refuses it before it looks for a deployment
    return obj.get("model") if isinstance(obj, dict) else None


def deployment_for(folder: Folder, model: str | None) -> str:
    main = meta(folder)["model"]  # type: ignore[index]
    return f"{folder.deployment}-decisions" + ("" if model in (None, main) else f"-{model}")


def cases(expect: str | None = None) -> list[tuple[str, str]]:
    return [
        (f.deployment, case)
        for f in decision_folders()
        for case, info in sorted(meta(f)["cases"].items())
        if expect is None or info["expect"] == expect
    ]


def recorded(folder: Folder, case: str) -> tuple[int, bytes]:
    where = folder.path / "systemone"
    status = int((where / f"{case}.response.headers").read_text().split()[1])
    return status, (where / f"{case}.response.json").read_bytes()


@pytest.fixture(scope="module")
def decisions(replayed: Replayed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replayed]:
    """The session's CapyCTL with the decisions deployments added (and removed afterwards)."""
    server, by_id = replayed
    tmp = tmp_path_factory.mktemp("decisions")
    made = []
    for folder in (by_id[f.deployment] for f in decision_folders()):  # the running ones, with their URL
        names = {meta(folder)["model"]} | {m for c in meta(folder)["cases"] if (m := model_of(folder, c))}
        for model in sorted(names):
            name = deployment_for(folder, model)
            doc = {
                "name": name,
                "engine": folder.engine,
                "endpoint": folder.url,
                "engine_version": folder.version,
                "model": model,
                "api": "decisions",
            }
            path = tmp / f"{name}.yaml"
            path.write_bytes(msgspec.yaml.encode(doc))
            server.cli("deploy", "model", "--file", str(path))
            made.append(name)
    try:
        yield server, by_id
    finally:
        for name in made:
            server.cli("delete", "deployment", name, check=False)


def engine_log(folder: Folder) -> dict[str, Any]:
    return httpx.get(folder.url + "/replay/stats", timeout=5).json()["decisions"]


def decide(server: CapyServer, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/systemone",
        content=body,
        timeout=30,
        headers={**server.headers(), "content-type": "application/json", **headers},
    )


def body_for(folder: Folder, case: str, **extra: Any) -> bytes:
    """The case's recorded request with the deployment's name as ``model`` (not JSON: as recorded)."""
    raw = request_of(folder, case)
    model = model_of(folder, case)
    if model is None:
        return raw
    return msgspec.json.encode({**msgspec.json.decode(raw), "model": deployment_for(folder, model), **extra})


def client_saw(r: httpx.Response) -> str:
    """Status, headers and body as a snapshot: CapyCTL's own times and request IDs masked."""
    ids = {r.headers["x-capyctl-request-id"]}
    assert ULID.match(r.headers["x-capyctl-request-id"])
    headers = {}
    for name in KEPT_HEADERS:
        if name in r.headers:
            value = r.headers[name]
            headers[name] = "<request id>" if value in ids else value
    body = r.json()
    if isinstance(body.get("capyctl"), dict):
        body["capyctl"]["metrics"] = neutral(body["capyctl"]["metrics"])
    text = msgspec.json.format(
        msgspec.json.encode({"status": r.status_code, "headers": headers, "body": body}), indent=2
    ).decode()
    for rid in ids:
        text = text.replace(rid, "<request id>")
    return text + "\n"


@pytest.mark.parametrize(("deployment", "case"), cases())
def test_every_decision_case_through_capyctl(
    decisions: Replayed, deployment: str, case: str, snapshot: SnapshotAssertion
) -> None:
    server, by_id = decisions
    folder = by_id[deployment]
    expect = meta(folder)["cases"][case]["expect"]
    name = deployment_for(folder, model_of(folder, case))
    status, engine_body = recorded(folder, case)
    before = engine_log(folder)["requests"]
    r = decide(server, body_for(folder, case), **{"X-Request-Id": CALLER_ID})
    assert r.headers["x-request-id"] == CALLER_ID and r.headers["cache-control"] == "no-store"
    log = engine_log(folder)
    if expect == "refused":  # CapyCTL's own refusal: nothing reached the engine
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] in ("invalid_json", "invalid_request")
        assert log["requests"] == before
    else:
        assert log["requests"] == before + 1
        seen = log["log"][-1]
        assert seen["case"] == case and seen["status"] == status
        assert request_key(seen["body"].encode()) == request_key(request_of(folder, case))  # unchanged but for model
        names = {k.lower() for k, _ in seen["headers"]}
        assert "authorization" not in names and "x-request-id" not in names and CALLER_ID not in str(seen)
        if expect == "ok":
            assert r.status_code == 200, r.text
            answer, sent = r.json(), msgspec.json.decode(engine_body)
            assert answer.pop("model") == name
            metrics = answer.pop("capyctl")["metrics"]
            sent.pop("model")
            assert answer == sent  # the engine's answer as it gave it, but for model
            assert set(metrics) == {"input_tokens", "time_to_response_ms", "total_ms"}
            assert metrics["input_tokens"] == {"value": sent["usage"]["input_tokens"], "source": "engine"}
            assert metrics["total_ms"]["value"] >= metrics["time_to_response_ms"]["value"] >= 0
        else:
            assert expect == "engine_rejected"
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert (error["code"], error["status"]) == ("engine_rejected", status)
    assert client_saw(r) == snapshot(extension_class=JsonSnapshot)


def _engine_reason(body: bytes) -> str:
    obj = msgspec.json.decode(body)
    if isinstance(obj.get("error"), dict):
        return obj["error"]["message"]
    if "detail" in obj:  # FastAPI's 422
        return obj["detail"][0]["msg"]
    return obj["message"]


def _reason_cases() -> list[Any]:
    out = []
    for deployment, case in cases("engine_rejected"):
        out.append(pytest.param(deployment, case, id=f"{deployment}-{case}"))
    return out


@pytest.mark.parametrize(("deployment", "case"), _reason_cases())
def test_the_engines_reason_for_a_refusal_reaches_the_client(decisions: Replayed, deployment: str, case: str) -> None:
    server, by_id = decisions
    folder = by_id[deployment]
    r = decide(server, body_for(folder, case))
    assert r.json()["error"]["code"] == "engine_rejected"
    assert _engine_reason(recorded(folder, case)[1]) in r.json()["error"]["message"]


def _refused_fields() -> list[tuple[str, str]]:
    out = []
    for folder in decision_folders():
        fields = ["stream", "temperature"]
        if folder.engine in ("vllm", "sglang"):
            fields.append("files")  # neither reads it: it would be dropped without a word
        if folder.engine == "sglang" and folder.version == "0.5.21":
            fields.append("images")  # from 0.5.22
        out += [(folder.deployment, field) for field in fields]
    return out


VALUES: dict[str, Any] = {"stream": True, "temperature": 0.5, "files": [PNG], "images": [PNG]}


@pytest.mark.parametrize(("deployment", "field"), _refused_fields())
def test_a_refused_field_never_reaches_the_engine(
    decisions: Replayed, deployment: str, field: str, snapshot: SnapshotAssertion
) -> None:
    server, by_id = decisions
    folder = by_id[deployment]
    before = engine_log(folder)["requests"]
    r = decide(server, body_for(folder, "ok_three_types", **{field: VALUES[field]}))
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_request", field)
    assert engine_log(folder)["requests"] == before
    assert client_saw(r) == snapshot(extension_class=JsonSnapshot)


def test_images_and_files_reach_the_engines_that_read_them(decisions: Replayed) -> None:
    server, by_id = decisions
    for deployment, case, field in [
        ("sglang-0.5.22", "ok_images", "images"),
        ("sglang-0.5.23", "ok_images", "images"),
        ("llamacpp-0.6.0", "files_unsupported", "files"),
    ]:
        folder = by_id[deployment]
        r = decide(server, body_for(folder, case))
        assert r.status_code == recorded(folder, case)[0], r.text
        sent = msgspec.json.decode(engine_log(folder)["log"][-1]["body"])
        assert sent[field] == msgspec.json.decode(request_of(folder, case))[field]


def _mismatch(server: CapyServer, chat: str, decider: str, body: bytes) -> list[httpx.Response]:
    return [
        decide(server, msgspec.json.encode({**msgspec.json.decode(body), "model": chat})),
        httpx.post(
            server.base_url + "/v1/chat/completions",
            headers=server.headers(),
            timeout=30,
            json={
                "model": decider,
                "messages": [{"role": "user", "content": "hi"}],
                "replay_case": "chat_stream_usage",
            },
        ),
    ]


def _engine_counts(folder: Folder) -> tuple[int, int]:
    stats = httpx.get(folder.url + "/replay/stats", timeout=5).json()
    return stats["requests"], stats["decisions"]["requests"]


def test_api_mismatch_both_ways_reaches_no_engine(decisions: Replayed) -> None:
    server, by_id = decisions
    folder = by_id["vllm-0.32.0"]
    before = _engine_counts(folder)
    to_chat, to_decider = _mismatch(server, "vllm-0.32.0", "vllm-0.32.0-decisions", body_for(folder, "ok_three_types"))
    assert to_chat.status_code == 400 and to_chat.json()["error"]["code"] == "api_mismatch"
    assert "POST /v1/chat/completions" in to_chat.json()["error"]["message"]
    assert to_decider.status_code == 400 and to_decider.json()["error"]["code"] == "api_mismatch"
    assert "POST /v1/systemone" in to_decider.json()["error"]["message"]
    assert _engine_counts(folder) == before


@pytest.fixture
def stopped_pair(decisions: Replayed, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A chat and a decisions deployment on the vLLM 0.32.0 replay engine, both stopped by an operator."""
    server, by_id = decisions
    folder = by_id["vllm-0.32.0"]
    names = ("stopped-chat", "stopped-decisions")
    for name, api, model in ((names[0], "chat", None), (names[1], "decisions", "tiny-decider")):
        doc = {
            "name": name,
            "engine": "vllm",
            "endpoint": folder.url,
            "engine_version": "0.32.0",
            "api": api,
            **({"model": model} if model else {}),
        }
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(msgspec.yaml.encode(doc))
        server.cli("deploy", "model", "--file", str(path))
        server.cli("stop", "deployment", name)
    try:
        yield names
    finally:
        for name in names:
            server.cli("delete", "deployment", name, check=False)


def _state(server: CapyServer, name: str) -> str:
    return server.cli_json("status", "deployment", name)["state"]


def test_api_mismatch_both_ways_leaves_a_stopped_deployment_stopped(
    decisions: Replayed, stopped_pair: tuple[str, str]
) -> None:
    server, by_id = decisions
    folder = by_id["vllm-0.32.0"]
    chat, decider = stopped_pair
    assert (_state(server, chat), _state(server, decider)) == ("stopped", "stopped")
    before = _engine_counts(folder)
    answers = _mismatch(server, chat, decider, body_for(folder, "ok_three_types"))
    assert all(400 <= a.status_code < 500 for a in answers), [a.text for a in answers]
    assert (_state(server, chat), _state(server, decider)) == ("stopped", "stopped")
    assert _engine_counts(folder) == before


def test_api_mismatch_is_the_answer_even_when_the_deployment_is_stopped(
    decisions: Replayed, stopped_pair: tuple[str, str]
) -> None:
    server, by_id = decisions
    chat, decider = stopped_pair
    answers = _mismatch(server, chat, decider, body_for(by_id["vllm-0.32.0"], "ok_three_types"))
    assert [a.json()["error"]["code"] for a in answers] == ["api_mismatch", "api_mismatch"], [a.text for a in answers]


@pytest.mark.parametrize("deployment", ["vllm-0.31.0", "sglang-0.5.20", "tensorfold-0.6.3"])
def test_api_decisions_is_refused_on_an_attached_engine_version_without_the_route(
    decisions: Replayed, deployment: str, tmp_path: Path
) -> None:
    server, by_id = decisions
    folder = by_id[deployment]
    doc = {
        "name": "no-route",
        "engine": folder.engine,
        "endpoint": folder.url,
        "engine_version": folder.version,
        "api": "decisions",
    }
    path = tmp_path / "no-route.yaml"
    path.write_bytes(msgspec.yaml.encode(doc))
    done = server.cli("deploy", "model", "--file", str(path), check=False)
    if done.returncode == 0:
        server.cli("delete", "deployment", "no-route", check=False)
    assert done.returncode != 0 and "invalid_config" in done.stderr, done.stdout + done.stderr
