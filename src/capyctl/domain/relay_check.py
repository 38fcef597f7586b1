"""The streamed relay's fast path: one typed decode per chunk, then the three stages' work in one pass.

The stages (``DeltaVerifier``, ``Meter``, ``ModelRewrite``) read a chunk as a
dict. What they need is much less: ``model``, each choice's ``index`` and
``delta`` (its keys, its text values), the tool-call indexes, and the engine
objects the meter keeps. The SSE parser decodes each payload into the small
structs below (``decode_head``), and ``TypedRelay`` does the stages' work on
them, without a dict and without a call per stage.

Both ways give the same answer, byte for byte, error for error:

- The structs name every field the recorded engines send (typed ``Any`` when
  the relay does not read it) and forbid all others. So every value is still
  decoded, and checked, by the same msgspec decoders as the dict decode:
  msgspec's skipping of unknown fields checks neither UTF-8 nor number range,
  and would let through a payload that the dict decode refuses.
- Whatever the structs refuse (an unknown field or delta key, a value of the
  wrong type, a payload that is no JSON object) the parser decodes as a dict,
  and that chunk takes the stages: their errors are the reference.
- ``TypedRelay`` declines a chunk whose answer it does not own before it
  changes anything: a delta key known here that its row refuses, a tool-call
  index at the limit, ``"model":<json>`` bytes it cannot find (the stages
  re-encode such a chunk), an encoding error. The relay then runs the stages.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from capyctl.domain.fields import FieldRow
from capyctl.domain.metrics import ENGINE_OBJECTS, Meter
from capyctl.domain.streams import DEFAULT_MAX_TOOL_CALLS, Chunk, Run

_encode = msgspec.json.encode
Index = Annotated[int, msgspec.Meta(ge=0)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A struct of the typed pass: an unknown field sends the chunk to the dict decode (and the stages).

    Every known field is decoded (``Any`` when the relay does not read it), so
    that what a full decode refuses is refused here too. A field missing here
    costs speed only, never a different answer. Fields are declared in the
    order engines send them, the order msgspec matches fastest. ``gc=False``:
    decoded JSON holds no cycles.
    """


class ToolCall(_Strict):
    index: Index | None = None
    id: Any = None
    type: Any = None
    function: Any = None


class Delta(_Strict):
    """Every key any field row allows; UNSET when not sent (a row that refuses a key sees it sent)."""

    role: Any = UNSET
    content: Any = UNSET
    reasoning: Any = UNSET
    reasoning_content: Any = UNSET
    tool_calls: list[ToolCall] | None | UnsetType = UNSET


class Choice(_Strict):
    index: Index | None = None
    delta: Delta | None = None
    logprobs: Any = None
    finish_reason: Any = None
    stop_reason: Any = None
    token_ids: Any = None
    matched_stop: Any = None
    weight_versions: Any = None
    reasoning_tokens: Any = None


class Head(_Strict):
    """A chunk as the relay reads it. ``error`` sent without ``choices`` is the engine's failure event,
    which the parser builds from the dict decode."""

    id: Any = None
    object: Any = None
    created: Any = None
    model: Any = UNSET
    choices: list[Choice] | None | UnsetType = UNSET
    system_fingerprint: Any = None
    service_tier: Any = None
    prompt_token_ids: Any = None
    prompt_text: Any = None
    kv_transfer_params: Any = None
    exact_mode: Any = None
    speculative: Any = None
    reasoning_tokens: Any = None
    usage: Any = None
    metrics: Any = None
    timings: Any = None
    tensorfold: Any = None
    error: Any = UNSET


DELTA_KEYS = Delta.__struct_fields__
decode_head = msgspec.json.Decoder(Head).decode  # raises msgspec.DecodeError (or RecursionError) when it refuses
decode_heads = msgspec.json.Decoder(Head).decode_lines

try:  # the run scan in C, built with the package (_speedups/scan.c); without it, every run is decoded into heads
    from capyctl._speedups.scan import respell as _respell
    from capyctl._speedups.scan import scan_run as _scan_run
except ImportError:  # pragma: no cover - a build without a C compiler
    _scan_run = None
scan_run: Callable[[bytes], tuple[Any, ...] | None] | None = _scan_run
"""``scan_run(body)``: a run's facts read straight from its bytes (see ``_speedups/scan.c``), or None where the scan is
not sure (the run is then decoded into heads, as without it). None when the package was built without it."""


class Undecoded(Sequence[Any]):
    """A scanned run's heads: decoded when first read (a run the typed pass declines, a non-streamed answer),
    as a run's heads always were; their count is known from the scan."""

    __slots__ = ("_sse", "_count", "_heads")

    def __init__(self, sse: bytes, count: int) -> None:
        self._sse, self._count = sse, count
        self._heads: list[Head] | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        return self._decoded()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._decoded())

    def _decoded(self) -> list[Head]:
        if self._heads is None:
            self._heads = decode_heads(b"\n".join(self._sse[6:-2].split(b"\n\ndata: ")))
        return self._heads


class ChunkCheck(msgspec.Struct, frozen=True):
    """What one engine version's field row asks of a typed chunk; built once per (family, version)."""

    refused: tuple[str, ...]  # delta keys the structs know that the row does not allow
    max_tool_calls: int


def chunk_check(row: FieldRow, max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS) -> ChunkCheck:
    return ChunkCheck(tuple(key for key in DELTA_KEYS if key not in row.delta), max_tool_calls)


# What a TypedRelay needs of its check and name that is the same for every stream of them (the refused keys'
# getter and bits, the name's JSON and the model patterns met), made by the first stream, not each one
_MADE: dict[tuple[ChunkCheck, str], tuple[Any, ...]] = {}
_MADE_MOST = 1024  # (check, name) pairs kept: engine versions times deployments
_PATTERNS_MOST = 64  # model names an engine sent kept per (check, name)


class TypedRelay:
    """One stream's ``DeltaVerifier``, ``Meter`` and ``ModelRewrite``, on a chunk's ``head``, in one pass.

    ``relay(chunk, now)`` is True when the chunk passed and its work is done
    (meter updated, ``raw`` rewritten), False when the stages must answer
    for it: then nothing has been touched. ``now`` is the clock's reading for
    the chunk (read per chunk, as the Meter does).
    """

    __slots__ = ("_refused", "_unset", "_refused_bits", "_max_tool_calls", "_meter", "_name", "_token",
                 "_replacement", "_patterns")

    def __init__(self, check: ChunkCheck, meter: Meter, name: str) -> None:
        made = _MADE.get((check, name))
        if made is None:  # the first stream of this engine version under this name
            if len(_MADE) >= _MADE_MOST:
                _MADE.clear()
            refused, unset = _refused_getter(check.refused)
            token = _encode(name)
            made = _MADE[(check, name)] = (refused, unset, _bits(check.refused), check.max_tool_calls, token,
                                           b'"model":' + token, {})
        (self._refused, self._unset, self._refused_bits, self._max_tool_calls, self._token, self._replacement,
         self._patterns) = made
        self._meter = meter
        self._name = name

    def __call__(self, chunk: Chunk, now: float) -> bool:
        head = chunk.head
        text = self._text(head)
        if text is None:
            return False
        raw = None
        sent = head.model
        if sent is not UNSET and sent != self._name and (raw := self._splice(chunk.raw, sent)) is None:
            return False
        meter = self._meter
        meter.last_at = now
        if text:
            meter.text_chunks += 1
            if meter.first_text_at is None:
                meter.first_text_at = now
        if _has_objects(head):
            self._keep(head)
        if raw is not None:
            chunk.raw = raw
        return True

    def run(self, run: Run, now: Callable[[], float]) -> bool:
        """A whole Run, as ``__call__`` would do its chunks one by one: True when every chunk passed (the
        meter updated, ``run.sse`` rewritten); False, with nothing touched, when one must go to the stages
        (the relay then takes the run's chunks one by one). ``now`` is the meter's clock."""
        if run.facts is not None:
            return self._scanned(run, now)
        name = self._name
        texts: list[bool] = []
        rewrite = False
        alike = True  # every chunk sent the same model (and so may share a prefix; see _rewrite_alike)
        first = run.heads[0].model
        for head in run.heads:
            text = self._text(head)
            if text is None:
                return False
            texts.append(text)
            sent = head.model
            if sent is not UNSET and sent != name:
                rewrite = True
            if alike and sent != first:
                alike = False
        if rewrite:
            sse = (alike and type(first) is str and self._rewrite_alike(run, first)) or self._rewritten(run)
            if sse is None:
                return False
            run.sse = sse
        # The clock as the meter reads it chunk by chunk: a chunk after the first with text is later than it
        meter = self._meter
        at = now()
        if True in texts:
            meter.text_chunks += texts.count(True)
            if meter.first_text_at is None:
                meter.first_text_at = at
                if texts.index(True) < len(texts) - 1:
                    at = now()
        meter.last_at = at
        for head in run.heads:
            if _has_objects(head):
                self._keep(head)
        return True

    def _scanned(self, run: Run, now: Callable[[], float]) -> bool:
        """``run`` for a scanned run, from its facts: the same checks, rewrite and meter updates as over its
        heads, without them (only the chunks that carry an engine object the meter keeps are decoded)."""
        count, model, keys, top_index, text_count, first_text, objects, positions = run.facts
        if keys & self._refused_bits or top_index >= self._max_tool_calls:
            return False  # a chunk the stages must answer for, as _text says
        body = run.sse
        if model is not None and model != self._token:  # every chunk sent this same plain string
            if positions is not None:  # each chunk's only "model":<model> is its model field: respelled there
                sse: bytes | None = _respell(body, positions, model, self._token)
            else:
                pattern = self._patterns.get(model)
                if pattern is None:
                    pattern = b'"model":' + model
                    self._keep_pattern(model, pattern)
                sse = self._rewrite_alike_pattern(run, pattern) or self._rewritten(run)
            if sse is None:
                return False
            run.sse = sse
        meter = self._meter
        at = now()
        if text_count:
            meter.text_chunks += text_count
            if meter.first_text_at is None:
                meter.first_text_at = at
                if first_text < count - 1:
                    at = now()
        meter.last_at = at
        for i in range(0, len(objects), 2):  # (begin, end) of each such payload in the bytes as they came
            self._keep(decode_head(body[objects[i]:objects[i + 1]]))
        return True

    def _text(self, head: Any) -> bool | None:
        """Whether the chunk carries generated text; None when the stages must answer for it (a delta key
        the row refuses, a tool-call index at the limit)."""
        text = False
        if head.choices:
            refused, unset, limit = self._refused, self._unset, self._max_tool_calls
            for choice in head.choices:
                delta = choice.delta
                if delta is None:
                    continue
                if refused is not None and refused(delta) != unset:
                    return None
                calls = delta.tool_calls
                if calls:
                    for call in calls:
                        if call.index is not None and call.index >= limit:
                            return None
                if not text and (delta.content or delta.reasoning_content or delta.reasoning or calls):
                    text = True
        return text

    def _splice(self, raw: bytes, sent: Any) -> bytes | None:
        """``raw`` with its first ``"model":<sent>`` set to the name; None when that pattern cannot be made
        or is not there (the stages then re-encode the chunk, or raise)."""
        pattern = self._patterns.get(sent) if type(sent) is str else None
        if pattern is None and (pattern := self._pattern(sent)) is None:
            return None
        spliced = raw.replace(pattern, self._replacement, 1)  # one search, not `in` and then another
        return None if spliced == raw else spliced  # equal: not there (pattern and name differ)

    def _rewrite_alike(self, run: Run, sent: str) -> bytes | None:
        """The run rewritten by C calls over its whole bytes when every chunk begins with the same bytes up
        to its first ``"model":<sent>`` (an engine that repeats id, object and created, as vLLM does) and
        holds no other; None otherwise, and ``_rewritten`` splices chunk by chunk.

        Exact: the prefix ``data: {"<letter>...`` cannot occur inside a valid JSON payload (the quote after
        the brace would end a string, and a letter cannot follow a string) nor span a blank line, so each
        of its occurrences begins an event: as many as there are chunks means every chunk begins with it,
        and so holds ``"model":<sent>`` first where the prefix does. As many of those as chunks means that
        is each chunk's only one, and replacing them all is the first-occurrence splice of each.
        """
        pattern = self._patterns.get(sent) or self._pattern(sent)
        return None if pattern is None else self._rewrite_alike_pattern(run, pattern)

    def _rewrite_alike_pattern(self, run: Run, pattern: bytes) -> bytes | None:
        """``_rewrite_alike`` for the bytes ``"model":<sent>``."""
        sse = run.sse
        if sse[6:8] != b'{"' or not (sse[8:9].isalpha() or sse[8:9] == b"_"):  # data: {"<a letter or _>
            return None
        end = sse.find(pattern, 0, sse.find(b"\n"))
        count = len(run.heads)
        if end == -1 or sse.count(sse[:end + len(pattern)]) != count:
            return None
        parts = sse.split(pattern)  # (split and join: faster than replace, and they count)
        return self._replacement.join(parts) if len(parts) == count + 1 else None

    def _rewritten(self, run: Run) -> bytes | None:
        """The run's bytes with each chunk's ``model`` set to the name, as ``__call__`` splices one chunk;
        None when a chunk's splice is not found."""
        payloads = run.payloads()
        name = self._name
        for i, head in enumerate(run.heads):
            sent = head.model
            if sent is UNSET or sent == name:
                continue
            spliced = self._splice(payloads[i], sent)
            if spliced is None:
                return None
            payloads[i] = spliced
        return b"data: " + b"\n\ndata: ".join(payloads) + b"\n\n"

    def _pattern(self, sent: Any) -> bytes | None:
        """``"model":<sent>`` as ``ModelRewrite`` searches for it; None when it cannot be encoded (the stages
        then raise what they raise)."""
        try:
            pattern = b'"model":' + _encode(sent)
        except Exception:  # whatever it is, the stages raise it, in their order
            return None
        if type(sent) is str:
            self._keep_pattern(sent, pattern)
        return pattern

    def _keep_pattern(self, sent: Any, pattern: bytes) -> None:
        """Remember ``"model":<sent>`` for the streams of this name: a few names at most, unless the engine
        sends a new one each time (then the oldest are forgotten)."""
        if len(self._patterns) >= _PATTERNS_MOST:
            self._patterns.clear()
        self._patterns[sent] = pattern

    def _keep(self, head: Any) -> None:
        seen = self._meter.seen
        for name in ENGINE_OBJECTS:  # in the meter's order
            value = getattr(head, name)
            if value is not None:
                seen[name] = value


@functools.lru_cache(maxsize=64)
def _refused_getter(refused: tuple[str, ...]) -> tuple[Callable[[Any], Any] | None, Any]:
    """One C call that reads every refused key of a delta, and what it reads when none was sent (UNSET, or
    all UNSET); made once per set of keys, not per stream."""
    if not refused:
        return None, UNSET
    return operator.attrgetter(*refused), UNSET if len(refused) == 1 else (UNSET,) * len(refused)


def _bits(refused: tuple[str, ...]) -> int:
    """The scan's delta-key bits (one per ``Delta`` field, in its order) of the refused keys."""
    return sum(1 << DELTA_KEYS.index(key) for key in refused)


def _has_objects(head: Any) -> bool:
    """The chunk carries an engine object the meter keeps (usage, metrics, timings, tensorfold)."""
    return (head.usage is not None or head.metrics is not None or head.timings is not None
            or head.tensorfold is not None)
