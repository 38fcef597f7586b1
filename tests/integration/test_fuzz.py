"""Property-based fuzz of both HTTP APIs of a real CapyCTL, over real sockets (hypothesis).

One CapyCTL (``capyctl start standalone``) serves one attached deployment,
``fuzzed``, on a replay engine that replays the vLLM 0.32.0 recordings. The
inference API gets random bodies (bytes, JSON values, chat-request-like
objects), headers (API key, ``X-Request-Id``, ``Content-Type``), methods and
paths; the management API gets random reads and writes behind the admin
token. Whatever is sent:

- no answer is a 5xx (the replay engine is healthy, so nothing is upstream's fault);
- every answer carries one ``X-CapyCTL-Request-Id`` that is a ULID;
- every non-2xx answer is the error envelope ``{"error": {"message", "type", "code", ...}}``;
- a streamed 200 ends with ``data: [DONE]`` or an error event.

Safety: the fuzz never makes CapyCTL reach anything but 127.0.0.1 nor run a
program. A generated deployment ``endpoint`` is absent or
``http://127.0.0.1:<a port nothing listens on>``; a ``model`` path or an engine
``path`` is a path under a temporary directory of this module that does not
exist or is an empty file or directory made here (the files are not
executable), and a deployment ``model`` may also be a path that cannot exist
anywhere (a NUL byte, the home of a user no system has); no request body
carries a ``replay_*`` key. The deployment ``fuzzed`` is never stopped,
replaced or deleted, and it is checked to still answer after the management fuzz.

By default the module runs a few hundred examples, derandomized (the same
examples every run). For a longer, random run set ``CAPYCTL_FUZZ_EXAMPLES``:

- ``CAPYCTL_FUZZ_EXAMPLES=2000`` runs 2000 examples in every fuzz test;
- ``CAPYCTL_FUZZ_EXAMPLES=x10`` runs ten times each test's default.

Example::

    CAPYCTL_FUZZ_EXAMPLES=x20 .venv/bin/python -m pytest tests/integration/test_fuzz.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import os
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context, event

from tests.contract.conftest import RECORDINGS, Folder, _start_replay
from tests.integration.harness import CapyServer, free_port

pytestmark = pytest.mark.integration

DEPLOYMENT = "fuzzed"  # the one real deployment: never stopped, replaced or deleted
ULID = re.compile(r"[0-7][0-9A-HJKMNP-TV-Z]{25}")  # Crockford base32, 26 characters
FAMILIES = ("vllm", "sglang", "llamacpp", "tensorfold")
CHAT = "/v1/chat/completions"
_ROUTED = re.compile(r"^\S+ request \S+ .* -> \S+ instance \d+$")

# --- budget -------------------------------------------------------------------------------------------------
_ENV = os.environ.get("CAPYCTL_FUZZ_EXAMPLES", "").strip()


def examples(default: int) -> int:
    """``default``, or what CAPYCTL_FUZZ_EXAMPLES asks: ``N`` examples, or ``xK`` times the default."""
    if not _ENV:
        return default
    if _ENV[0] in "xX*":
        return max(1, int(float(_ENV[1:]) * default))
    return max(1, int(_ENV))


def fuzz(default: int) -> Any:
    return settings(
        max_examples=examples(default),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
        derandomize=not _ENV,
        print_blob=bool(_ENV),
    )


# --- the server under test --------------------------------------------------------------------------------
@dataclass
class Target:
    server: CapyServer
    inference: httpx.Client
    management: httpx.Client
    api_key: str
    admin_token: str
    dead_endpoint: str  # http://127.0.0.1:<port nothing listens on>
    sandbox: Path  # the only directory generated paths point into
    made: list[Path] = field(default_factory=list)  # empty files and directories made in the sandbox

    def log_tail(self, size: int = 6000) -> str:
        """The end of the server log, without the one line per routed request."""
        lines = [line for line in self.server.log().splitlines() if not _ROUTED.search(line)]
        return "\n".join(lines)[-size:]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """A CapyCTL with the attached deployment `fuzzed` on a vLLM 0.32.0 replay engine."""
    tmp = tmp_path_factory.mktemp("fuzz")
    folder = Folder("vllm", "0.32.0", RECORDINGS / "vllm" / "0.32.0", {})
    server = CapyServer(tmp / "state")
    try:
        _start_replay(folder)
        server.start()
        path = tmp / "fuzzed.yaml"
        path.write_bytes(
            msgspec.yaml.encode(
                {"name": DEPLOYMENT, "engine": "vllm", "endpoint": folder.url, "engine_version": "0.32.0"}
            )
        )
        server.cli("deploy", "model", "--file", str(path))
        sandbox = tmp / "sandbox"
        sandbox.mkdir()
        made = [sandbox / "empty-file", sandbox / "empty-dir", sandbox / "empty-dir" / "empty-file"]
        made[1].mkdir()
        for file in (made[0], made[2]):
            file.touch()
            file.chmod(0o644)  # not executable: nothing can run it
        admin_token = (tmp / "state" / "identity" / "admin-token").read_text().strip()
        with (
            httpx.Client(base_url=server.base_url, timeout=30, trust_env=False) as inference,
            httpx.Client(
                base_url=f"http://127.0.0.1:{server.management_port}", timeout=30, trust_env=False
            ) as management,
        ):
            yield Target(
                server,
                inference,
                management,
                server.api_key,
                admin_token,
                f"http://127.0.0.1:{free_port()}",
                sandbox,
                made,
            )
    finally:
        server.stop()
        if folder.process is not None:
            folder.process.terminate()
            folder.process.wait(10)


# --- what every answer must be ----------------------------------------------------------------------------
def describe(r: httpx.Response) -> str:
    return (
        f"{r.request.method} {r.request.url} -> {r.status_code}\nheaders: {dict(r.headers)}\nbody: {r.content[:1500]!r}"
    )


def is_error_envelope(obj: Any) -> bool:
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), dict):
        return False
    error = obj["error"]
    return all(isinstance(error.get(key), str) for key in ("message", "type", "code"))


def check_stream(r: httpx.Response) -> None:
    text = r.text
    assert text.endswith("\n\n"), f"a stream that does not end with a whole event: {describe(r)}"
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events, f"an empty stream: {describe(r)}"
    last = events[-1]
    if last == "data: [DONE]":
        return
    assert last.startswith("data: "), f"a stream that ends with neither [DONE] nor an error event: {describe(r)}"
    try:
        obj = json.loads(last[len("data: ") :])
    except ValueError:
        obj = None
    assert is_error_envelope(obj), f"a stream that ends with neither [DONE] nor an error event: {describe(r)}"


def tally(what: str) -> None:
    """Count the kinds of answers in hypothesis' statistics (--hypothesis-show-statistics)."""
    if currently_in_test_context():
        event(what)


def check_answer(t: Target, r: httpx.Response, head: bool = False) -> None:
    """What holds for every answer of either API."""
    assert r.status_code < 500, f"server error: {describe(r)}\n--- server log tail ---\n{t.log_tail()}"
    ids = r.headers.get_list("x-capyctl-request-id")
    assert len(ids) == 1, f"not exactly one x-capyctl-request-id header: {describe(r)}"
    assert ULID.fullmatch(ids[0]), f"x-capyctl-request-id is not a ULID: {describe(r)}"
    if head:
        tally(f"{r.status_code} (HEAD)")
        return
    kind = r.headers.get("content-type", "")
    if not 200 <= r.status_code < 300:
        try:
            body = r.json()
        except ValueError:
            body = None
        assert is_error_envelope(body), f"a non-2xx answer without the error envelope: {describe(r)}"
        tally(f"{r.status_code} {body['error']['code']}")
        return
    tally(f"{r.status_code} {kind.split(';')[0]}")
    if kind.startswith("text/event-stream"):
        check_stream(r)
    elif kind.startswith("application/json"):
        try:
            r.json()
        except ValueError:
            raise AssertionError(f"a JSON answer that is not JSON: {describe(r)}") from None


def send(
    t: Target,
    client: httpx.Client,
    method: str,
    url: str | httpx.URL,
    headers: list[tuple[bytes, bytes]],
    content: bytes | None,
) -> httpx.Response:
    if isinstance(url, str):  # the path as given, not merged into the base URL's
        url = str(client.base_url).rstrip("/") + url
    try:
        return client.request(method, url, headers=headers, content=content)
    except httpx.TransportError as exc:
        raise AssertionError(
            f"{method} {url}: the connection failed ({exc!r})\n--- server log tail ---\n{t.log_tail()}"
        ) from exc


# --- strategies -------------------------------------------------------------------------------------------
def group(*strategies: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """One of ``strategies``, as one branch when it is itself an alternative in an ``st.one_of``.

    (``st.one_of`` flattens nested ``one_of``s, so a group of six scalars would outweigh a single
    alternative next to it six to one.)
    """
    return st.one_of(*strategies).map(lambda value: value)


json_scalars = group(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12,
)
non_strings = group(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(json_scalars, max_size=3),
    st.dictionaries(st.text(max_size=5), json_scalars, max_size=3),
)
# any text, lone surrogates included (they can only travel \u-escaped)
any_text = st.text(st.characters(blacklist_categories=()), max_size=30)


def deep(depth: int, shape: str) -> bytes:
    if shape == "array":
        return b"[" * depth + b"]" * depth
    if shape == "object":
        return b'{"a":' * depth + b"1" + b"}" * depth
    # the nesting inside an otherwise fine chat request
    return b'{"model":"fuzzed","messages":' + b"[" * depth + b"]" * depth + b"}"


deep_bodies = st.builds(deep, st.integers(1, 1500), st.sampled_from(["array", "object", "messages"]))


def encode_json(value: Any, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def json_body(values: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return st.builds(encode_json, values, st.booleans())


def not_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return True
    return False


def header_value(text: str) -> bytes:
    """``text`` as a valid HTTP field value: UTF-8 (non-ASCII as obs-text), no control characters."""
    raw = bytes(b for b in text.encode("utf-8", "surrogatepass") if b == 9 or 32 <= b <= 126 or b >= 128)
    return raw.strip(b" \t")


header_text = st.text(max_size=40).map(header_value)
latin1_text = st.text(st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"), max_size=40).map(
    lambda s: s.encode("latin-1").strip(b" \t")
)


def chance(percent: int, likely: st.SearchStrategy[Any], otherwise: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``likely`` ``percent`` % of the time; shrinks towards ``likely``."""
    return st.integers(0, 99).flatmap(lambda n: likely if n < percent else otherwise)


def authorization(secret: str, percent_valid: int) -> st.SearchStrategy[bytes | None]:
    valid = f"Bearer {secret}".encode()
    bad = st.one_of(
        st.none(),  # missing
        st.sampled_from(
            [  # (h11 sends no value with whitespace at either end)
                f"bearer {secret}".encode(),
                f"BEARER {secret}".encode(),
                f"Bearer  {secret}".encode(),
                f"Bearer\t{secret}".encode(),
                secret.encode(),
                b"Bearer",
                b"",
                b"Basic dXNlcjpwYXNz",
                f"Bearer {secret}x".encode(),
                f"Bearer {secret[:-1]}".encode(),
                f"Token {secret}".encode(),
                f"Bearer {secret} {secret}".encode(),
                f"Bearer {secret},Bearer {secret}".encode(),
            ]
        ),
        header_text.map(lambda v: b"Bearer " + v),  # a wrong key
        latin1_text.map(lambda v: b"Bearer " + v),
        header_text,  # malformed
        latin1_text,
    ).map(lambda v: v if v is None else v.strip(b" \t"))
    return chance(percent_valid, st.just(valid), bad)


request_ids = st.one_of(
    st.just([]),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=128).map(
        lambda s: [s.encode()]
    ),  # valid
    st.integers(129, 300).map(lambda n: [b"r" * n]),  # too long
    header_text.map(lambda v: [v]),  # spaces, unicode as UTF-8 bytes
    latin1_text.map(lambda v: [v]),  # unicode as latin-1 bytes
    st.lists(st.one_of(header_text, st.just(b"abc")), min_size=2, max_size=2),  # given twice
)
content_types = st.one_of(
    st.none(),
    st.sampled_from(
        [
            b"application/json",
            b"application/json; charset=utf-8",
            b"text/plain",
            b"application/x-www-form-urlencoded",
            b"multipart/form-data; boundary=x",
            b"*/*",
        ]
    ),
    header_text,
)


def headers_of(auth: bytes | None, ids: list[bytes], content_type: bytes | None) -> list[tuple[bytes, bytes]]:
    headers = [] if auth is None else [(b"authorization", auth)]
    headers += [(b"x-request-id", value) for value in ids]
    if content_type is not None:
        headers.append((b"content-type", content_type))
    return headers


def inference_headers(t: Target, percent_valid: int = 80) -> st.SearchStrategy[list[tuple[bytes, bytes]]]:
    return st.builds(headers_of, authorization(t.api_key, percent_valid), request_ids, content_types)


# chat-request-like objects --------------------------------------------------------------------------------
KNOWN_KEYS = {"model", "messages", "stream", "stream_options", "cache_salt", "max_tokens", "tools"}
extra_keys = st.text(max_size=20).filter(lambda k: not k.startswith("replay_") and k not in KNOWN_KEYS)
models = chance(
    60,
    st.just(DEPLOYMENT),
    st.one_of(
        st.sampled_from(["", " fuzzed", "fuzzed ", "FUZZED", "fuzzed\n", "fuzzed\x00", "gpt-4o"]),
        st.text(max_size=30).filter(lambda s: not s.startswith("fz-")),  # never a deployment the fuzz made
        non_strings,
    ),
)
roles = st.one_of(
    st.sampled_from(["user", "system", "assistant", "tool", "developer"]), st.text(max_size=10), non_strings
)
contents = st.one_of(
    st.text(max_size=40),
    non_strings,
    st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}),
        max_size=2,
    ),
)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": roles, "content": contents}, optional={"name": st.text(max_size=8), "tool_calls": json_values}
        ),
        max_size=4,
    ),
    json_values,
)
salts = st.one_of(
    st.text(max_size=30),
    non_strings,
    st.builds(lambda char, n: char * n, st.sampled_from(["s", "é", "€", "😀"]), st.integers(1, 1100)),
    st.sampled_from(["s" * 1024, "s" * 1025, "é" * 512, "é" * 513, "😀" * 256, "😀" * 257]),  # the 1024-byte edge
)
tools = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "other"])},
            optional={
                "function": st.fixed_dictionaries({"name": st.text(max_size=10)}, optional={"parameters": json_values})
            },
        ),
        max_size=2,
    ),
    json_values,
)
chat_fields = st.builds(
    lambda model, more: {**more, **model},
    chance(90, models.map(lambda m: {"model": m}), st.just({})),
    st.fixed_dictionaries(
        {},
        optional={
            "messages": messages,
            "stream": chance(60, st.booleans(), json_values),
            "stream_options": st.one_of(
                st.fixed_dictionaries({}, optional={"include_usage": json_values}), json_values
            ),
            "cache_salt": salts,
            "max_tokens": st.one_of(st.integers(), json_values),
            "tools": tools,
        },
    ),
)
chat_objects = st.builds(
    lambda known, extra: {**extra, **known},
    chat_fields,
    chance(70, st.just({}), st.dictionaries(extra_keys, json_values, max_size=3)),
)
good_chat = st.builds(
    lambda stream, content, extra: {
        "model": DEPLOYMENT,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
        **extra,
    },
    st.booleans(),
    st.text(max_size=40),
    st.fixed_dictionaries(
        {},
        optional={
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
            "cache_salt": salts,
            "max_tokens": st.integers(1, 64),
        },
    ),
)


# --- the inference API ------------------------------------------------------------------------------------
def test_deeply_nested_json_is_refused_as_a_bad_request(target: Target) -> None:
    """~1000 levels of nesting (a few KB) are a 400, never a crash."""
    for shape in ("array", "object", "messages"):
        body = deep(1000, shape)
        r = send(
            target,
            target.inference,
            "POST",
            CHAT,
            [(b"authorization", f"Bearer {target.api_key}".encode()), (b"content-type", b"application/json")],
            body,
        )
        check_answer(target, r)
        assert r.status_code == 400, f"{shape}: {describe(r)}"
        error = r.json()["error"]
        assert error["code"] in ("invalid_json", "invalid_request"), f"{shape}: {describe(r)}"
        assert isinstance(error.get("reason"), str) or error["message"], f"{shape}: {describe(r)}"


def test_nesting_near_the_decoders_limit_is_never_a_server_error(target: Target) -> None:
    """Every depth from 900 to 1010 levels, inside a chat request that is otherwise fine: a 200 or a 400."""
    headers = [(b"authorization", f"Bearer {target.api_key}".encode()), (b"content-type", b"application/json")]
    for stream in (b"false", b"true"):
        for depth in range(900, 1011):
            for nested in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
                body = b'{"model":"fuzzed","stream":' + stream + b',"messages":[],"tools":' + nested + b"}"
                r = send(target, target.inference, "POST", CHAT, headers, body)
                try:
                    check_answer(target, r)
                except AssertionError as exc:
                    raise AssertionError(
                        f"'tools' nested {depth} levels ({nested[:1]!r}), stream {stream!r}: {exc}"
                    ) from None


@fuzz(40)
@given(data=st.data())
def test_chat_random_bytes(target: Target, data: st.DataObject) -> None:
    body = data.draw(st.one_of(st.binary(max_size=200), deep_bodies, st.just(b"")), label="body")
    headers = data.draw(inference_headers(target), label="headers")
    check_answer(target, send(target, target.inference, "POST", CHAT, headers, body))


@fuzz(40)
@given(data=st.data())
def test_chat_random_json(target: Target, data: st.DataObject) -> None:
    body = data.draw(
        json_body(
            st.one_of(
                json_values,
                st.dictionaries(any_text, json_values, max_size=4),
                st.builds(lambda m: {"model": m, "messages": []}, any_text),
            )
        ),
        label="body",
    )
    headers = data.draw(inference_headers(target), label="headers")
    check_answer(target, send(target, target.inference, "POST", CHAT, headers, body))


@fuzz(150)
@given(data=st.data())
def test_chat_request_like(target: Target, data: st.DataObject) -> None:
    obj = data.draw(chance(30, good_chat, chat_objects), label="request")
    body = encode_json(obj, data.draw(st.booleans(), label="ascii_only"))
    headers = data.draw(inference_headers(target), label="headers")
    check_answer(target, send(target, target.inference, "POST", CHAT, headers, body))


known_paths = st.sampled_from(
    [
        "/v1/models",
        "/metrics",
        "/health",
        CHAT,
        "/v1/anything",
        "/",
        "/v1",
        "/v1/models/fuzzed",
        CHAT + "/",
        "/health/",
        "/v1/chat",
        "/v1/completions",
        "/V1/MODELS",
        "//v1/models",
        "/v1/models?x=1",
        "/%00",
        "/%ff",
        "/v1/%2e%2e/metrics",
        "/v1/chat/completions%00",
    ]
)
segments = st.text(max_size=12).map(lambda s: quote(s, safe=""))
random_paths = st.lists(segments, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts))
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])


@fuzz(80)
@given(data=st.data())
def test_inference_methods_and_paths(target: Target, data: st.DataObject) -> None:
    method = data.draw(methods, label="method")
    path = data.draw(st.one_of(known_paths, random_paths), label="path")
    body = data.draw(
        st.one_of(st.none(), st.binary(max_size=50), json_body(json_values), json_body(good_chat)), label="body"
    )
    headers = data.draw(inference_headers(target), label="headers")
    r = send(target, target.inference, method, path, headers, body)
    check_answer(target, r, head=method == "HEAD")


# --- the management API -----------------------------------------------------------------------------------
def admin_headers(t: Target) -> st.SearchStrategy[list[tuple[bytes, bytes]]]:
    return st.builds(
        lambda auth, content_type: headers_of(auth, [], content_type),
        authorization(t.admin_token, 85),
        chance(90, st.just(b"application/json"), content_types),
    )


def safe_segment(s: str) -> bool:
    return s not in ("", ".", "..") and "/" not in s


def sandbox_paths(t: Target) -> st.SearchStrategy[str]:
    """Paths under the sandbox: the empty files and directories made there, or ones that do not exist."""
    segment = chance(
        70,
        st.text(min_size=1, max_size=12).filter(safe_segment),
        st.one_of(
            st.sampled_from(["a\x00b", "\x00", "~", "~root", "-v", " ", "\n", "é"]),
            st.integers(256, 5000).map(lambda n: "x" * n),  # longer than a file name may be (255 bytes)
        ),
    )
    missing = st.lists(segment, min_size=1, max_size=3).map(lambda parts: str(t.sandbox.joinpath("missing", *parts)))
    made = st.sampled_from([str(p) for p in t.made] + [str(p) + "/" for p in t.made])
    return chance(40, made, missing)


# Model paths that cannot exist anywhere: a user no system has, a NUL byte.
IMPOSSIBLE_PATHS = (
    "~capyctl-fuzz-no-such-user/model.gguf",
    "~capyctl-fuzz-no-such-user",
    "~\x00",
    "~/\x00",
    "\x00",
    "/\x00/model",
)


def model_paths(t: Target) -> st.SearchStrategy[str]:
    return chance(80, sandbox_paths(t), st.sampled_from(IMPOSSIBLE_PATHS))


NAME_CHARS = string.ascii_letters + string.digits + "._-"
# Names of deployments the fuzz creates start with fz-: the inference fuzz never asks for one.
# Others cannot be a valid name (they do not begin with an ASCII letter or digit).
text_names = group(
    st.text(NAME_CHARS, max_size=64).map(lambda s: "fz-" + s),
    st.text(NAME_CHARS, min_size=1, max_size=4).map(lambda s: f"fz-{s}\n"),
    st.text(max_size=70).filter(lambda s: not (s[:1].isascii() and s[:1].isalnum())),
)
doc_names = chance(80, text_names, non_strings)


def documents(t: Target) -> st.SearchStrategy[Any]:
    engine_config = st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "context_length": st.one_of(st.integers(), non_strings),
                "extra_args": st.one_of(st.lists(st.text(max_size=12), max_size=3), non_strings),
                "env": st.one_of(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2), non_strings),
            },
        ),
        json_values,
    )
    fields = st.fixed_dictionaries(
        {},
        optional={
            "name": doc_names,
            "engine": st.one_of(st.sampled_from(FAMILIES), st.text(max_size=12), non_strings),
            "model": st.one_of(model_paths(t), non_strings),
            "api": st.one_of(st.sampled_from(["chat", "decisions"]), st.text(max_size=10), non_strings),
            "endpoint": st.just(t.dead_endpoint),
            "engine_version": st.one_of(
                st.sampled_from(["0.32.0", "0.5.0", "b6123", "1.2.3+cpu", ""]), st.text(max_size=20), non_strings
            ),
            "engine_config": engine_config,
        },
    )
    extra = chance(
        80,
        st.just({}),
        st.dictionaries(
            st.text(max_size=12).filter(
                lambda k: k not in ("name", "engine", "model", "api", "endpoint", "engine_version", "engine_config")
            ),
            json_values,
            max_size=2,
        ),
    )
    # close to a document that is taken: an attached engine (on the dead port) or a managed one
    attached = st.builds(
        lambda name, engine, version, more: {
            "name": name,
            "engine": engine,
            "endpoint": t.dead_endpoint,
            **version,
            **more,
        },
        st.one_of(text_names, made_names),
        st.sampled_from(FAMILIES),
        chance(
            80,
            st.one_of(
                st.sampled_from(["0.32.0", "0.5.0", "b6123", "1.2.3+cpu", "0.0.0", "99999999999999999999.0"]),
                st.text(max_size=20),
            ).map(lambda v: {"engine_version": v}),
            st.just({}),
        ),
        st.fixed_dictionaries(
            {},
            optional={"api": st.sampled_from(["chat", "decisions"]), "model": st.one_of(sandbox_paths(t), st.none())},
        ),
    )
    managed = st.builds(
        lambda name, engine, model, more: {"name": name, "engine": engine, "model": model, **more},
        made_names,
        st.one_of(st.sampled_from(FAMILIES), st.text(max_size=12)),
        model_paths(t),
        chance(70, st.just({}), engine_config.map(lambda c: {"engine_config": c})),
    )
    return chance(
        85,
        st.one_of(
            st.builds(lambda known, more: {**more, **known}, fields, extra), attached, attached, managed, managed
        ),
        st.one_of(json_scalars, st.lists(json_scalars, max_size=3)),
    )


def apply_bodies(t: Target) -> st.SearchStrategy[Any]:
    body = st.builds(
        lambda document, activate, more: {**more, **document, **activate},
        chance(90, documents(t).map(lambda d: {"document": d}), st.just({})),
        chance(
            80,
            st.booleans().map(lambda a: {"activate": a}),
            st.one_of(st.just({}), json_scalars.map(lambda a: {"activate": a})),
        ),
        # other keys: never a "document" that no strategy above made
        chance(
            90,
            st.just({}),
            st.dictionaries(
                st.text(max_size=10).filter(lambda k: k not in ("document", "activate")), json_values, max_size=2
            ),
        ),
    )
    return chance(85, body, st.one_of(json_scalars, st.lists(json_scalars, max_size=3)))


def engine_bodies(t: Target) -> st.SearchStrategy[Any]:
    body = st.builds(
        lambda path, more: {**more, **path},
        chance(
            85,
            sandbox_paths(t).map(lambda p: {"path": p}),
            st.one_of(
                st.just({}), st.one_of(st.none(), st.booleans(), st.integers(), st.just("")).map(lambda p: {"path": p})
            ),
        ),
        st.fixed_dictionaries(
            {},
            optional={
                "family": st.one_of(st.sampled_from(FAMILIES), st.text(max_size=12), st.none(), st.integers()),
                "name": st.one_of(st.text(max_size=20), non_strings),
            },
        ),
    )
    return chance(85, body, st.one_of(json_scalars, st.lists(json_scalars, max_size=3)))


def raw_or_json(values: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    # raw bytes only when they cannot be read as JSON at all: nothing but the JSON strategies names a document
    raw = st.one_of(
        st.binary(max_size=60).filter(not_json),
        st.builds(deep, st.integers(1, 1500), st.sampled_from(["array", "object"])),
    )
    return chance(85, json_body(values), raw)


made_names = st.text(NAME_CHARS, max_size=2).map(lambda s: "fz-" + s)  # often a deployment the fuzz made
any_names = st.one_of(st.text(max_size=30), st.just(DEPLOYMENT), made_names)
# never the real deployment, however the path is spelled
harmless_names = st.one_of(st.text(max_size=30).filter(lambda s: "fuzzed" not in s.lower()), made_names)
numbers = chance(
    65,
    st.one_of(
        st.integers().map(str),
        st.integers(-(2**80), 2**80).map(str),
        st.text(max_size=12),
        st.sampled_from(["", "-1", "0", "1", "1e3", "1.5", " 1", "0x10", "NaN"]),
    ),
    st.sampled_from(
        [
            "9223372036854775807",
            "9223372036854775808",
            "-9223372036854775808",
            "-9223372036854775809",
            "18446744073709551616",
            "1" + "0" * 40,
        ]
    ),  # 64-bit edges
)


def events_url(t: Target, params: list[tuple[str, str]], raw: str | None) -> httpx.URL:
    base = f"http://127.0.0.1:{t.server.management_port}/events"
    if raw is not None:
        return httpx.URL(base + "?" + raw)
    return httpx.URL(base, params=params)


def writes_somewhere(path: str) -> bool:
    """A path where a write with a random body could change something (the write tests below do those)."""
    plain = unquote(path).lower().lstrip("/")
    return "fuzzed" in plain or plain.startswith(("deployments", "engines"))


def management_reads(t: Target) -> st.SearchStrategy[tuple[str, str | httpx.URL]]:
    once = st.fixed_dictionaries(
        {},
        optional={
            "deployment": st.one_of(st.just(DEPLOYMENT), made_names, st.text(max_size=12)),
            "after": numbers,
            "limit": numbers,
            "other": numbers,
        },
    ).map(lambda d: list(d.items()))
    repeated = st.lists(
        st.tuples(st.sampled_from(["deployment", "after", "limit", "other"]), st.one_of(numbers, st.just(DEPLOYMENT))),
        max_size=4,
    )
    params = st.one_of(once, once, repeated)
    raw = st.one_of(
        st.none(),
        st.sampled_from(
            [
                "after=%ff",
                "limit=%00",
                "deployment=%",
                "after&limit",
                "=",
                "after=1&after=2",
                "limit=99999999999999999999999",
            ]
        ),
    )
    return st.one_of(
        st.just(("GET", "/engines")),
        st.just(("GET", "/deployments")),
        any_names.map(lambda n: ("GET", "/deployments/" + quote(n, safe=""))),
        st.builds(lambda p, r: ("GET", events_url(t, p, r)), params, raw),
        st.builds(lambda p: ("GET", events_url(t, p, None)), params),
        st.builds(
            lambda m, p: (m, p),
            methods,
            st.one_of(
                random_paths,
                st.sampled_from(["/engines", "/deployments", "/events", "/deployments/fuzzed", "/", "/engines/x"]),
            ),
        ).filter(lambda mp: mp[0] in ("GET", "HEAD", "OPTIONS") or not writes_somewhere(mp[1])),
    )


@fuzz(100)
@given(data=st.data())
def test_management_reads(target: Target, data: st.DataObject) -> None:
    method, url = data.draw(management_reads(target), label="request")
    headers = data.draw(admin_headers(target), label="headers")
    body = None
    if method in ("POST", "PUT", "PATCH"):  # a random route, a random body
        body = data.draw(raw_or_json(json_values), label="body")
    r = send(target, target.management, method, url, headers, body)
    check_answer(target, r, head=method == "HEAD")


def lifecycle_calls() -> st.SearchStrategy[tuple[str, str]]:
    return st.one_of(
        any_names.map(lambda n: ("POST", f"/deployments/{quote(n, safe='')}/start")),
        harmless_names.map(lambda n: ("POST", f"/deployments/{quote(n, safe='')}/stop")),
        harmless_names.map(lambda n: ("DELETE", f"/deployments/{quote(n, safe='')}")),
        any_names.map(lambda n: ("DELETE", f"/engines/{quote(n, safe='')}")),
    )


def write(t: Target, data: st.DataObject, method: str, path: str, body: bytes | None) -> httpx.Response:
    headers = data.draw(admin_headers(t), label="headers")
    r = send(t, t.management, method, path, headers, body)
    check_answer(t, r)
    return r


@fuzz(120)
@given(data=st.data())
def test_management_apply_deployment(target: Target, data: st.DataObject) -> None:
    write(target, data, "PUT", "/deployments", data.draw(raw_or_json(apply_bodies(target)), label="body"))


@fuzz(80)
@given(data=st.data())
def test_management_add_engine(target: Target, data: st.DataObject) -> None:
    r = write(target, data, "POST", "/engines", data.draw(raw_or_json(engine_bodies(target)), label="body"))
    # nothing in the sandbox is an engine: registering one must fail
    assert not 200 <= r.status_code < 300, f"an engine was registered from the sandbox: {describe(r)}"


@fuzz(60)
@given(data=st.data())
def test_management_lifecycle(target: Target, data: st.DataObject) -> None:
    method, path = data.draw(lifecycle_calls(), label="request")
    write(target, data, method, path, None)


def test_deeply_nested_json_to_the_management_api_is_a_bad_request(target: Target) -> None:
    headers = [(b"authorization", f"Bearer {target.admin_token}".encode()), (b"content-type", b"application/json")]
    for path, method in (("/deployments", "PUT"), ("/engines", "POST")):
        for shape in ("array", "object"):
            r = send(target, target.management, method, path, headers, deep(1000, shape))
            check_answer(target, r)
            assert r.status_code == 400, f"{method} {path} {shape}: {describe(r)}"


def test_the_deployment_still_answers_after_the_fuzz(target: Target) -> None:
    r = target.management.get(f"/deployments/{DEPLOYMENT}", headers={"authorization": f"Bearer {target.admin_token}"})
    assert r.status_code == 200 and r.json()["name"] == DEPLOYMENT, describe(r)
    for stream in (False, True):
        r = target.inference.post(
            CHAT,
            headers={"authorization": f"Bearer {target.api_key}"},
            json={"model": DEPLOYMENT, "stream": stream, "messages": [{"role": "user", "content": "Hello"}]},
        )
        assert r.status_code == 200, f"{describe(r)}\n--- server log tail ---\n{target.log_tail()}"
        check_answer(target, r)
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]"), describe(r)
        else:
            assert r.json()["choices"], describe(r)
