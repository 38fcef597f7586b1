"""The streamed field table and the delta verifier."""

import pytest

from capyctl.domain.engines import EngineFamily as F
from capyctl.domain.engines import version_key
from capyctl.domain.errors import EdgeError, UnverifiedStream
from capyctl.domain.fields import FIELD_TABLE, DeltaVerifier, Provenance, row_for

# The seed's "Streamed fields" table: engine, a version inside the row, the delta keys allowed.
SEED_ROWS = [
    (F.VLLM, "0.29.0", {"role", "content", "reasoning", "tool_calls"}),
    (F.VLLM, "0.30.2", {"role", "content", "reasoning", "tool_calls"}),
    (F.VLLM, "0.31.0", {"role", "content", "reasoning", "tool_calls"}),
    (F.SGLANG, "0.5.18", {"role", "content", "reasoning_content", "tool_calls"}),
    (F.SGLANG, "0.5.21", {"role", "content", "reasoning_content", "tool_calls"}),
    (F.TENSORFOLD, "0.6.0", {"role", "content", "reasoning_content", "tool_calls"}),
    (F.TENSORFOLD, "0.6.6", {"role", "content", "reasoning_content", "tool_calls"}),
    (F.LLAMACPP, "0.6.0", {"role", "content", "reasoning_content", "tool_calls"}),
]


@pytest.mark.parametrize(("family", "version", "keys"), SEED_ROWS)
def test_every_seed_row_is_in_the_table(family: F, version: str, keys: set[str]) -> None:
    choice = row_for(family, version)
    assert choice.verified
    assert choice.row.delta == keys
    assert choice.row.provenance in Provenance and choice.row.note


def test_seed_provenance() -> None:
    assert row_for(F.VLLM, "0.29.0").row.provenance is Provenance.SOURCE
    assert row_for(F.VLLM, "0.30.0").row.provenance is Provenance.LIVE
    assert "0.5.20" in row_for(F.SGLANG, "0.5.19").row.note


def test_relayed_fields_of_the_seed_are_recorded() -> None:
    assert "metrics" in row_for(F.VLLM, "0.31.0").row.relayed
    assert "matched_stop" in row_for(F.SGLANG, "0.5.20").row.relayed
    assert {"exact_mode", "tensorfold", "speculative"} <= set(row_for(F.TENSORFOLD, "0.6.1").row.relayed)
    assert {"system_fingerprint", "timings"} <= set(row_for(F.LLAMACPP, "0.6.0").row.relayed)


@pytest.mark.parametrize(
    ("family", "version", "row_label"),
    [
        (F.VLLM, "0.34.1", "vllm 0.33"),  # newer than all: nearest lower row
        (F.SGLANG, "0.5.24", "sglang 0.5.22-0.5.23"),
        (F.LLAMACPP, "0.7.0", "llamacpp 0.6.0"),
        (F.LLAMACPP, "b6123", "llamacpp 0.6.0"),  # no lower row: the lowest one, still unverified
        (F.VLLM, "0.28.0", "vllm 0.29"),
    ],
)
def test_versions_outside_every_range_are_unverified(family: F, version: str, row_label: str) -> None:
    choice = row_for(family, version)
    assert not choice.verified
    assert choice.row.label == row_label
    assert "outside every verified range" in choice.describe(version)["note"]


def test_version_keys() -> None:
    assert version_key("0.32.0+cpu") == (0, 32, 0)
    assert version_key("v0.6.0") == (0, 6, 0)
    assert version_key("0.5.21rc1") == (0, 5, 21)
    assert version_key("b6123") == (0, 0, 6123)


def test_no_row_overlaps_another() -> None:
    for a in FIELD_TABLE:
        for b in FIELD_TABLE:
            if a is not b and a.family == b.family:
                assert not (a.low <= b.low[: len(a.low)] and b.low[: len(a.high)] <= a.high), (a.label, b.label)


def chunk(delta: dict) -> dict:
    return {"choices": [{"index": 0, "delta": delta}]}


def test_verifier_passes_allowed_keys_and_names_the_first_unknown_one() -> None:
    verify = DeltaVerifier(row_for(F.SGLANG, "0.5.21").row.delta, "sglang 0.5.21").verify
    verify(chunk({"role": None, "content": "x", "reasoning_content": None}))  # passes: no exception
    verify({"choices": [], "usage": {"prompt_tokens": 1}})
    with pytest.raises(UnverifiedStream) as caught:
        verify(chunk({"content": "x", "reasoning": "y", "hidden_states": [1]}))
    assert caught.value.extra["key"] == "hidden_states"
    assert "sglang 0.5.21" in caught.value.message


def test_vllm_citations_are_not_relayed() -> None:
    verify = DeltaVerifier(row_for(F.VLLM, "0.31.0").row.delta, "vllm 0.31.0").verify
    with pytest.raises(UnverifiedStream, match="citations"):
        verify(chunk({"citations": ["a"]}))


TOOL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        ({"choices": "abc"}, "'choices' is a str"),
        ({"choices": 7}, "'choices' is a int"),
        ({"choices": [None]}, "a choice is null"),
        ({"choices": ["x"]}, "a choice is a str"),
        ({"choices": [{"index": "0", "delta": {}}]}, "a choice's 'index' is '0'"),
        ({"choices": [{"index": -1, "delta": {}}]}, "a choice's 'index' is -1"),
        ({"choices": [{"index": 0, "delta": "hi"}]}, "'delta' is a str"),
        ({"choices": [{"index": 0, "delta": ["hi"]}]}, "'delta' is a list"),
        ({"choices": [{"index": 0, "delta": {"tool_calls": {"index": 0}}}]}, "'tool_calls' is a dict"),
        ({"choices": [{"index": 0, "delta": {"tool_calls": [7]}}]}, "a tool call is a int"),
        ({"choices": [{"index": 0, "delta": {"tool_calls": [{**TOOL, "index": "0"}]}}]}, "tool call's 'index' is '0'"),
        ({"choices": [{"index": 0, "delta": {"tool_calls": [{**TOOL, "index": -1}]}}]}, "tool call's 'index' is -1"),
        (
            {"choices": [{"index": 0, "delta": {"tool_calls": [{**TOOL, "index": True}]}}]},
            "tool call's 'index' is True",
        ),
        (
            {"choices": [{"index": 0, "delta": {"tool_calls": [{**TOOL, "index": 10_000_000}]}}]},
            "past the limit of 256 tool calls",
        ),
    ],
)
def test_verifier_refuses_chunks_of_the_wrong_shape_as_edge_errors(obj: dict, says: str) -> None:
    verify = DeltaVerifier(row_for(F.VLLM, "0.32.0").row.delta, "vllm 0.32.0").verify
    with pytest.raises(EdgeError) as caught:
        verify(obj)
    assert says in caught.value.message and caught.value.code == "edge_error"
    assert caught.value.extra["reason"] in caught.value.message


def test_verifier_accepts_the_lenient_shapes_real_engines_send() -> None:
    verify = DeltaVerifier(row_for(F.VLLM, "0.32.0").row.delta, "vllm 0.32.0", max_tool_calls=2).verify
    for obj in (
        {"choices": None, "usage": {"prompt_tokens": 1}},  # a usage chunk without choices
        {"choices": [{"index": 0, "delta": None, "finish_reason": "stop"}]},
        {"choices": [{"delta": {"tool_calls": [{**TOOL, "index": 1}]}}]},  # no choice index: the first
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"function": {"arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": None, "content": "x"}}]},
    ):
        verify(obj)  # accepted: no exception (the shapes refused above do raise)


def test_version_keys_read_only_ascii_digits() -> None:
    assert version_key("0.5²") == (0, 5)  # a superscript is not a digit of a version
    assert version_key("²") == (0,)
