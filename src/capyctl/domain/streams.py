"""The relay pipeline: what happens to each engine chunk on its way to a client.

An engine stream is a sequence of events (``Chunk``, ``Comment``, ``EngineFailure``,
``Done``). Each ``Chunk`` keeps its raw JSON bytes (``raw``) and is decoded
once: the SSE parser decodes it into the relay's small typed structs
(``head``, see ``relay_check``), and into a dict (``obj``) only when a reader
asks for one, or when the typed decode refused it. Stages read ``obj``, and
only a stage that must change the chunk touches ``raw``. Everything a stage
does not own is relayed byte for byte. Stages run in order; a stage may raise
a ``CapyError`` to end the stream (the verifier of delta keys is such a
stage). The streamed relay does the stages' work on ``head`` in one pass
where it can (``relay_check.TypedRelay``) and writes ``raw`` as SSE; the
non-streamed path runs the stages and feeds ``obj`` to ``Assembler``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from capyctl.domain.errors import EdgeError

_encode = msgspec.json.encode
_decode = msgspec.json.Decoder(dict[str, Any]).decode


class Chunk(msgspec.Struct):
    """One ``data:`` payload: its bytes, and its decoded forms.

    Built as ``Chunk(raw, obj)`` (a dict at once) or ``Chunk(raw, None, head)``
    (the parser's typed decode). ``obj`` is decoded from ``raw`` when first
    read; the stages read it before they change ``raw``. (Read after the typed
    pass rewrote ``model`` in ``raw``, it is the rewritten chunk's dict.)
    """

    raw: bytes
    decoded: dict[str, Any] | None = None
    head: Any = None  # a relay_check.Head, or None

    @property
    def obj(self) -> dict[str, Any]:
        obj = self.decoded
        if obj is None:
            obj = self.decoded = _decode(self.raw)
        return obj


class Run(msgspec.Struct):
    """Several chunks that came in one network read, each a plain ``data: {...}`` event (one line, one
    space after the colon): their SSE bytes as they came, and their typed heads, in order.

    The relay checks a run as a whole and sends its bytes on as one piece; a run it cannot answer for
    becomes its chunks (``chunks()``), each relayed as a chunk of its own would be.
    """

    sse: bytes  # b"data: <payload>\n\n" for each chunk
    heads: Sequence[Any]  # a relay_check.Head for each chunk (decoded when first read, for a scanned run)
    facts: Any = None  # a scanned run's facts (relay_check.scan_run), which the typed pass reads instead of heads

    def payloads(self) -> list[bytes]:
        return self.sse[6:-2].split(b"\n\ndata: ")

    def chunks(self) -> list[Chunk]:
        return [Chunk(raw, None, head) for raw, head in zip(self.payloads(), self.heads)]


class Comment(msgspec.Struct):
    raw: bytes  # the comment line(s), without the final blank line


class EngineFailure(msgspec.Struct):
    """A ``data:`` event carrying ``{"error": ...}``: the engine gave up mid-stream."""

    raw: bytes
    error: dict[str, Any]


class Done(msgspec.Struct):
    pass


StreamEvent = Chunk | Run | Comment | EngineFailure | Done


class Relayed(enum.IntEnum):
    """What a pumped stream's ``deliver`` says of a batch it relayed (see ``EngineSession``)."""

    MORE = 0  # go on reading
    FULL = 1  # the client cannot take more for now: pause reading until it has drained
    ENDED = 2  # the batch ended the stream
Stage = Callable[[Chunk], Chunk]

GENERATED_TEXT_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")
DEFAULT_MAX_TOOL_CALLS = 256  # tool calls in one answer; an index past it is an edge_error


class ModelRewrite:
    """Sets ``model`` to the name the client sent, touching only those bytes."""

    __slots__ = ("_name", "_replacement", "_cache")

    def __init__(self, name: str) -> None:
        self._name = name
        self._replacement = b'"model":' + _encode(name)
        self._cache: dict[str, bytes] = {}

    def __call__(self, chunk: Chunk) -> Chunk:
        obj = chunk.obj
        sent = obj.get("model")
        if sent == self._name or (sent is None and "model" not in obj):
            return chunk
        pattern = self._cache.get(sent) if isinstance(sent, str) else None
        if pattern is None:
            pattern = b'"model":' + _encode(sent)
            if isinstance(sent, str):
                if len(self._cache) >= 64:  # (an engine that sends a new name each time: the oldest are forgotten)
                    self._cache.clear()
                self._cache[sent] = pattern
        obj["model"] = self._name
        if pattern in chunk.raw:
            chunk.raw = chunk.raw.replace(pattern, self._replacement, 1)
        else:  # unusual spacing from the engine: re-encode rather than risk a wrong splice
            chunk.raw = _encode(obj)
        return chunk


def has_generated_text(obj: dict[str, Any]) -> bool:
    """True when a chunk carries generated text; a role-only opening chunk does not."""
    for choice in obj.get("choices") or ():
        delta = choice.get("delta")
        if delta and (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                      or delta.get("tool_calls")):
            return True
    return False


def run_stages(stages: Sequence[Stage], chunk: Chunk) -> Chunk:
    for stage in stages:
        chunk = stage(chunk)
    return chunk


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
