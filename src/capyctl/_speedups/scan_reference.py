"""The Python reference of the C scan (``scan.c`` beside it): its functions by the same names, ``scan_run`` and
``respell``, with the answers the C is held to (``tests/unit/test_run_scan.py``, ``tests/fuzz/speedups.py``).

``scan_run(body, objects, delta_keys)`` gives the ``ScanFacts`` (``domain/streams.py``) of a read of plain
SSE chunks (``data: <payload>\\n\\n`` each, one line each), worked out of msgspec's typed decode of each
payload into the relay check's head struct (``relay_check.Head``, made here for the names it is told:
``objects`` as the head's object fields, ``delta_keys`` as the delta's), which is what the check itself
would decode. It answers None where the check must decode the read itself: a read that is not plain
events, holds a carriage return (the SSE parser's general way normalises line ends), is not valid UTF-8
(a typed decode skips unread fields unchecked), or has a payload that does not decode (typed, or whole as
any JSON: a model to write anew is written from the payload's dict), that repeats a field of the structs
(the decode keeps the last value: the facts of the others would be lost), that is the engine's error
event (``error`` without ``choices``), or whose model is not the same string as every other's (or absent
from all).

The C answers for a subset of these reads (it declines what it is not sure of, and the check then
decodes), and where it answers, it gives these facts, but for ``positions``, which it may leave out (None)
where this reference finds them. Here ``positions`` are given where ``"model":<model>`` occurs once in each
payload, as its head's model field (a different string put there changes the decoded head's model).

This is a reference, written to be plainly right, not fast: the SSE parser runs the C where it was built,
and decodes in the check where it was not (``adapters/engines/_sse``).
"""

from __future__ import annotations

import array
import functools
import json
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from capyctl.domain.relay_check import Index, ToolCall, is_utf8
from capyctl.domain.streams import ScanFacts, respell

__all__ = ["respell", "scan_run"]

MAX_NAMES = 16  # of objects, and of delta_keys, as in the C
_READ = ("model", "choices", "error")  # the head's fields the check reads; the objects follow them


def _names(names: Any, what: str) -> tuple[str, ...]:
    """``names`` checked as the C checks them: a tuple of at most 16 ASCII str (TypeError otherwise)."""
    if not isinstance(names, tuple) or len(names) > MAX_NAMES:
        raise TypeError(f"scan_run(): {what} must be a tuple of at most {MAX_NAMES} names")
    if not all(isinstance(name, str) and name.isascii() for name in names):
        raise TypeError(f"scan_run(): each name in {what} must be an ASCII str")
    return names


@functools.lru_cache(maxsize=32)
def _decode_head(objects: tuple[str, ...], delta_keys: tuple[str, ...]) -> Callable[[bytes], Any]:
    """The decode of a head with these names: ``relay_check.Head``'s shape (a repeated name, or a name of
    ``objects`` that is one of the fields read, adds no field; the caller passes neither)."""
    delta = msgspec.defstruct(
        "Delta",
        [
            (key, list[ToolCall] | None | UnsetType if key == "tool_calls" else Any, UNSET)
            for key in dict.fromkeys(delta_keys)
        ],
        forbid_unknown_fields=True,
        gc=False,
    )
    choice = msgspec.defstruct("Choice", [("index", Index | None, None), ("delta", delta | None, None)], gc=False)
    head = msgspec.defstruct(
        "Head",
        [
            ("model", Any, UNSET),
            ("choices", list[choice] | None | UnsetType, UNSET),  # type: ignore[valid-type]  # made by defstruct: a variable to mypy
            ("error", Any, UNSET),
            *((name, Any, None) for name in dict.fromkeys(objects) if name not in _READ),
        ],
        gc=False,
    )
    return msgspec.json.Decoder(head).decode


class _Pairs(dict[str, Any]):
    """A JSON object read by ``json``, knowing which of its keys it had more than once."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.repeated: set[str] = set()
        if len(pairs) != len(self):
            seen: set[str] = set()
            for key, _ in pairs:
                (self.repeated if key in seen else seen).add(key)


def _repeats_a_field(payload: bytes, objects: tuple[str, ...], delta_keys: tuple[str, ...]) -> bool:
    """Whether a field of the structs (the head's, a choice's, a delta's, a tool call's) comes twice in its
    object: the decode reads each value (and refuses a wrong one) but keeps the last, so the facts of the
    others would be lost (a delta key the row refuses, a tool-call index past the limit, in a first value)."""
    try:
        head = json.loads(payload, object_pairs_hook=_Pairs)
    except (ValueError, RecursionError):  # (msgspec took it: cannot be)
        return True
    repeated = head.repeated if isinstance(head, _Pairs) else set()
    if repeated & {*_READ, *objects}:
        return True
    for choice in head.get("choices") or ():
        if not isinstance(choice, _Pairs) or choice.repeated & {"index", "delta"}:
            return True
        delta = choice.get("delta")
        if isinstance(delta, _Pairs) and delta.repeated & set(delta_keys):
            return True
        for call in delta.get("tool_calls") or () if isinstance(delta, _Pairs) else ():
            if not isinstance(call, _Pairs) or "index" in call.repeated:
                return True
    return False


def scan_run(body: bytes, objects: tuple[str, ...], delta_keys: tuple[str, ...]) -> ScanFacts | None:
    """The facts of ``body`` (see the module), or None where the check must decode it."""
    if not isinstance(body, bytes):
        raise TypeError("scan_run(body, objects, delta_keys) takes bytes and two tuples of names")
    decode = _decode_head(_names(objects, "objects"), _names(delta_keys, "delta_keys"))
    if not body.startswith(b"data: ") or not body.endswith(b"\n\n") or 13 in body or not is_utf8(body):
        return None
    payloads = body[6:-2].split(b"\n\ndata: ")
    if any(10 in payload for payload in payloads):  # a payload of several lines, or more than a blank line
        return None
    heads = []
    for payload in payloads:
        try:
            head = decode(payload)
            msgspec.json.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            return None
        if _repeats_a_field(payload, objects, delta_keys):
            return None
        if head.error is not UNSET and head.choices is UNSET:  # the engine's error event
            return None
        heads.append(head)
    model = heads[0].model
    none = all(head.model is UNSET for head in heads)
    if not none and not all(type(head.model) is str and head.model == model for head in heads):
        return None  # some chunk sends another model, or none, or one that is not a string
    token = None if model is UNSET else msgspec.json.encode(model)

    keys, top_index = 0, -1
    texts: list[bool] = []
    spans: list[tuple[int, int]] = []
    offsets: list[int] = []
    begin = 6
    for payload, head in zip(payloads, heads, strict=True):
        spans.append((begin, begin + len(payload)))
        text = False
        for choice in head.choices or ():
            delta = choice.delta
            if delta is None:
                continue
            for bit, key in enumerate(delta_keys):
                value = getattr(delta, key)
                if value is not UNSET:
                    keys |= 1 << bit
                    text = text or (key != "role" and bool(value))
            for call in getattr(delta, "tool_calls", None) or ():
                if call.index is not None:
                    top_index = max(top_index, call.index)
        texts.append(text)
        if any(getattr(head, name) is not None for name in objects if name not in _READ):
            offsets += (begin, begin + len(payload))
        begin += len(payload) + 8  # its blank line and the next "data: "
    return ScanFacts(
        count=len(heads),
        model=token,
        delta_keys=keys,
        top_index=top_index,
        text_count=sum(texts),
        first_text=texts.index(True) if True in texts else -1,
        objects=tuple(offsets),
        positions=_positions(body, payloads, spans, token, decode),
    )


def _positions(
    body: bytes,
    payloads: list[bytes],
    spans: list[tuple[int, int]],
    token: bytes | None,
    decode: Callable[[bytes], Any],
) -> bytes | None:
    """Each payload's model token's offset in ``body`` where ``"model":<token>`` occurs once in each, as its
    head's model field; None otherwise."""
    if token is None or len(body) > 0xFFFFFFFF:
        return None
    pattern = b'"model":' + token
    other = b'"x"' if token == b'""' else b'""'
    at = array.array("I")
    for payload, (begin, _end) in zip(payloads, spans, strict=True):
        found = payload.find(pattern)
        if found < 0 or payload.find(pattern, found + 1) >= 0:
            return None
        start = found + 8
        changed = payload[:start] + other + payload[start + len(token) :]
        try:
            if decode(changed).model != msgspec.json.decode(other):  # the pattern is another key's, not the head's
                return None
        except (msgspec.DecodeError, RecursionError):  # (it cannot be: a string token put for a string token)
            return None
        at.append(begin + start)
    return at.tobytes()
