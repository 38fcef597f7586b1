"""A ``chat.completion`` answer put together from a recorded stream (for ``"stream": false``).

Engines build their non-streamed answers themselves; this is only an approximation for direct
comparisons: content, reasoning and tool-call pieces joined per choice, the finish reason, usage,
and ``id``/``created``/``model``/``system_fingerprint`` from the stream's chunks as recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode


def _payloads(events: tuple[bytes, ...]) -> Iterator[Any]:
    for event in events:
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data and data != b"[DONE]":
                    yield _decode(data)


def _merge_tool(calls: dict[int, dict[str, Any]], piece: dict[str, Any]) -> None:
    call = calls.setdefault(
        piece.get("index") or 0, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
    )
    if piece.get("id"):
        call["id"] = piece["id"]
    fn = piece.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] = fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] += fn["arguments"]


def assemble(events: tuple[bytes, ...]) -> tuple[int, bytes]:
    """(status, JSON body): the answer, or the stream's error event with its code as status."""
    head: dict[str, Any] | None = None
    usage = fingerprint = None
    choices: dict[int, dict[str, Any]] = {}
    for obj in _payloads(events):
        if not isinstance(obj, dict):
            continue
        if "error" in obj and "choices" not in obj:
            code = obj["error"].get("code") if isinstance(obj["error"], dict) else None
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            return status, _encode({"error": obj["error"]})
        head = head or obj
        usage = obj.get("usage") or usage
        fingerprint = obj.get("system_fingerprint") or fingerprint
        for choice in obj.get("choices") or ():
            st = choices.setdefault(
                choice.get("index") or 0, {"content": [], "reasoning": [], "key": None, "tools": {}, "finish": None}
            )
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                st["content"].append(delta["content"])
            for key in ("reasoning", "reasoning_content"):
                if isinstance(delta.get(key), str):
                    st["reasoning"].append(delta[key])
                    st["key"] = key
            for piece in delta.get("tool_calls") or ():
                _merge_tool(st["tools"], piece)
            st["finish"] = choice.get("finish_reason") or st["finish"]
    head = head or {}
    out_choices = []
    for index in sorted(choices):
        st = choices[index]
        message: dict[str, Any] = {"role": "assistant", "content": "".join(st["content"]) or None}
        if st["key"]:
            message[st["key"]] = "".join(st["reasoning"])
        if st["tools"]:
            message["tool_calls"] = [st["tools"][i] for i in sorted(st["tools"])]
        out_choices.append({"index": index, "message": message, "finish_reason": st["finish"]})
    answer: dict[str, Any] = {
        "id": head.get("id"),
        "object": "chat.completion",
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": out_choices,
    }
    if fingerprint:
        answer["system_fingerprint"] = fingerprint
    if usage:
        answer["usage"] = usage
    return 200, _encode(answer)
