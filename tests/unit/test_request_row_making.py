"""A request's row, made from its call: its record and how it ended (``adapters/http/request_rows``)."""

from __future__ import annotations

from capyctl.adapters.http.request_rows import finished_row, refused_row
from capyctl.domain.errors import InvalidRequest, QueueFull
from capyctl.domain.requests import CancelCause
from capyctl.services.requests import Call


def record(**fields: object) -> Call:
    return Call(id="01REQ", deployment="m", stream=False, key="ci", obj={}, **fields)  # type: ignore[arg-type]


def test_an_answer_gives_its_figures_tokens_and_a_wait_of_zero_when_it_was_granted_at_once() -> None:
    rec = record()
    rec.code = "ok"
    rec.measured(
        {
            "ttft_ms": {"value": 12.5, "source": "router"},
            "queue_ms": {"value": 0.02, "source": "engine"},
            "decode_tokens_per_second": {"value": 490.48, "source": "engine"},
            "cached_tokens": {"value": 3, "source": "engine"},
        },
        {"prompt_tokens": 37, "completion_tokens": 4, "total_tokens": 41},
    )
    rec.sent(0)
    got = finished_row(rec, "/v1/chat/completions", 5.0, 20.123)
    assert (got.id, got.at, got.api, got.code, got.status, got.key, got.instance) == (
        "01REQ",
        5.0,
        "chat",
        "ok",
        200,
        "ci",
        0,
    )
    assert (got.ttft_ms, got.queue_ms, got.decode_tokens_per_second, got.prefill_ms) == (12.5, 0.02, 490.48, None)
    assert (got.prompt_tokens, got.cached_tokens, got.completion_tokens) == (37, 3, 4)
    assert got.queue_wait_ms == 0.0 and got.total_ms == 20.12 and got.cause is None and got.settlement is None


def test_a_wait_in_line_is_in_milliseconds_and_a_refused_request_has_no_engine_figures() -> None:
    refused = record(waited=1.5)
    refused.code = "queue_full"
    got = finished_row(refused, "/v1/systemone", 5.0, 1500.0)
    assert (got.api, got.status, got.queue_wait_ms, got.instance, got.ttft_ms, got.prompt_tokens) == (
        "decisions",
        429,
        1500.0,
        None,
        None,
        None,
    )


def test_a_cut_names_its_cause_and_the_rule_that_settles_it() -> None:
    answered, silent = record(), record()
    for rec in (answered, silent):
        rec.sent(0)
        rec.cancelled(CancelCause.CLIENT_GONE)
    answered.answered = True
    answered.started = True  # a stream began: its status was 200
    got = finished_row(answered, "/v1/chat/completions", 1.0, 1.0)
    assert (got.code, got.status, got.cause, got.settlement) == ("client_gone", 200, "client_gone", "engine_idle")
    assert finished_row(silent, "/v1/chat/completions", 1.0, 1.0).settlement == "engine_stop"
    never_sent = record()
    never_sent.cancelled(CancelCause.DEADLINE)
    assert finished_row(never_sent, "/v1/chat/completions", 1.0, 1.0).settlement is None  # nothing to settle


def test_a_refusal_at_the_front_has_its_code_and_status_only() -> None:
    got = refused_row("01REF", InvalidRequest("bad", param="X-Request-Id"), "/v1/chat/completions", 9.0)
    assert (got.id, got.code, got.status, got.deployment, got.key) == ("01REF", "invalid_request", 400, None, None)
    assert refused_row("01Q", QueueFull("m", "64 waiting", 5), "/v1/chat/completions", 9.0).status == 429


def test_a_refused_row_names_the_key_and_model_the_front_had_read() -> None:
    got = refused_row("01D", QueueFull("m", "64 waiting", 5), "/v1/chat/completions", 9.0, "team-a", "m" * 500)
    assert (got.key, got.instance, got.code) == ("team-a", None, "queue_full")
    assert got.deployment is not None and got.deployment.startswith("m") and len(got.deployment) < 500  # clipped
    assert (refused_row("01E", QueueFull("m", "x", 5), "/v1/systemone", 9.0).key,) == (None,)
