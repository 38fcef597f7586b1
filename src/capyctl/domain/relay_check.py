"""The streamed relay's check: one typed reading of each chunk, per engine version, and the one rewrite.

A chunk is checked on the few fields the relay reads: ``model`` (renamed to
the deployment's name), ``error`` without ``choices`` (the engine's own error
event, relayed untouched), each choice's ``index`` and ``delta`` (its keys
against the engine version's field row, its text), the tool-call indexes
(below the limit), and the engine objects the meter keeps (``usage``,
``metrics``, ``timings``, ``tensorfold``). Those are decoded into the small
structs below; every other field is skipped as JSON and relayed byte for
byte, unread. A delta key outside those the field table knows, or a read
field of the wrong type, fails the typed decode, and the chunk is refused;
its error is told by ``fields.DeltaVerifier`` over the chunk's dict. Each
engine version decodes into structs of its own (``ChunkRules``): a delta key
its row refuses and a tool-call index at the limit fail that decode too, in
every value of a repeated key (msgspec checks each as it reads it), so no
repeat can hide one from the check.

Where the engine adapter ran the C scan over a read (``Chunks.facts``, a
``streams.ScanFacts``, see ``_speedups/scan.c``), the check works from its
facts, read by name, instead of decoding; the scan only answers for reads
whose typed decode would give the same facts, and leaves the rest (``facts``
None) to the decode.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from capyctl.domain.errors import CapyError, EdgeError
from capyctl.domain.fields import FIELD_TABLE, DeltaVerifier, FieldRow
from capyctl.domain.metrics import ENGINE_OBJECTS, Meter
from capyctl.domain.streams import DEFAULT_MAX_TOOL_CALLS, Chunks, ScanFacts, sse_of

_encode = msgspec.json.encode
_decode_dict = msgspec.json.Decoder(dict[str, Any]).decode
Index = Annotated[int, msgspec.Meta(ge=0)]
OBJECT_NAMES = tuple(sorted(ENGINE_OBJECTS))  # the engine objects the meter keeps, as the C scan is told them


class ToolCall(msgspec.Struct, gc=False):
    index: Index | None = None


DELTA_KEYS = tuple(sorted(frozenset().union(*(row.delta for row in FIELD_TABLE))))  # every key the table knows
TEXT_KEYS = tuple(key for key in DELTA_KEYS if key not in ("role", "tool_calls"))  # text when truthy
_objects = operator.attrgetter(*OBJECT_NAMES)
_NO_OBJECTS = (None,) * len(OBJECT_NAMES)
# A delta: each key the field table knows, UNSET when not sent; any other key fails the decode. Made from the
# table, so that a key added there is read here (and told to the C scan) with no second list to keep.
Delta = msgspec.defstruct(
    "Delta",
    [(key, list[ToolCall] | None | UnsetType if key == "tool_calls" else Any, UNSET) for key in DELTA_KEYS],
    forbid_unknown_fields=True,
    gc=False,
)


class Choice(msgspec.Struct, gc=False):
    index: Index | None = None
    delta: Delta | None = None  # type: ignore[valid-type]  # Delta is made by defstruct: a variable to mypy


Head = msgspec.defstruct(
    "Head",
    [
        ("model", Any, UNSET),
        ("choices", list[Choice] | None | UnsetType, UNSET),
        ("error", Any, UNSET),
        *((name, Any, None) for name in OBJECT_NAMES),
    ],
    gc=False,
)  # any chunk's head, every key the table knows allowed: what the C scan answers for
_decode_head = msgspec.json.Decoder(Head).decode


def _row_head(allowed: frozenset[str], max_tool_calls: int) -> Any:
    """The head of one row's chunks: its delta holds only the keys the row allows (any other fails the decode),
    its tool-call indexes are below ``max_tool_calls``."""
    call = msgspec.defstruct(
        "ToolCall", [("index", Annotated[int, msgspec.Meta(ge=0, lt=max_tool_calls)] | None, None)], gc=False
    )
    delta = msgspec.defstruct(
        "Delta",
        [
            (key, list[call] | None | UnsetType if key == "tool_calls" else Any, UNSET)  # type: ignore[valid-type]  # call: made by defstruct, a variable to mypy
            for key in DELTA_KEYS
            if key in allowed
        ],
        forbid_unknown_fields=True,
        gc=False,
    )
    choice = msgspec.defstruct("Choice", [("index", Index | None, None), ("delta", delta | None, None)], gc=False)
    return msgspec.defstruct(
        "Head",
        [
            ("model", Any, UNSET),
            ("choices", list[choice] | None | UnsetType, UNSET),  # type: ignore[valid-type]  # choice: see above
            ("error", Any, UNSET),
            *((name, Any, None) for name in OBJECT_NAMES),
        ],
        gc=False,
    )


class ChunkRules:
    """What one engine version's field row asks of a chunk; made once per (family, version)."""

    __slots__ = ("verifier", "refused_bits", "max_tool_calls", "decode", "decode_lines", "texts")

    def __init__(self, row: FieldRow, where: str, max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS) -> None:
        self.verifier = DeltaVerifier(row.delta, where, max_tool_calls)
        # the C scan's bits of the known keys the row refuses
        self.refused_bits = sum(1 << i for i, key in enumerate(DELTA_KEYS) if key not in row.delta)
        self.max_tool_calls = max_tool_calls
        decoder = msgspec.json.Decoder(_row_head(row.delta, max_tool_calls))
        self.decode, self.decode_lines = decoder.decode, decoder.decode_lines
        texts = [key for key in DELTA_KEYS if key in row.delta and key != "role"]  # text (or a call) when truthy
        self.texts: Callable[[Any], tuple[Any, ...]] = (
            operator.attrgetter(*texts) if len(texts) > 1 else lambda delta: tuple(getattr(delta, k) for k in texts)
        )


class Refused(Exception):
    """A chunk was refused: ``sent`` is the SSE of the chunks before it in its read (still relayed), ``error``
    ends the stream."""

    def __init__(self, sent: bytes, error: CapyError) -> None:
        super().__init__(error)
        self.sent = sent
        self.error = error


_NONE = object()  # _take: no chunk sent a model
_MANY = object()  # _take: the chunks sent different models


class StreamCheck:
    """One stream's check, meter and model rewrite, read by read.

    ``check(chunks)`` gives the bytes to send for ``chunks``: as they came, with
    ``model`` set to ``name`` where an engine sent another. It raises
    ``Refused`` at the first chunk it refuses. ``failure`` holds the engine's
    own error event (a dict) once one came: it is relayed untouched, and the
    stream then ends without metrics.
    """

    __slots__ = ("_rules", "_meter", "_now", "_name", "_token", "_replacement", "_sent", "_pattern", "failure")

    def __init__(self, rules: ChunkRules, meter: Meter, name: str, now: Callable[[], float]) -> None:
        self._rules = rules
        self._meter = meter
        self._now = now
        self._name = name
        self._token = _encode(name)
        self._replacement = b'"model":' + self._token
        self._sent: Any = _NONE  # the last model name the engine sent, and its pattern (an engine sends one)
        self._pattern = b""
        self.failure: dict[str, Any] | None = None

    def check(self, chunks: Chunks) -> bytes:
        facts = chunks.facts
        if facts is not None:
            sent = self._scanned(chunks, facts)
            if sent is not None:
                return sent
        payloads = chunks.payload_list()
        if not chunks.sse.isascii() and not is_utf8(chunks.sse):  # msgspec skips unread fields unchecked
            return self._one_by_one(payloads)
        rules = self._rules
        try:
            heads = [rules.decode(payloads[0])] if len(payloads) == 1 else rules.decode_lines(b"\n".join(payloads))
        except (msgspec.DecodeError, RecursionError):
            return self._one_by_one(payloads)
        if len(heads) != len(payloads):  # a blank payload, which decode_lines skips
            return self._one_by_one(payloads)
        return self._take(chunks.sse, payloads, heads)

    def _scanned(self, chunks: Chunks, facts: ScanFacts) -> bytes | None:
        """``check`` from the scan's facts; None where the decode must answer (a refusal to explain)."""
        rules = self._rules
        if facts.delta_keys & rules.refused_bits or facts.top_index >= rules.max_tool_calls:
            return None
        sse = chunks.sse
        model = facts.model
        if model is not None and model != self._token:  # every chunk sent this same plain string
            positions = facts.positions
            if positions is not None and chunks.respell is not None:
                sse = chunks.respell(sse, positions, model, self._token)
            else:
                sse = self._rename_alike(sse, b'"model":' + model, facts.count) or self._rename(
                    chunks.payload_list(), [rules.decode(p) for p in chunks.payload_list()]
                )
        self._metered(facts.text_count, facts.first_text, facts.count)
        objects = facts.objects
        for i in range(0, len(objects), 2):  # (begin, end) of each payload that carries an engine object
            self._keep(_decode_head(chunks.sse[objects[i] : objects[i + 1]]))
        return sse

    def _take(self, sse: bytes, payloads: list[bytes], heads: list[Any]) -> bytes:
        """``check`` over decoded heads: all of them at once when none is the engine's error event."""
        texts = 0
        first_text = -1
        model: Any = _NONE
        for i, head in enumerate(heads):
            if head.error is not UNSET and head.choices is UNSET:
                return self._one_by_one(payloads, heads)  # the engine's error event: untouched, unmetered
            if head.choices and self._text(head.choices):
                texts += 1
                if first_text < 0:
                    first_text = i
            sent = head.model
            if sent is not UNSET and model is not _MANY:
                model = sent if model is _NONE or model == sent else _MANY
        if model is not _NONE and model != self._name:
            renamed = None
            if type(model) is str:
                if model != self._sent:
                    self._sent, self._pattern = model, b'"model":' + _encode(model)
                renamed = self._rename_alike(sse, self._pattern, len(heads))
            try:
                sse = renamed or self._rename(payloads, heads)
            except (msgspec.DecodeError, RecursionError):  # a chunk to write anew that has no dict: refused
                return self._one_by_one(payloads, heads)
        self._metered(texts, first_text, len(heads))
        for head in heads:
            if _objects(head) != _NO_OBJECTS:
                self._keep(head)
        return sse

    def _one_by_one(self, payloads: list[bytes], heads: list[Any] | None = None) -> bytes:
        """``check`` chunk by chunk, where a read holds a refused chunk or the engine's error event."""
        out: list[bytes] = []
        for i, payload in enumerate(payloads):
            if not payload.isascii() and not is_utf8(payload):
                raise Refused(sse_of(out), EdgeError("the engine sent an event that is not valid UTF-8"))
            try:
                head = heads[i] if heads is not None else self._rules.decode(payload)
            except (msgspec.DecodeError, RecursionError) as exc:
                raise Refused(sse_of(out), self._why(payload, exc)) from exc
            if head.error is not UNSET and head.choices is UNSET:
                try:
                    error = _decode_dict(payload)["error"]
                except (msgspec.DecodeError, RecursionError) as exc:  # an unread field only a full decode refuses
                    raise Refused(sse_of(out), self._why(payload, exc)) from exc
                self.failure = error if isinstance(error, dict) else {"message": str(error)}
                out.append(payload)
                continue
            sent = head.model
            if sent is not UNSET and sent != self._name:
                try:
                    payload = self._splice(payload, sent)
                except (msgspec.DecodeError, RecursionError) as exc:
                    raise Refused(sse_of(out), self._why(payload, exc)) from exc
            text = bool(head.choices) and self._text(head.choices)
            self._metered(1 if text else 0, 0 if text else -1, 1)
            if _objects(head) != _NO_OBJECTS:
                self._keep(head)
            out.append(payload)
        return sse_of(out)

    def _why(self, payload: bytes, exc: Exception) -> CapyError:
        """The error a refused chunk ends the stream with: the verifier's, over the chunk's dict, or the decode's
        (a chunk whose dict passes: an index past 64 bits, a refused key in an earlier value of a repeated key)."""
        try:
            obj = _decode_dict(payload)
        except msgspec.DecodeError as error:
            return EdgeError(f"the engine sent an event CapyCTL cannot decode as a JSON object: {error}")
        except RecursionError:
            return EdgeError("the engine sent an event nested too deeply to decode")
        try:
            self._rules.verifier.verify(obj)
        except CapyError as error:
            return error
        return EdgeError(f"the engine sent a chunk CapyCTL cannot read: {exc}")

    def _text(self, choices: list[Any]) -> bool:
        """Whether a chunk's choices carry generated text (or a tool call)."""
        texts = self._rules.texts
        for choice in choices:
            delta = choice.delta
            if delta is not None and any(texts(delta)):
                return True
        return False

    def _metered(self, texts: int, first_text: int, count: int) -> None:
        """The meter told of ``count`` chunks, ``texts`` of them with text (the first at ``first_text``): the
        clock is read once for them, and once more when chunks came after the first text."""
        meter = self._meter
        at = self._now()
        if texts:
            meter.text_chunks += texts
            if meter.first_text_at is None:
                meter.first_text_at = at
                if first_text < count - 1:
                    at = self._now()
        meter.last_at = at

    def _keep(self, head: Any) -> None:
        seen = self._meter.seen
        for name, value in zip(OBJECT_NAMES, _objects(head), strict=False):
            if value is not None:
                seen[name] = value

    def _rename_alike(self, sse: bytes, pattern: bytes, count: int) -> bytes | None:
        """``sse`` with each chunk's ``"model":<sent>`` renamed, when every chunk begins with the same bytes up
        to its first such pattern and holds no other; None otherwise.

        Exact: the prefix ``data: {"<letter>...`` cannot occur inside a valid JSON payload (the quote after the
        brace would end a string, and a letter cannot follow a string) nor span a blank line, so each of its
        occurrences begins an event: as many as there are chunks means every chunk begins with it, and holds
        the pattern first where the prefix does. As many patterns as chunks means that is each one's only one.
        """
        if count > 1:
            if sse[6:8] != b'{"' or not (sse[8:9].isalpha() or sse[8:9] == b"_"):
                return None
            end = sse.find(pattern, 0, sse.find(b"\n"))
            if end == -1 or sse.count(sse[: end + len(pattern)]) != count:
                return None
        parts = sse.split(pattern)
        return self._replacement.join(parts) if len(parts) == count + 1 else None

    def _rename(self, payloads: list[bytes], heads: list[Any]) -> bytes:
        """Each chunk's ``model`` set to the name, payload by payload."""
        out = list(payloads)
        for i, head in enumerate(heads):
            sent = head.model
            if sent is not UNSET and sent != self._name:
                out[i] = self._splice(out[i], sent)
        return sse_of(out)

    def _splice(self, payload: bytes, sent: Any) -> bytes:
        """``payload`` with its first ``"model":<sent>`` set to the name; written anew from its dict where the
        engine spaced it otherwise (msgspec.DecodeError where it has none: an unread field the typed decode
        skipped holds invalid UTF-8 or a number out of range)."""
        spliced = payload.replace(b'"model":' + _encode(sent), self._replacement, 1)
        if spliced != payload:
            return spliced
        obj = _decode_dict(payload)
        obj["model"] = self._name
        return _encode(obj)


def is_utf8(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8 (msgspec skips the fields it does not read unchecked)."""
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


__all__ = ["ChunkRules", "Refused", "StreamCheck", "OBJECT_NAMES", "DELTA_KEYS"]
