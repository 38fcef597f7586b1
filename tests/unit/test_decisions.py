"""Decision requests (domain, pure): the five fields, fields an engine would drop, which engines serve them,
the figures CapyCTL adds."""

from __future__ import annotations

import pytest

from capyctl.domain.decisions import decision_metrics, read_decision, refuse_dropped, serves_decisions
from capyctl.domain.errors import InvalidRequest

OK = {"model": "decider", "state": "hi", "questions": {"q": {"type": "noul", "instructions": "x"}}}


def test_the_five_fields_and_no_others() -> None:
    assert read_decision(OK) == "decider"
    assert read_decision({**OK, "images": ["data:image/png;base64,AA=="], "files": []}) == "decider"
    for extra in ("stream", "temperature", "assets", "cache_salt", "chat_template_kwargs"):
        with pytest.raises(InvalidRequest) as caught:
            read_decision({**OK, extra: True})
        assert caught.value.extra["param"] == extra and extra in caught.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"state": "hi", "questions": {}}, "model"),
        ({"model": "", "state": "hi", "questions": {}}, "model"),
        ({"model": "d", "questions": {}}, "state"),
        ({"model": "d", "state": "hi"}, "questions"),
        ({**OK, "images": "data:x"}, "images"),
        ({**OK, "files": [1]}, "files"),
    ],
)
def test_what_is_missing_or_malformed_is_named(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        read_decision(body)
    assert caught.value.extra["param"] == param


def test_a_field_the_engine_would_drop_is_refused() -> None:
    with_files, with_images = {**OK, "files": ["data:x"]}, {**OK, "images": ["data:x"]}
    for family, version in (("vllm", "0.32.0"), ("sglang", "0.5.23")):
        with pytest.raises(InvalidRequest, match="'files' is not read by"):
            refuse_dropped(with_files, family, version)
    with pytest.raises(InvalidRequest, match="not read by sglang before 0.5.22"):
        refuse_dropped(with_images, "sglang", "0.5.21")
    refuse_dropped(with_images, "sglang", "0.5.22")  # read from 0.5.22 on
    refuse_dropped(with_images, "vllm", "0.32.0")
    refuse_dropped(with_files, "llamacpp", "0.6.0")  # llama.cpp reads files (and images)


def test_which_engines_serve_decisions() -> None:
    assert serves_decisions("vllm", "0.32.0") and serves_decisions("vllm", "0.33.1")
    assert not serves_decisions("vllm", "0.31.2")
    assert serves_decisions("sglang", "0.5.21") and not serves_decisions("sglang", "0.5.20")
    assert serves_decisions("tensorfold", "0.6.3") is False
    assert serves_decisions("llamacpp", "0.6.0") is None  # only the build can tell


def test_the_figures_added_to_an_answer() -> None:
    answer = {"answers": {}, "usage": {"input_tokens": 87, "output_tokens": 0}}
    assert decision_metrics(answer, 43.94, 41.21) == {
        "input_tokens": {"value": 87, "source": "engine"},
        "time_to_response_ms": {"value": 41.2, "source": "router"},
        "total_ms": {"value": 43.9, "source": "router"},
    }
    assert "input_tokens" not in decision_metrics({"usage": {"input_tokens": True}}, 1, 1)  # nobody measured it
    engine = decision_metrics({"metrics": {"queue_ms": 0.5, "prefill_ms": 3, "cached_tokens": 16, "x": 1}}, 1, 1)
    assert {k: v["source"] for k, v in engine.items()} == {
        "cached_tokens": "engine",
        "prefill_ms": "engine",
        "queue_ms": "engine",
        "time_to_response_ms": "router",
        "total_ms": "router",
    }
