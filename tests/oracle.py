"""The streamed relay's check written the simple way: the reference ``relay_check.StreamCheck`` is held to.

Each payload is decoded into a dict and read field by field, one chunk at a
time, as the relay did before its typed check: the engine's error event
(``error`` without ``choices``) is relayed untouched and kept; any other
chunk must pass ``DeltaVerifier``, then has its ``model`` renamed (its first
``"model":<sent>`` spliced, or the chunk written anew from its dict where the
engine spelled it otherwise), is counted when it carries text, and gives the
meter the engine objects it sends. The first chunk refused ends the read.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET

from capyctl.domain.errors import CapyError, EdgeError
from capyctl.domain.fields import DeltaVerifier, FieldRow
from capyctl.domain.metrics import Meter
from capyctl.domain.relay_check import DELTA_KEYS, OBJECT_NAMES, Refused
from capyctl.domain.streams import DEFAULT_MAX_TOOL_CALLS, sse_of

TEXT_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")


class OracleCheck:
    """``StreamCheck``'s answer for each read, from dicts: ``check(payloads, meter, at)`` gives the bytes to
    send, or raises ``Refused``; ``at`` is the time the meter notes for the read."""

    def __init__(self, row: FieldRow, where: str, name: str, max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS) -> None:
        self.verifier = DeltaVerifier(row.delta, where, max_tool_calls)
        self.name = name
        self.failure: dict[str, Any] | None = None

    def check(self, payloads: list[bytes], meter: Meter, at: float) -> bytes:
        sent: list[bytes] = []
        for payload in payloads:
            try:
                obj = msgspec.json.decode(payload)
            except (msgspec.DecodeError, RecursionError) as exc:
                raise Refused(sse_of(sent), EdgeError(f"the engine sent an event that is no JSON: {exc}")) from exc
            if type(obj) is not dict:
                raise Refused(sse_of(sent), EdgeError("the engine sent an event that is not a JSON object"))
            if "error" in obj and "choices" not in obj:
                error = obj["error"]
                self.failure = error if isinstance(error, dict) else {"message": str(error)}
                sent.append(payload)
                continue
            try:
                self.verifier.verify(obj)
            except CapyError as error:
                raise Refused(sse_of(sent), error) from error
            sent.append(self.renamed(payload, obj))
            meter.last_at = at
            if has_text(obj):
                meter.text_chunks += 1
                if meter.first_text_at is None:
                    meter.first_text_at = at
            for name in OBJECT_NAMES:
                if obj.get(name) is not None:
                    meter.seen[name] = obj[name]
        return sse_of(sent)

    def renamed(self, payload: bytes, obj: dict[str, Any]) -> bytes:
        if "model" not in obj or obj["model"] == self.name:
            return payload
        pattern = b'"model":' + msgspec.json.encode(obj["model"])
        if pattern in payload:
            return payload.replace(pattern, b'"model":' + msgspec.json.encode(self.name), 1)
        return msgspec.json.encode({**obj, "model": self.name})


def has_text(obj: dict[str, Any]) -> bool:
    """Some choice's delta carries generated text (a role alone is none)."""
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") or {}
        if any(delta.get(key) for key in TEXT_KEYS):
            return True
    return False


# --- the C scan's facts (``_speedups/scan.c``) read from decoded heads, as the check reads them: what its ------
# --- Python reference (``_speedups/scan_reference.py``) is held to in ``tests/unit/test_run_scan.py`` ----------


def payload_spans(body: bytes) -> list[tuple[int, int]]:
    """Where each payload of a read begins and ends in its bytes."""
    spans, at = [], 6
    for chunk in body[6:-2].split(b"\n\ndata: "):
        spans.append((at, at + len(chunk)))
        at += len(chunk) + 8  # its blank line and the next "data: "
    return spans


def facts_of(heads: list[Any], body: bytes) -> tuple[Any, ...]:
    """The scan's facts but the last, worked out from decoded heads the way the check reads them."""
    keys, top, texts, objects = 0, -1, [], []
    spans = payload_spans(body)
    for i, head in enumerate(heads):
        text = False
        for choice in head.choices or ():
            delta = choice.delta
            if delta is None:
                continue
            for bit, key in enumerate(DELTA_KEYS):
                if getattr(delta, key) is not UNSET:
                    keys |= 1 << bit
            for call in delta.tool_calls or ():
                if call.index is not None:
                    top = max(top, call.index)
            text = text or bool(delta.tool_calls) or any(getattr(delta, key) for key in TEXT_KEYS)
        texts.append(text)
        if any(getattr(head, name) is not None for name in OBJECT_NAMES):
            objects += spans[i]
    models = {msgspec.json.encode(head.model) if head.model is not UNSET else None for head in heads}
    assert len(models) == 1  # the scan accepts only a model every chunk sends alike (or none sends)
    return (len(heads), models.pop(), keys, top, sum(texts), texts.index(True) if True in texts else -1, tuple(objects))
