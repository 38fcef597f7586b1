"""Chunk builders per engine for synthesize.py. Shapes and key orders from /work/shared/engines/ENGINES.md.

Every dict is built in the key order the engine emits (pydantic/msgspec field order for vLLM and SGLang,
insertion order for llama.cpp's ordered_json); ``sse`` writes compact JSON with raw UTF-8, as engines do.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

J = dict[str, Any]
ARG_PIECES = ['{"city": "', "Paris", '", "unit": "', "celsius", '"}']
TOOL_ARGS = "".join(ARG_PIECES)
THINKING = ["The", " user", " asks", " for", " the", " capital", " of", " France", ".", " It", " is", " Paris", "."]
ANSWER = ["The", " capital", " of", " France", " is", " Paris", "."]


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(events: list[J], done: bool = True) -> bytes:
    out = b"".join(b"data: " + dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def content_pieces(raw: bytes) -> list[str]:
    """The content strings of a captured stream, opening (role) chunk left out."""
    pieces = []
    for event in raw.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        for choice in json.loads(event[6:]).get("choices") or ():
            delta = choice.get("delta") or {}
            if "role" not in delta and isinstance(delta.get("content"), str):
                pieces.append(delta["content"])
    return pieces


def adv_utf8_pieces() -> list[str]:
    return ["Café", " costs", " 5 €", " —", " naïve", " 😀", " über", " 中文", "!"]


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


class VLLM:
    """vLLM 0.29-0.33 (§1.1): exclude_unset chunks, trailing usage chunk with exclude_none."""

    def __init__(self, version: str, fingerprint: str):
        self.v33 = _key(version) >= (0, 33)
        self.fp = fingerprint

    @staticmethod
    def _base(cid: str, t: int, model: str) -> J:
        return {"id": cid, "object": "chat.completion.chunk", "created": t, "model": model}

    def first(self, cid: str, t: int, model: str, usage: J | None = None) -> J:
        c = self._base(cid, t, model)
        c["choices"] = [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ]
        if usage is not None:
            c["usage"] = usage
        c["prompt_token_ids"] = None
        c["prompt_text"] = None
        return c

    def token(self, cid: str, t: int, model: str, delta: J, usage: J | None = None) -> J:
        c = self._base(cid, t, model)
        c["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, "token_ids": None}]
        if usage is not None:
            c["usage"] = usage
        if self.v33:
            c["kv_transfer_params"] = None
        return c

    def finish(
        self,
        cid: str,
        t: int,
        model: str,
        delta: J,
        reason: str,
        stop_reason: Any,
        include_usage: bool,
        usage: J | None = None,
    ) -> J:
        c = self._base(cid, t, model)
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": stop_reason,
            "token_ids": None,
        }
        if self.v33:
            choice["weight_versions"] = None
        c["choices"] = [choice]
        if usage is not None:
            c["usage"] = usage
        if not include_usage:
            c["system_fingerprint"] = self.fp
        if self.v33:
            c["kv_transfer_params"] = None
        return c

    def usage_chunk(self, cid: str, t: int, model: str, usage: J, metrics: J | None) -> J:
        c = self._base(cid, t, model)
        c["choices"] = []
        c["usage"] = usage
        c["system_fingerprint"] = self.fp
        if metrics:
            c["metrics"] = metrics
        return c

    def plain(
        self,
        cid: str,
        t: int,
        model: str,
        pieces: list[str],
        reason: str,
        stop_reason: Any,
        include_usage: bool,
        usage: J | None = None,
        metrics: J | None = None,
    ) -> bytes:
        ev = [self.first(cid, t, model)]
        ev += [self.token(cid, t, model, {"content": p}) for p in pieces[:-1]]
        ev.append(self.finish(cid, t, model, {"content": pieces[-1]}, reason, stop_reason, include_usage))
        if include_usage:
            ev.append(self.usage_chunk(cid, t, model, usage or {}, metrics))
        return sse(ev)

    def tools(self, cid: str, t: int, model: str, tool_id: str, usage: J, metrics: J) -> bytes:
        ev = [
            self.first(cid, t, model),
            self.token(
                cid,
                t,
                model,
                {"tool_calls": [{"id": tool_id, "type": "function", "index": 0, "function": {"name": "get_weather"}}]},
            ),
        ]
        ev += [
            self.token(cid, t, model, {"tool_calls": [{"index": 0, "function": {"arguments": p}}]}) for p in ARG_PIECES
        ]
        ev.append(self.finish(cid, t, model, {}, "tool_calls", None, True))
        ev.append(self.usage_chunk(cid, t, model, usage, metrics))
        return sse(ev)

    def reasoning(
        self, cid: str, t: int, model: str, thinking: list[str], answer: list[str], usage: J, metrics: J
    ) -> bytes:
        ev = [self.first(cid, t, model)]
        ev += [self.token(cid, t, model, {"reasoning": p}) for p in thinking]
        ev += [self.token(cid, t, model, {"content": p}) for p in answer[:-1]]
        ev.append(self.finish(cid, t, model, {"content": answer[-1]}, "stop", None, True))
        ev.append(self.usage_chunk(cid, t, model, usage, metrics))
        return sse(ev)

    def with_delta(self, cid: str, t: int, model: str, pieces: list[str], at: int, odd: J) -> bytes:
        ev = [self.first(cid, t, model)]
        ev += [self.token(cid, t, model, {"content": p}) for p in pieces[:at]]
        ev.append(self.token(cid, t, model, odd))
        ev += [self.token(cid, t, model, {"content": p}) for p in pieces[at:-1]]
        ev.append(self.finish(cid, t, model, {"content": pieces[-1]}, "stop", None, False))
        return sse(ev)

    def continuous(self, cid: str, t: int, model: str, pieces: list[str], metrics: J) -> bytes:
        p = 18
        use = lambda n: {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n}  # noqa: E731
        ev = [self.first(cid, t, model, usage=use(0))]
        ev += [self.token(cid, t, model, {"content": s}, usage=use(i + 1)) for i, s in enumerate(pieces[:-1])]
        n = len(pieces)
        ev.append(self.finish(cid, t, model, {"content": pieces[-1]}, "stop", None, True, usage=use(n)))
        ev.append(self.usage_chunk(cid, t, model, {**use(n), "prompt_tokens_details": {"cached_tokens": 16}}, metrics))
        return sse(ev)

    def error_midstream(self, cid: str, t: int, model: str, pieces: list[str]) -> bytes:
        ev = [self.first(cid, t, model)]
        ev += [self.token(cid, t, model, {"content": p}) for p in pieces]
        ev.append(
            {
                "error": {
                    "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        )
        return sse(ev)


class SGLang:
    """SGLang 0.5.18-0.5.23 (§2.1): msgspec text chunks, pydantic tool/usage/hidden-state chunks."""

    EOS = 151645  # matched_stop for an EOS stop: the stop token id (Qwen's <|im_end|>)

    def __init__(self, version: str):
        key = _key(version)
        self.null_tool_calls = key < (0, 5, 22)
        self.always_cache_details = key >= (0, 5, 22)
        self.completion_details = key >= (0, 5, 23)

    def usage(self, prompt: int, completion: int, cached: int, reasoning: int = 0) -> J:
        u: J = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached} if cached or self.always_cache_details else None,
            "reasoning_tokens": reasoning,
        }
        if self.completion_details:
            u["completion_tokens_details"] = {"reasoning_tokens": reasoning} if reasoning else None
        return u

    @staticmethod
    def ms(rid: str, t: int, model: str, delta: J, finish: str | None = None, matched: Any = None) -> J:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": t,
            "model": model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
            ],
        }

    @staticmethod
    def pyd(rid: str, t: int, model: str, choices: list[J], usage: J | None = None) -> J:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": t,
            "model": model,
            "choices": choices,
            "usage": usage,
        }

    def pyd_choice(self, content: str | None = None, tool_calls: list[J] | None = None, **extra: Any) -> J:
        delta: J = {"role": None, "content": content, "reasoning_content": None, "tool_calls": tool_calls}
        if tool_calls is None and not self.null_tool_calls:
            del delta["tool_calls"]
        delta.update(extra)
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, "matched_stop": None}

    def _open(self, rid: str, t: int, model: str) -> J:
        return self.ms(rid, t, model, {"reasoning_content": None, "role": "assistant", "content": ""})

    def _text(self, rid: str, t: int, model: str, piece: str) -> J:
        return self.ms(rid, t, model, {"reasoning_content": None, "content": piece})

    def _fin(self, rid: str, t: int, model: str, reason: str, matched: Any) -> J:
        return self.ms(rid, t, model, {"reasoning_content": None}, reason, matched)

    def plain(
        self, rid: str, t: int, model: str, pieces: list[str], reason: str, matched: Any, usage: J | None
    ) -> bytes:
        ev = [self._open(rid, t, model)] + [self._text(rid, t, model, p) for p in pieces]
        ev.append(self._fin(rid, t, model, reason, matched))
        if usage is not None:
            ev.append(self.pyd(rid, t, model, [], usage))
        return sse(ev)

    def tools(self, rid: str, t: int, model: str, call_id: str, usage: J) -> bytes:
        ev = [
            self._open(rid, t, model),
            self.pyd(rid, t, model, [self.pyd_choice(content="I'll look that up.")]),
            self.pyd(
                rid,
                t,
                model,
                [
                    self.pyd_choice(
                        tool_calls=[
                            {
                                "id": call_id,
                                "index": 0,
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": ""},
                            }
                        ]
                    )
                ],
            ),
        ]
        ev += [
            self.pyd(
                rid,
                t,
                model,
                [
                    self.pyd_choice(
                        tool_calls=[
                            {"id": None, "index": 0, "type": "function", "function": {"name": None, "arguments": p}}
                        ]
                    )
                ],
            )
            for p in ARG_PIECES
        ]
        ev.append(self._fin(rid, t, model, "tool_calls", None))
        ev.append(self.pyd(rid, t, model, [], usage))
        return sse(ev)

    def reasoning(self, rid: str, t: int, model: str, usage: J) -> bytes:
        ev = [self._open(rid, t, model)]
        ev += [self.ms(rid, t, model, {"reasoning_content": p}) for p in THINKING]
        ev += [self._text(rid, t, model, p) for p in ANSWER]
        ev += [self._fin(rid, t, model, "stop", self.EOS), self.pyd(rid, t, model, [], usage)]
        return sse(ev)

    def with_delta(self, rid: str, t: int, model: str, at: int, odd: J) -> bytes:
        ev = [self._open(rid, t, model)] + [self._text(rid, t, model, p) for p in ANSWER[:at]]
        ev.append(self.ms(rid, t, model, {"reasoning_content": None, **odd}))
        ev += [self._text(rid, t, model, p) for p in ANSWER[at:]]
        ev.append(self._fin(rid, t, model, "stop", self.EOS))
        return sse(ev)

    def hidden_states(self, rid: str, t: int, model: str) -> bytes:
        ev = [self._open(rid, t, model)] + [self._text(rid, t, model, p) for p in ANSWER]
        ev.append(self._fin(rid, t, model, "stop", self.EOS))
        ev.append(self.pyd(rid, t, model, [self.pyd_choice(hidden_states=[0.0123, -0.4567, 0.891, -0.0042])]))
        return sse(ev)

    def error_midstream(self, rid: str, t: int, model: str) -> bytes:
        ev = [self._open(rid, t, model)] + [self._text(rid, t, model, p) for p in ANSWER[:4]]
        ev.append(
            {
                "error": {
                    "object": "error",
                    "message": "The request is aborted: out of memory.",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            }
        )
        return sse(ev)


class TensorFold:
    """TensorFold 0.6.x (§4.1, 0.2.0 chunk shape): extras and usage ride the final chunk."""

    def __init__(self, version: str):
        self.version = version

    @staticmethod
    def usage(prompt: int, completion: int, cached: int, reasoning: int = 0) -> J:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning},
        }

    @staticmethod
    def chunk(cid: str, t: int, model: str, delta: J, finish: str | None = None) -> J:
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": t,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    def final(self, cid: str, t: int, model: str, reason: str, usage: J, include_usage: bool) -> list[J]:
        c = self.chunk(cid, t, model, {}, reason)
        if not include_usage:
            c["usage"] = usage
        n = usage["completion_tokens"]
        c["exact_mode"] = False
        c["tensorfold"] = {
            "token_sha": hashlib.sha256(cid.encode()).hexdigest(),
            "ttft_ms": 41.8,
            "prefill_ms": 38.2,
            "decode_tokens_per_second": 96.4,
        }
        c["speculative"] = {"drafted": 3 * n, "accepted": 2 * n, "acceptance_rate": 0.6667}
        ev = [c]
        if include_usage:
            ev.append(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": t,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
            )
        return ev

    def plain(
        self, cid: str, t: int, model: str, pieces: list[str], reason: str, usage: J, include_usage: bool
    ) -> bytes:
        ev = [self.chunk(cid, t, model, {"role": "assistant"})]
        ev += [self.chunk(cid, t, model, {"content": p}) for p in pieces]
        return sse(ev + self.final(cid, t, model, reason, usage, include_usage))

    def tools(self, cid: str, t: int, model: str, call_id: str, usage: J) -> bytes:
        ev = [
            self.chunk(cid, t, model, {"role": "assistant"}),
            self.chunk(
                cid,
                t,
                model,
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": TOOL_ARGS},
                        }
                    ]
                },
            ),
        ]
        return sse(ev + self.final(cid, t, model, "tool_calls", usage, False))

    def reasoning(self, cid: str, t: int, model: str, usage: J) -> bytes:
        ev = [self.chunk(cid, t, model, {"role": "assistant"})]
        ev += [self.chunk(cid, t, model, {"reasoning_content": p}) for p in THINKING]
        ev += [self.chunk(cid, t, model, {"content": p}) for p in ANSWER]
        return sse(ev + self.final(cid, t, model, "stop", usage, False))

    def error_midstream(self, cid: str, t: int, model: str, pieces: list[str]) -> bytes:
        ev = [self.chunk(cid, t, model, {"role": "assistant"})]
        ev += [self.chunk(cid, t, model, {"content": p}) for p in pieces]
        ev.append(
            {
                "error": {
                    "message": "generation failed: CUDA error: an illegal memory access was encountered",
                    "type": "server_error",
                }
            }
        )
        return sse(ev)


class LlamaCpp:
    """llama-server 0.6.0 (§3.1, captured key order): every chunk carries system_fingerprint."""

    MODEL, FP = "smollm2-135m-instruct", "b0-unknown"

    def chunk(self, cid: str, t: int, delta: J | None, finish: str | None = None, **tail: Any) -> J:
        choices = [] if delta is None else [{"finish_reason": finish, "index": 0, "delta": delta}]
        return {
            "choices": choices,
            "created": t,
            "id": cid,
            "model": self.MODEL,
            "system_fingerprint": self.FP,
            "object": "chat.completion.chunk",
            **tail,
        }

    @staticmethod
    def timings(n: int, prompt_n: int = 19, cache_n: int = 24) -> J:
        prompt_ms = round(prompt_n * 3.185, 3)
        return {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": round(prompt_ms / prompt_n, 6),
            "prompt_per_second": round(1000 * prompt_n / prompt_ms, 6),
            "predicted_n": n,
            "predicted_ms": round(n * 7.583, 3),
            "predicted_per_token_ms": 7.583,
            "predicted_per_second": round(1000 / 7.583, 6),
        }

    def _open(self, cid: str, t: int) -> J:
        return self.chunk(cid, t, {"role": "assistant", "content": None})

    def plain(self, cid: str, t: int, pieces: list[str]) -> bytes:
        n = len(pieces)
        ev = [self._open(cid, t)] + [self.chunk(cid, t, {"content": p}) for p in pieces]
        ev.append(self.chunk(cid, t, {}, "stop"))
        ev.append(
            self.chunk(
                cid,
                t,
                None,
                usage={
                    "completion_tokens": n,
                    "prompt_tokens": 43,
                    "total_tokens": 43 + n,
                    "prompt_tokens_details": {"cached_tokens": 24},
                },
                timings=self.timings(n),
            )
        )
        return sse(ev)

    def tools(self, cid: str, t: int, call_id: str) -> bytes:
        pieces = ['{"', "city", '":"', "Paris", '","', "unit", '":"', "celsius", '"}']
        ev = [
            self._open(cid, t),
            self.chunk(
                cid,
                t,
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": pieces[0]},
                        }
                    ]
                },
            ),
        ]
        ev += [self.chunk(cid, t, {"tool_calls": [{"index": 0, "function": {"arguments": p}}]}) for p in pieces[1:]]
        ev.append(self.chunk(cid, t, {}, "tool_calls", timings=self.timings(len(pieces) + 6, prompt_n=211, cache_n=0)))
        return sse(ev)

    def role_only(self, cid: str, t: int, pieces: list[str]) -> bytes:
        ev = [self.chunk(cid, t, {"role": "assistant"}), self.chunk(cid, t, {"content": None})]
        ev += [self.chunk(cid, t, {"content": p}) for p in pieces]
        ev.append(self.chunk(cid, t, {}, "stop", timings=self.timings(len(pieces))))
        return sse(ev)

    def error_midstream(self, cid: str, t: int, pieces: list[str]) -> bytes:
        ev = [self._open(cid, t)] + [self.chunk(cid, t, {"content": p}) for p in pieces]
        ev.append({"error": {"code": 500, "message": "Failed to decode the batch (ret = -3)", "type": "server_error"}})
        return sse(ev, done=False)
