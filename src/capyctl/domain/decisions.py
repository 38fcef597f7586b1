"""Decision requests (DEC-1 … DEC-4): ``POST /v1/systemone``, typed questions answered with probabilities.

Pure rules: which top-level fields a request may carry, which of them an
engine would silently drop (refused instead, so that nobody gets an answer
to a question that was not asked), which engines and versions serve the
route, and the figures CapyCTL adds to the answer.
"""

from __future__ import annotations

from typing import Any

from capyctl.domain.engines import version_key
from capyctl.domain.errors import InvalidRequest

FIELDS = ("model", "state", "questions", "images", "files")

# Accepted fields an engine would drop without a word; refused for that engine (and versions below).
_DROPPED: dict[str, tuple[tuple[str, tuple[int, ...] | None], ...]] = {
    "vllm": (("files", None),),
    "sglang": (("files", None), ("images", (0, 5, 22))),  # images arrived in 0.5.22
}
# The first version of each family with the route; None: no version has it (llamacpp: per build).
_FIRST = {"vllm": (0, 32), "sglang": (0, 5, 21), "tensorfold": None}


def read_decision(obj: dict[str, Any]) -> str:
    """The model a decision request names; refuses any field but the five of the API, and a stream."""
    for key in obj:
        if key not in FIELDS:
            raise InvalidRequest(
                f"'{key}' is not a field of a decision request; it takes {', '.join(FIELDS)} and no others",
                param=key,
            )
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            "'model' is required: the name of a decisions deployment (see GET /v1/models)", param="model"
        )
    for key in ("state", "questions"):
        if key not in obj:
            raise InvalidRequest(f"'{key}' is required in a decision request", param=key)
    for key in ("images", "files"):
        value = obj.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise InvalidRequest(f"'{key}' must be a list of strings (data URIs)", param=key)
    return model


def refuse_dropped(obj: dict[str, Any], family: str, version: str) -> None:
    """Refuse a field this engine version would silently ignore."""
    for key, fixed_in in _DROPPED.get(family, ()):
        if key in obj and (fixed_in is None or version_key(version) < fixed_in):
            since = "" if fixed_in is None else f" before {'.'.join(map(str, fixed_in))}"
            raise InvalidRequest(
                f"'{key}' is not read by {family}{since} ({family} {version} serves this model): the answer "
                f"would not consider it; send the request without it, or deploy the model on an engine that reads it",
                param=key,
            )


def serves_decisions(family: str, version: str) -> bool | None:
    """Whether this engine version has the decisions route; None when only the build can tell (llama.cpp)."""
    if family == "llamacpp":
        return None
    first = _FIRST.get(family)
    return first is not None and version_key(version)[: len(first)] >= first


def decision_metrics(answer: dict[str, Any], total_ms: float, time_to_response_ms: float) -> dict[str, Any]:
    """``capyctl.metrics`` of a decision: CapyCTL's two times, and what the engine reported."""
    figures: dict[str, Any] = {
        "total_ms": {"value": round(total_ms, 1), "source": "router"},
        "time_to_response_ms": {"value": round(time_to_response_ms, 1), "source": "router"},
    }
    usage = answer.get("usage")
    tokens = usage.get("input_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        figures["input_tokens"] = {"value": tokens, "source": "engine"}
    engine = answer.get("metrics")  # an engine that reports its own times, read as for chat
    if isinstance(engine, dict):
        for key in ("queue_ms", "prefill_ms", "cached_tokens"):
            value = engine.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                figures[key] = {"value": value, "source": "engine"}
    return dict(sorted(figures.items()))
