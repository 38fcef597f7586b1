"""The metrics table and the router's own measurements, on recorded engine streams."""

from pathlib import Path

from capyctl.adapters.engines._sse import SseParser
from capyctl.domain.engines import EngineFamily as F
from capyctl.domain.fields import row_for
from capyctl.domain.metrics import Meter, metrics_row_for
from capyctl.domain.relay_check import ChunkRules, StreamCheck
from capyctl.domain.streams import Chunks
from tests.fakes.answers import chunks

RECORDINGS = Path(__file__).parents[1] / "contract" / "recordings"


class Ticks:
    """A clock that advances 10 ms per reading."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 0.01
        return self.now


def metered(family: F, version: str) -> tuple[Meter, StreamCheck]:
    """A meter and the relay check that notes each chunk in it, on a clock of 10 ms ticks."""
    ticks = Ticks()
    meter = Meter(ticks)
    return meter, StreamCheck(ChunkRules(row_for(family, version).row, "test"), meter, "m", ticks)


def meter_over(path: Path, family: F, version: str) -> Meter:
    meter, check = metered(family, version)
    for event in SseParser().feed(path.read_bytes()):
        if isinstance(event, Chunks):
            check.check(event)
    return meter


def test_vllm_032_metrics_object_gives_queue_prefill_ttft_and_decode() -> None:
    path = RECORDINGS / "vllm" / "0.32.0" / "chat_stream_usage.sse"
    meter = meter_over(path, F.VLLM, "0.32.0")
    engine = meter.seen["metrics"]
    figures = meter.figures(metrics_row_for(F.VLLM, "0.32.0"))
    assert figures["queue_ms"] == {"value": round(engine["queue_time_ms"], 2), "source": "engine"}
    assert figures["prefill_ms"] == {"value": round(engine["time_to_first_token_ms"], 2), "source": "engine"}
    assert figures["ttft_ms"] == {
        "value": round(engine["queue_time_ms"] + engine["time_to_first_token_ms"], 2),
        "source": "engine",
    }
    assert figures["decode_tokens_per_second"] == {"value": round(1000 / engine["mean_itl_ms"], 2), "source": "engine"}
    assert list(figures) == sorted(figures)


def test_vllm_without_usage_falls_back_to_the_router_and_omits_the_rest() -> None:
    meter = meter_over(RECORDINGS / "vllm" / "0.32.0" / "chat_stream.sse", F.VLLM, "0.32.0")
    figures = meter.figures(metrics_row_for(F.VLLM, "0.32.0"))
    assert set(figures) == {"ttft_ms", "decode_tokens_per_second"}
    assert {f["source"] for f in figures.values()} == {"router"}


def test_llamacpp_timings() -> None:
    meter = meter_over(RECORDINGS / "llamacpp" / "0.6.0" / "chat_stream_usage.sse", F.LLAMACPP, "0.6.0")
    timings = meter.seen["timings"]
    figures = meter.figures(metrics_row_for(F.LLAMACPP, "0.6.0"))
    assert figures["prefill_ms"] == {"value": round(timings["prompt_ms"], 2), "source": "engine"}
    assert figures["decode_tokens_per_second"] == {
        "value": round(timings["predicted_per_second"], 2),
        "source": "engine",
    }
    assert figures["cached_tokens"] == {"value": 23, "source": "engine"}
    assert figures["ttft_ms"]["source"] == "router"
    assert "queue_ms" not in figures


def test_router_definitions() -> None:
    meter, check = metered(F.VLLM, "0.32.0")  # sent at 100.01
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}
    text = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    usage = {"choices": [], "usage": {"completion_tokens": 5}}
    for obj in (role, text, text, usage):  # one read each
        check.check(chunks(obj))
    # role-only chunk at 100.02 is not text; first text at 100.03; last chunk at 100.05
    assert meter.text_chunks == 2
    assert round(meter.router_ttft_ms(), 6) == 20.0
    assert round(meter.router_decode_rate(), 6) == round(4 / 0.02, 6)


def test_one_read_of_many_chunks_reads_the_clock_for_its_first_text_and_its_end() -> None:
    meter, check = metered(F.VLLM, "0.32.0")  # sent at 100.01
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    text = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    check.check(chunks(role, text, text, text))  # first text at 100.02, the read's end at 100.03
    assert meter.text_chunks == 3
    assert round(meter.router_ttft_ms(), 6) == 10.0 and round(meter.last_at, 6) == 100.03


def test_unmeasured_figures_are_absent_not_zero() -> None:
    meter, check = metered(F.VLLM, "0.32.0")
    check.check(
        chunks(
            {
                "choices": [{"index": 0, "delta": {"role": "assistant"}}],
                "timings": {"prompt_ms": 0.0},
                "metrics": {"queue_time_ms": 0.0, "time_to_first_token_ms": None},
            }
        )
    )
    assert meter.seen["timings"] == {"prompt_ms": 0.0}  # kept, yet no figure: a zero here means "not measured"
    assert meter.figures(metrics_row_for(F.LLAMACPP, "0.6.0")) == {}
    assert meter.figures(metrics_row_for(F.VLLM, "0.31.0")) == {}


def test_unknown_versions_use_the_nearest_lower_row() -> None:
    assert metrics_row_for(F.VLLM, "0.40.0").family == F.VLLM
    assert metrics_row_for(F.LLAMACPP, "b6123").family == F.LLAMACPP
