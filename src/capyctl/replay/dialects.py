"""What each engine answers besides chat: error shape, health, version, metrics, sleep/wake.

Facts from /work/shared/engines/ENGINES.md (§1.4-1.7 vLLM, §2.5-2.8 SGLang, §3.4-3.5 llama.cpp,
§4.2-4.3 TensorFold) and the captured vLLM 0.32.0 / llama.cpp 0.6.0 side routes.
"""

from __future__ import annotations

from typing import Protocol
from urllib.parse import parse_qs

import msgspec

_encode = msgspec.json.encode
JSON = b"application/json"
Answer = tuple[int, bytes | None, bytes]  # status, content-type (None: no header), body

_TYPES = {  # status -> error type, per family of shapes
    "pydantic": {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"},
    "llama": {400: "invalid_request_error", 404: "not_found_error", 500: "server_error", 503: "unavailable_error"},
}


class State(Protocol):
    running: int
    waiting: int

    @property
    def sleeping(self) -> bool: ...

    def sleep(self, level: int) -> None: ...

    def wake(self) -> None: ...


def _version_key(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("."):
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _gauges(rows: list[tuple[str, str, str, float | int]]) -> bytes:
    out = []
    for name, help_, labels, value in rows:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} gauge\n{name}{labels} {value}\n")
    return "".join(out).encode()


class Dialect:
    """One engine family at one version, serving ``model``."""

    stream_content_type = b"text/event-stream"

    def __init__(self, name: str, version: str, model: str):
        self.name, self.version, self.model = name, version, model
        self.key = _version_key(version)

    # -- shapes ---------------------------------------------------------------------------------------
    def error(self, status: int, message: str) -> bytes:
        kind = _TYPES["llama" if self.name in ("llamacpp", "tensorfold") else "pydantic"]
        etype = kind.get(status, kind[500])
        if self.name == "vllm":
            return _encode({"error": {"message": message, "type": etype, "param": None, "code": status}})
        if self.name == "sglang":
            return _encode({"object": "error", "message": message, "type": etype, "param": None, "code": status})
        if self.name == "llamacpp":
            return _encode({"error": {"code": status, "message": message, "type": etype}})
        return _encode({"error": {"message": message, "type": etype, "code": status}})

    def models(self) -> bytes:
        return _encode({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": self.name}]})

    def metrics(self, state: State) -> tuple[bytes, bytes]:
        run, wait = state.running, state.waiting
        if self.name == "vllm":
            lab = f'{{engine="0",model_name="{self.model}"}}'
            asleep = 1.0 if state.sleeping else 0.0
            body = (
                _gauges(
                    [
                        (
                            "vllm:num_requests_running",
                            "Number of requests in model execution batches.",
                            lab,
                            float(run),
                        ),
                        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lab, float(wait)),
                    ]
                )
                + (
                    "# HELP vllm:engine_sleep_state Engine sleep state\n# TYPE vllm:engine_sleep_state gauge\n"
                    f'vllm:engine_sleep_state{{engine="0",model_name="{self.model}",sleep_state="awake"}} '
                    f"{1.0 - asleep}\n"
                    f'vllm:engine_sleep_state{{engine="0",model_name="{self.model}",sleep_state="weights_offloaded"}} '
                    f"{asleep}\n"
                ).encode()
            )
            return b"text/plain; version=1.0.0; charset=utf-8", body
        if self.name == "sglang":
            lab = f'{{model_name="{self.model}",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"}}'
            return b"text/plain; version=0.0.4; charset=utf-8", _gauges(
                [
                    ("sglang:num_running_reqs", "The number of running requests.", lab, float(run)),
                    ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", lab, float(wait)),
                ]
            )
        if self.name == "llamacpp":
            return b"text/plain; version=0.0.4", _gauges(
                [
                    ("llamacpp:requests_processing", "Number of requests processing", "", run),
                    ("llamacpp:requests_deferred", "Number of requests deferred", "", wait),
                ]
            )
        return b"text/plain; version=0.0.4; charset=utf-8", _gauges(
            [
                ("tensorfold:requests_running", "Requests generating.", "", run),
                ("tensorfold:requests_waiting", "Requests queued.", "", wait),
                ("tensorfold:num_requests_running", "Requests generating (vLLM name).", "", run),
                ("tensorfold:num_requests_waiting", "Requests queued (vLLM name).", "", wait),
            ]
        )

    # -- side routes ----------------------------------------------------------------------------------
    def route(self, method: str, path: str, query: bytes, state: State) -> Answer | None:
        """The answer to a non-chat route, or None when this engine has no such route."""
        if path == "/metrics" or (path == "/v1/metrics" and self.name == "tensorfold"):
            ctype, body = self.metrics(state)
            return 200, ctype, body
        if path == "/v1/models" and method == "GET":
            return 200, JSON, self.models()
        handler = getattr(self, f"_{self.name}", None)
        return handler(method, path, query, state) if handler else None

    def _vllm(self, method: str, path: str, query: bytes, state: State) -> Answer | None:
        new = self.key >= (0, 32)
        if (path in ("/health", "/ping") and method == "GET") or (path == "/ping" and method == "POST"):
            return 200, None, b""
        if path == "/version" and method == "GET":
            return 200, JSON, _encode({"version": self.version})
        if path == "/is_sleeping" and method == "GET":
            return 200, JSON, _encode({"is_sleeping": state.sleeping})
        if path == "/sleep" and method == "POST":
            raw = (parse_qs(query.decode()).get("level") or ["1"])[0]
            try:
                level = int(raw)
            except ValueError:
                level = -1
            if new and not 0 <= level <= 2:
                return 400, JSON, self.error(400, f"level must be 0, 1 or 2, got {raw!r}")
            if level < 0:  # 0.29-0.31 parse with int(): a bad value is an unhandled 500
                return 500, b"text/plain; charset=utf-8", b"Internal Server Error"
            state.sleep(level)
            return (200, JSON, _encode({"status": "sleeping", "level": level})) if new else (200, None, b"")
        if path == "/wake_up" and method == "POST":
            tags = parse_qs(query.decode()).get("tags")
            state.wake()
            return (200, JSON, _encode({"status": "awake", "tags": tags})) if new else (200, None, b"")
        return None

    def _sglang(self, method: str, path: str, query: bytes, state: State) -> Answer | None:
        if path in ("/health", "/health_generate", "/ping") and method == "GET":
            return 200, None, b""
        if path == "/ready" and method == "GET" and self.key >= (0, 5, 20):
            return 200, None, b""
        if path in ("/get_server_info", "/server_info") and method == "GET":
            return (
                200,
                JSON,
                _encode({"version": self.version, "model_path": self.model, "served_model_name": self.model}),
            )
        if path in ("/release_memory_occupation", "/resume_memory_occupation") and method in ("GET", "POST"):
            state.sleep(1) if path.startswith("/release") else state.wake()
            return 200, JSON, b"null"
        return None

    def _llamacpp(self, method: str, path: str, query: bytes, state: State) -> Answer | None:
        if path in ("/health", "/v1/health") and method == "GET":
            return 200, b"application/json; charset=utf-8", b'{"status":"ok"}'
        if path == "/props" and method == "GET":
            return (
                200,
                b"application/json; charset=utf-8",
                _encode(
                    {"total_slots": 2, "model_alias": self.model, "build_info": "b0-unknown", "is_sleeping": False}
                ),
            )
        return None

    def _tensorfold(self, method: str, path: str, query: bytes, state: State) -> Answer | None:
        if path in ("/health", "/v1/health") and method == "GET":
            return (
                200,
                JSON,
                _encode(
                    {
                        "status": "ok",
                        "version": self.version,
                        "busy": state.running > 0,
                        "requests_running": state.running,
                    }
                ),
            )
        return None
