"""What an engine's stream is made of on its way to a client.

The engine adapter parses each network read of an SSE answer into events:
``Chunks`` (the ``data:`` payloads that came together, kept as their SSE
bytes), ``Comment`` (``:`` lines, keep-alives) and ``Done`` (``data:
[DONE]``). The relay check (``relay_check.StreamCheck``) reads the chunks'
few fields it needs and hands their bytes on, touching only a ``model`` it
renames; everything else is relayed byte for byte. A non-streamed answer is
assembled (``Assembler``) from the same relayed bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import msgspec

from capyctl.domain.errors import EdgeError

_encode = msgspec.json.encode


class ScanFacts(msgspec.Struct, frozen=True, gc=False):
    """What the scan of a read of plain SSE chunks (``data: {...}\\n\\n`` each) found in it, for the relay check
    (``relay_check.StreamCheck``) to work from instead of decoding the chunks: the answer of the C scan
    (``_speedups/scan.c``, which builds it by a call of this type, its fields in this order) and of its
    Python reference (``_speedups/scan_reference.py``). ``delta_keys`` and ``objects`` are read by the names
    the scan was told (the field table's delta keys, the engine objects the meter keeps)."""

    count: int  # the chunks
    model: bytes | None  # the JSON string every chunk sends as model, quotes included; None: none sends one
    delta_keys: int  # a bit per delta key (in the order told) that some choice's delta sent, null included
    top_index: int  # the highest tool-call index any delta sent; -1: none did
    text_count: int  # the chunks that carry generated text (a truthy delta value but a role, or a tool call)
    first_text: int  # the first of them; -1: none
    objects: tuple[int, ...]  # where each payload that sends an engine object (not null) begins and ends, flat
    positions: bytes | None  # each chunk's model token's offset (native uint32), where respelling it there is
    # each chunk's first-occurrence splice of "model":<model>; None where the scan does not vouch for that


class Chunks(msgspec.Struct, gc=False):
    """The ``data:`` payloads of one read, in order, as SSE: ``data: <payload>\\n\\n`` each.

    ``payloads`` is None when each payload is one line: they are split from ``sse`` when first asked for
    (``payload_list``). A payload of several lines comes in a ``Chunks`` of its own. ``facts`` and
    ``respell`` are the C scan's reading of ``sse`` and the respelling at its positions
    (``_speedups.scan``), when the parser ran it.
    """

    sse: bytes
    payloads: list[bytes] | None = None
    facts: ScanFacts | None = None
    respell: Callable[[bytes, bytes, bytes, bytes], bytes] | None = None

    def payload_list(self) -> list[bytes]:
        if self.payloads is None:
            self.payloads = payloads_of(self.sse)
        return self.payloads


class Comment(msgspec.Struct, gc=False):
    raw: bytes  # the comment line(s), without the final blank line


class Done(msgspec.Struct, gc=False):
    pass


DONE = Done()
StreamEvent = Chunks | Comment | Done


def sse_of(payloads: list[bytes]) -> bytes:
    """Payloads as SSE data events; a payload of several lines (always alone: it has a ``Chunks`` of its own)
    is written as as many ``data:`` lines."""
    if not payloads:
        return b""
    body = b"\n\ndata: ".join(payloads)
    if len(payloads) == 1 and 10 in body:
        body = body.replace(b"\n", b"\ndata: ")
    return b"data: " + body + b"\n\n"


def payloads_of(sse: bytes) -> list[bytes]:
    """The payloads of SSE data events as ``sse_of`` writes them (comments and ``[DONE]`` left out)."""
    if sse.startswith(b"data: {") and b"\n\n:" not in sse and b"[DONE]" not in sse:
        payloads = sse[6:-2].split(b"\n\ndata: ")
        if sse.count(b"\n") == 2 * len(payloads):  # no payload of several lines
            return payloads
    return [
        block[6:].replace(b"\ndata: ", b"\n")
        for block in sse.split(b"\n\n")
        if block.startswith(b"data: ") and block != b"data: [DONE]"
    ]


def respell(sse: bytes, positions: bytes, old: bytes, new: bytes) -> bytes:
    """``sse`` with ``new`` in place of the ``old`` token at each offset in ``positions`` (native uint32 values,
    in order): the Python reference of the C scan's ``respell`` (``_speedups/scan_reference.py`` gives it by
    that name, beside ``scan_run``). ValueError where ``old`` is not there."""
    if len(positions) % 4:
        raise ValueError("positions must be whole uint32 values")
    parts: list[bytes] = []
    start = 0
    for at in memoryview(positions).cast("I"):
        if at < start or sse[at : at + len(old)] != old:
            raise ValueError(f"the token is not at offset {at}")
        parts += (sse[start:at], new)
        start = at + len(old)
    parts.append(sse[start:])
    return b"".join(parts)


class Relayed(enum.IntEnum):
    """What a pumped stream's ``deliver`` says of a batch it relayed (see ``EngineAnswer``)."""

    MORE = 0  # go on reading
    FULL = 1  # the client cannot take more for now: pause reading until it has drained
    ENDED = 2  # the batch ended the stream


DEFAULT_MAX_TOOL_CALLS = 256  # tool calls in one answer; an index past it is an edge_error


def _merge_tool_calls(into: list[dict[str, Any]], pieces: list[dict[str, Any]], limit: int) -> None:
    """Join tool-call pieces by index (the verifier checked their shape and the index limit)."""
    for piece in pieces:
        index = piece.get("index")
        if index is None:
            index = len(into)
        if index >= limit:
            raise EdgeError(f"the answer has more than the limit of {limit} tool calls")
        while len(into) <= index:
            into.append({})
        call = into[index]
        for key, value in piece.items():
            if key == "index":
                continue
            if key == "function" and isinstance(value, dict):
                function = call.setdefault("function", {})
                for fkey, fvalue in value.items():
                    if isinstance(fvalue, str) and isinstance(function.get(fkey), str):
                        function[fkey] += fvalue
                    elif fvalue is not None:
                        function[fkey] = fvalue
            elif value is not None:
                call[key] = value


class _ChoiceBuilder:
    __slots__ = ("index", "role", "texts", "tool_calls", "extra", "max_tool_calls")

    def __init__(self, index: int, max_tool_calls: int) -> None:
        self.index = index
        self.max_tool_calls = max_tool_calls
        self.role = "assistant"
        self.texts: dict[str, list[str]] = {}
        self.tool_calls: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {"finish_reason": None}

    def add(self, choice: dict[str, Any]) -> None:
        for key, value in (choice.get("delta") or {}).items():
            if key == "role":
                self.role = value or self.role
            elif key == "tool_calls":
                _merge_tool_calls(self.tool_calls, value or [], self.max_tool_calls)
            elif isinstance(value, str):
                self.texts.setdefault(key, []).append(value)
            elif value is not None:
                self.texts.setdefault(key, [])
        for key, value in choice.items():
            if key in ("delta", "index"):
                continue
            if isinstance(value, list) and isinstance(self.extra.get(key), list):
                self.extra[key] = self.extra[key] + value
            elif key == "logprobs" and isinstance(value, dict) and isinstance(self.extra.get(key), dict):
                merged = self.extra[key]
                for lkey, lvalue in value.items():
                    merged[lkey] = (merged.get(lkey) or []) + (lvalue or [])
            elif value is not None or key not in self.extra:
                self.extra[key] = value

    def build(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": None}
        for key, parts in self.texts.items():
            message[key] = "".join(parts)
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return {"index": self.index, "message": message, **self.extra}


class Assembler:
    """Builds a ``chat.completion`` from the chunks of one engine stream.

    Text keys of each ``delta`` are joined per choice, tool calls are joined by
    their index, the other choice fields keep their last non-null value (lists
    are concatenated), and the engine's own top-level fields (``timings``,
    ``system_fingerprint``, ``usage`` ...) keep their last value.
    """

    def __init__(self, model: str, max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS) -> None:
        self._model = model
        self._max_tool_calls = max_tool_calls
        self._top: dict[str, Any] = {}
        self._choices: dict[int, _ChoiceBuilder] = {}

    def add(self, obj: dict[str, Any]) -> None:
        for key, value in obj.items():
            if key == "choices":
                for choice in value or ():
                    index = choice.get("index") or 0
                    builder = self._choices.get(index)
                    if builder is None:
                        builder = self._choices[index] = _ChoiceBuilder(index, self._max_tool_calls)
                    builder.add(choice)
            elif key != "object":
                self._top[key] = value

    def result(self) -> dict[str, Any]:
        top = self._top
        answer: dict[str, Any] = {"id": top.get("id"), "object": "chat.completion", "created": top.get("created")}
        answer["model"] = self._model
        answer["choices"] = [self._choices[i].build() for i in sorted(self._choices)]
        for key, value in top.items():
            answer.setdefault(key, value)
        return answer
