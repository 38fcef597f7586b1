"""Named API keys: their form, checks, daily counts, scopes and salts, on fake and real stores and clocks."""

from __future__ import annotations

import calendar
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
import pytest

from capyctl.adapters.http.chat import ChatEndpoint
from capyctl.adapters.http.front import FrontDoor
from capyctl.adapters.storage.sqlite import SqliteStore
from capyctl.domain.deployments import Deployment, Desired
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import (
    AlreadyExists,
    DailyLimit,
    InvalidApiKey,
    InvalidRequest,
    KeyNotFound,
    MissingApiKey,
    ModelNotFound,
)
from capyctl.domain.fields import row_for
from capyctl.domain.keys import (
    ApiKey,
    bind_salt,
    check_scope,
    format_key,
    seconds_to_midnight,
    split_key,
    utc_day,
)
from capyctl.domain.scheduling import QueueLimits
from capyctl.domain.streams import DONE
from capyctl.services.admission import AdmissionService
from capyctl.services.chat import ChatService
from capyctl.services.controllers import AttachedController
from capyctl.services.events import Events
from capyctl.services.fleet import decode_spec
from capyctl.services.keys import Keyring
from capyctl.services.requests import RequestSettings
from tests.fakes.answers import ScriptedAnswer, chunks
from tests.fakes.asgi_door import AsgiDoor
from tests.fakes.ports import FakeClock, FakeEngineAdapter, FakeStore

SECRET = "s" * 43
MIDNIGHT = float(calendar.timegm((2026, 12, 2, 0, 0, 0)))  # 2026-12-02 00:00:00 UTC


def ring(store: Any = None, clock: FakeClock | None = None) -> tuple[Keyring, Any, FakeClock]:
    store = store if store is not None else FakeStore()
    clock = clock or FakeClock()
    return Keyring(store, clock, Events(store, clock)), store, clock


def auth(token: str) -> str:
    return f"Bearer {token}"


def serve(keyring: Keyring, key: ApiKey, request_id: str) -> None:
    """One call as the front door and the service make it: let in, admitted for an engine, done."""
    keyring.let_in(key, request_id)
    keyring.admitted(request_id)
    keyring.done(request_id)


# --- the key's form ------------------------------------------------------------------------------------
def test_a_key_splits_into_its_id_and_secret_and_nothing_else_passes() -> None:
    token = format_key("abcdefgh23", SECRET)
    assert token == f"capy_abcdefgh23_{SECRET}"
    assert split_key(token) == ("abcdefgh23", SECRET)
    assert split_key(format_key("abcdefgh23", "a_b-" + "c" * 39)) == ("abcdefgh23", "a_b-" + "c" * 39)  # _ in secret
    for bad in [
        "",
        "capy_",
        f"capy-{SECRET}",
        f"capy_ABCDEFGH23_{SECRET}",
        f"capy_abcdefgh2_{SECRET}",
        f"capy_abcdefgh23_{SECRET[:-1]}",
        f"capy_abcdefgh23_{SECRET}x",
        f"xcapy_abcdefgh23_{SECRET}",
        f"capy_abcdefgh18_{SECRET}",
        f"capy_abcdefgh23-{SECRET}",
    ]:  # 1 and 8 are not base32
        assert split_key(bad) is None, bad


def test_created_keys_have_256_random_bits_and_are_stored_as_digests_only() -> None:
    keyring, store, _ = ring()
    _, first = keyring.create("a")
    _, second = keyring.create("b")
    assert first != second
    for token in (first, second):
        key_id, secret = split_key(token) or ("", "")
        assert len(secret) == 43  # 32 bytes of url-safe base64
        stored, _ = store.keys[key_id]
        assert secret not in msgspec.json.encode(stored).decode()
        assert keyring.authenticate(auth(token)) == stored


def test_authenticate_refuses_missing_wrong_unknown_and_revoked_keys() -> None:
    keyring, _, _ = ring()
    key, token = keyring.create("app")
    for missing in (None, "", "Bearer ", "Basic abc", "Bearer"):
        with pytest.raises(MissingApiKey):
            keyring.authenticate(missing)
    key_id, secret = split_key(token) or ("", "")
    wrong = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    for bad in (format_key(key_id, wrong), format_key("zzzzzzzzzz", secret), "nonsense", f"capy-{secret}"):
        with pytest.raises(InvalidApiKey):
            keyring.authenticate(auth(bad))
    assert keyring.authenticate(f"bearer {token}") == key  # the scheme is case-insensitive
    keyring.revoke("app")
    with pytest.raises(InvalidApiKey):
        keyring.authenticate(auth(token))
    with pytest.raises(KeyNotFound):
        keyring.revoke("app")


def test_names_limits_models_and_salts_are_checked_and_nothing_is_made_of_a_bad_one() -> None:
    keyring, store, _ = ring()
    keyring.create("app")
    with pytest.raises(AlreadyExists):
        keyring.create("app")
    bad: list[dict[str, Any]] = [
        {"name": "has space"},
        {"name": ""},
        {"name": None},
        {"name": "-dash"},
        {"name": "x" * 65},
        {"name": "n", "daily_limit": 0},
        {"name": "n", "daily_limit": True},
        {"name": "n", "daily_limit": "5"},
        {"name": "n", "models": []},
        {"name": "n", "models": "a,b"},
        {"name": "n", "models": ["ok", "not ok"]},
        {"name": "n", "cache_salt": ""},
        {"name": "n", "cache_salt": "a/b"},
        {"name": "n", "cache_salt": "x@y"},
        {"name": "n", "cache_salt": "x" * 129},
        {"name": "n", "cache_salt": 7},
    ]
    for fields in bad:
        with pytest.raises(InvalidRequest):
            keyring.create(**fields)
    assert [k.name for k, _ in store.list_keys()] == ["app"]
    key, _ = keyring.create("n", daily_limit=5, models=["b", "a", "b"], cache_salt="x" * 128)
    assert (key.daily_limit, key.models, key.cache_salt) == (5, ("b", "a"), "x" * 128)
    assert [e["kind"] for e in store.events] == ["key_created", "key_created"]
    assert store.events[-1]["detail"]["cache_salt"] is True  # said to be bound; the salt itself is not in events
    assert "x" * 128 not in str(store.events)


# --- the key named default -----------------------------------------------------------------------------
def test_the_first_start_writes_the_default_key_and_later_starts_keep_it() -> None:
    keyring, store, clock = ring()
    written: list[str] = []
    keyring.bootstrap(None, written.append)
    assert len(written) == 1 and split_key(written[0])
    assert keyring.authenticate(auth(written[0])).name == "default"
    again = Keyring(store, clock, Events(store, clock))
    again.bootstrap(written[0], written.append)  # the next start reads the file: nothing new
    assert len(written) == 1 and [k.name for k, _ in store.list_keys()] == ["default"]
    assert again.authenticate(auth(written[0])).name == "default"


def test_a_key_from_before_named_keys_becomes_the_default_key() -> None:
    keyring, store, _ = ring()
    legacy = "capy-3zHi4Y4GKRCkyI973_uLHc3rQLfA3YjqxHiu6oqR2gI"
    keyring.bootstrap(legacy, lambda _: pytest.fail("an existing key must not be replaced"))
    key = keyring.authenticate(auth(legacy))
    assert key.name == "default" and key.legacy
    assert legacy not in str(store.keys) and legacy.removeprefix("capy-") not in str(store.keys)
    with pytest.raises(InvalidApiKey):
        keyring.authenticate(auth(legacy[:-1] + "x"))


def test_a_token_gets_the_same_answer_whether_its_id_is_looked_up_directly_or_through_split_key() -> None:
    """authenticate looks a key of the ring up by the id where the named form has it, and sends every
    other token through split_key: a named key, its wrong secrets, look-alikes of the named form and a key
    from before named keys that has that form get the answers they got before."""
    keyring, _, _ = ring()
    legacy = "capy_ABCDEFGH23_" + "L" * 43  # named form, but an id no named key can have (upper case)
    keyring.bootstrap(legacy, lambda _: pytest.fail("an existing key must not be replaced"))
    assert keyring.authenticate(auth(legacy)).legacy
    key, token = keyring.create("ci")
    assert keyring.authenticate(auth(token)) is key
    key_id, secret = split_key(token)  # type: ignore[misc]
    legacy_id = keyring.get("default")[0].id
    for wrong in [
        format_key(key_id, secret[:-1] + ("x" if secret[-1] != "x" else "y")),  # its id, another secret
        f"capy-{key_id}_{secret}",  # its id and secret, another prefix
        f"capy_{key_id}-{secret}",  # its id and secret, no separator
        format_key(legacy_id, "L" * 43),  # the legacy key's own id in the named form
        format_key("abcdefgh23", secret),  # an id of no key
        legacy.replace("capy_", "capy-"),
    ]:
        with pytest.raises(InvalidApiKey):
            keyring.authenticate(auth(wrong))


def test_a_revoked_default_key_is_not_made_again_and_its_file_is_cleared() -> None:
    store, clock = FakeStore(), FakeClock()
    forgotten: list[bool] = []
    keyring = Keyring(store, clock, Events(store, clock), forget_default=lambda: forgotten.append(True))
    written: list[str] = []
    keyring.bootstrap(None, written.append)
    keyring.revoke("default")
    assert forgotten == [True]
    later = Keyring(store, clock, Events(store, clock))
    later.bootstrap(None, written.append)  # the file now has no key line
    assert len(written) == 1 and store.list_keys() == []


# --- daily limits ----------------------------------------------------------------------------------------
def test_seconds_to_midnight_utc() -> None:
    assert seconds_to_midnight(MIDNIGHT) == 86400
    assert seconds_to_midnight(MIDNIGHT - 0.5) == 1
    assert seconds_to_midnight(MIDNIGHT - 3600) == 3600
    assert seconds_to_midnight(MIDNIGHT + 1.25) == 86399  # rounded up: never says "now" before midnight
    assert utc_day(MIDNIGHT - 0.001) == "2026-12-01" and utc_day(MIDNIGHT) == "2026-12-02"


def test_a_limit_counts_admitted_calls_refuses_past_it_and_starts_again_at_midnight() -> None:
    keyring, _, clock = ring()
    clock.now = MIDNIGHT - 100
    key, _ = keyring.create("app", daily_limit=3)
    for n in range(3):
        serve(keyring, key, f"r{n}")
    with pytest.raises(DailyLimit) as refused:
        keyring.let_in(key, "r3")
    assert refused.value.extra == {"limit": 3, "used": 3} and refused.value.retry_after == 100
    keyring.done("r3")  # the front door always calls done; a refused call took nothing
    assert keyring.get("app")[1].used == 3 and keyring.get("app")[1].pending == 0
    clock.now = MIDNIGHT
    keyring.let_in(key, "r4")
    keyring.admitted("r4")
    assert keyring.get("app")[1].used == 1


def test_a_call_refused_before_admission_gives_its_place_back() -> None:
    keyring, _, _ = ring()
    key, _ = keyring.create("app", daily_limit=1)
    keyring.let_in(key, "a")
    with pytest.raises(DailyLimit) as refused:  # the place is under way: the limit holds
        keyring.let_in(key, "b")
    assert refused.value.extra["used"] == 1
    keyring.done("a")  # never admitted (queue_full, model_loading, ...): not counted
    assert keyring.get("app")[1].used == 0
    serve(keyring, key, "c")
    assert keyring.get("app")[1].used == 1


def test_calls_of_a_revoked_key_under_way_end_without_harm() -> None:
    keyring, _, _ = ring()
    key, _ = keyring.create("app", daily_limit=5)
    keyring.let_in(key, "a")
    keyring.let_in(key, "b")
    keyring.revoke("app")
    keyring.admitted("a")
    keyring.done("a")
    keyring.done("b")
    with pytest.raises(KeyNotFound):
        keyring.get("app")


def test_counts_and_last_use_survive_a_restart_and_no_secret_reaches_the_database(tmp_path: Path) -> None:
    clock = FakeClock()
    clock.now = MIDNIGHT - 1000
    store = SqliteStore(tmp_path / "db")
    keyring = Keyring(store, clock, Events(store, clock))
    key, token = keyring.create("app", daily_limit=10, models=["m"], cache_salt="tenant-a")
    for n in range(4):
        keyring.authenticate(auth(token))
        serve(keyring, key, f"r{n}")
    store.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert split_key(token)[1].encode() not in raw  # type: ignore[index]
    assert stat.S_IMODE((tmp_path / "db").stat().st_mode) == 0o600
    store = SqliteStore(tmp_path / "db")
    later = Keyring(store, clock, Events(store, clock))
    again, usage = later.get("app")
    assert again == key and usage.used == 4 and usage.last_used == MIDNIGHT - 1000
    assert later.authenticate(auth(token)) == key
    clock.now = MIDNIGHT + 5  # a restart on the next day starts from zero
    store.close()
    store = SqliteStore(tmp_path / "db")
    assert Keyring(store, clock, Events(store, clock)).get("app")[1].used == 0
    store.close()


# --- scopes and salts --------------------------------------------------------------------------------
def test_a_scoped_key_learns_only_of_its_own_models() -> None:
    key = ApiKey(id="abcdefgh23", name="app", digest="", created=0.0, models=("alpha", "gone"))
    check_scope(key, "alpha", lambda: ["alpha", "beta", "gamma"])
    check_scope(
        ApiKey(id="abcdefgh23", name="all", digest="", created=0.0),
        "beta",
        lambda: pytest.fail("the names are read only for a scoped key"),
    )
    for other in ("beta", "nope", "gone"):  # gone: on its list, not deployed
        with pytest.raises(ModelNotFound) as refused:
            check_scope(key, other, lambda: ["alpha", "beta", "gamma"])
        assert refused.value.extra["available"] == ["alpha"]
        message = refused.value.message.replace(f"'{other}'", "")
        assert "beta" not in message and "gamma" not in message and "alpha" in message


def test_a_bound_salt_is_added_kept_or_refused_and_never_shown() -> None:
    key = ApiKey(id="abcdefgh23", name="app", digest="", created=0.0, cache_salt="tenant-secret-salt")
    none: dict[str, Any] = {}
    bind_salt(key, none)
    assert none["cache_salt"] == "tenant-secret-salt"
    same: dict[str, Any] = {"cache_salt": "tenant-secret-salt"}
    bind_salt(key, same)
    assert same["cache_salt"] == "tenant-secret-salt"
    for other in ("other", "", 5):
        obj: dict[str, Any] = {"cache_salt": other}
        with pytest.raises(InvalidRequest) as refused:
            bind_salt(key, obj)
        assert "tenant-secret-salt" not in refused.value.message and obj["cache_salt"] == other
    unsalted = ApiKey(id="abcdefgh23", name="app", digest="", created=0.0)
    obj = {"cache_salt": "mine"}
    bind_salt(unsalted, obj)
    assert obj == {"cache_salt": "mine"}


# --- through the front door, on a clock the test moves ----------------------------------------------------
CHUNK = {
    "id": "c",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
}


class OneChunkEngine:
    """An engine that answers one chunk and [DONE]; counts the requests that reached it, and their bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.gate = anyio.Event()
        self.gate.set()

    @asynccontextmanager
    async def chat_stream(self, base_url: str, body: bytes) -> AsyncIterator[ScriptedAnswer]:
        self.bodies.append(msgspec.json.decode(body))

        async def events() -> AsyncIterator[list[Any]]:
            await self.gate.wait()
            yield [chunks(CHUNK), DONE]

        yield ScriptedAnswer(events())


class Stats:
    def __init__(self) -> None:
        self.codes: list[tuple[str, str | None]] = []

    def answered(self, model: str, code: str, ttft: float | None, key: str = "-") -> None:
        self.codes.append((code, key))

    def relayed_first_chunk(self, *args: Any) -> None: ...
    def refused(self, *args: Any) -> None: ...


async def call(app: Any, token: str, body: dict[str, Any]) -> tuple[int, dict[bytes, bytes], dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": msgspec.json.encode(body), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await anyio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"authorization", f"Bearer {token}".encode())],
    }
    with anyio.fail_after(5):
        await app(scope, receive, send)
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], dict(sent[0]["headers"]), msgspec.json.decode(payload)


def front_door(
    clock: FakeClock, family: str = EngineFamily.VLLM, slots: int = 4, max_pending: int = 64
) -> tuple[AsgiDoor, Keyring, OneChunkEngine, Stats]:
    version = "0.32.0" if family == EngineFamily.VLLM else "0.6.0"
    spec = decode_spec({"name": "m", "engine": family, "endpoint": "http://127.0.0.1:9", "engine_version": version})
    engine = EngineInstall(name="e", family=family, path="x", version=version, version_text="")
    store = FakeStore()
    events = Events(store, clock)
    controller = AttachedController(
        Deployment(spec=spec), engine, FakeEngineAdapter(), clock, events, row_for(engine.family, engine.version)
    )
    controller.want(Desired.RUN)
    fleet = SimpleNamespace(
        instances=lambda name, api="chat": [controller],
        has=lambda name: name == "m",
        get=lambda name: controller,
        names=lambda: ["m", "other"],
    )
    keyring = Keyring(store, clock, events)
    admission = AdmissionService(
        QueueLimits(max_in_flight_per_instance=slots, max_pending_per_deployment=max_pending), clock
    )
    session = OneChunkEngine()
    service = ChatService(fleet, session, clock, events, RequestSettings(), admission, keyring)  # type: ignore[arg-type]
    stats = Stats()
    return AsgiDoor(FrontDoor([ChatEndpoint(service, stats)], keyring, 1 << 20, stats)), keyring, session, stats  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_the_front_door_refuses_past_the_limit_until_midnight_utc() -> None:
    clock = FakeClock()
    clock.now = MIDNIGHT - 42.5
    door, keyring, engine, stats = front_door(clock)
    key, token = keyring.create("app", daily_limit=2)
    for _ in range(2):
        status, _, _ = await call(door, token, {"model": "m", "messages": []})
        assert status == 200
    await call(door, token, {"model": "nope", "messages": []})  # refused by CapyCTL: does not count
    await call(door, token, {"model": "m", "messages": [], "cache_salt": ""})
    status, headers, body = await call(door, token, {"model": "m", "messages": []})
    assert status == 429 and headers[b"retry-after"] == b"43"
    assert body["error"]["code"] == "daily_limit" and body["error"]["type"] == "rate_limit_exceeded"
    assert (body["error"]["limit"], body["error"]["used"]) == (2, 2)
    assert len(engine.bodies) == 2  # the refused ones never reached the engine
    assert ("ok", "app") in stats.codes
    clock.now = MIDNIGHT  # a new UTC day
    status, _, _ = await call(door, token, {"model": "m", "messages": []})
    assert status == 200 and keyring.get("app")[1].used == 1


@pytest.mark.anyio
async def test_twenty_concurrent_calls_with_ten_left_give_exactly_ten_answers() -> None:
    clock = FakeClock()
    door, keyring, engine, _ = front_door(clock, slots=3)  # most of the ten wait in line for a slot
    key, token = keyring.create("app", daily_limit=15)
    for _ in range(5):
        assert (await call(door, token, {"model": "m", "messages": []}))[0] == 200
    engine.gate = anyio.Event()  # hold the answers, so all twenty are under way together
    statuses: list[int] = []

    async def one() -> None:
        statuses.append((await call(door, token, {"model": "m", "messages": []}))[0])

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(one)
        with anyio.fail_after(5):
            while len(statuses) < 10:  # the ten past the limit are answered at once
                await anyio.sleep(0.001)
        engine.gate.set()
    assert sorted(statuses) == [200] * 10 + [429] * 10
    assert keyring.get("app")[1].used == 15 and keyring.get("app")[1].pending == 0


@pytest.mark.anyio
async def test_a_call_refused_by_the_queue_does_not_count() -> None:
    clock = FakeClock()
    door, keyring, engine, _ = front_door(clock, slots=1, max_pending=1)
    key, token = keyring.create("app", daily_limit=5)
    engine.gate = anyio.Event()
    statuses: list[int] = []

    async def one() -> None:
        statuses.append((await call(door, token, {"model": "m", "messages": []}))[0])

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        with anyio.fail_after(5):
            while not engine.bodies:  # the first holds the one slot
                await anyio.sleep(0.001)
        tg.start_soon(one)
        with anyio.fail_after(5):
            while keyring.get("app")[1].pending != 1:  # the second waits in line, let in but not counted
                await anyio.sleep(0.001)
        await one()  # nobody more may wait: 429 queue_full
        assert statuses == [429]
        engine.gate.set()
    assert sorted(statuses) == [200, 200, 429]
    assert keyring.get("app")[1].used == 2


@pytest.mark.anyio
async def test_a_salted_key_sends_its_salt_and_a_llama_cpp_deployment_refuses_it() -> None:
    clock = FakeClock()
    door, keyring, engine, _ = front_door(clock)
    _, token = keyring.create("tenant", cache_salt="tenant-a")
    assert (await call(door, token, {"model": "m", "messages": []}))[0] == 200
    assert engine.bodies[-1]["cache_salt"] == "tenant-a"
    status, _, body = await call(door, token, {"model": "m", "messages": [], "cache_salt": "tenant-b"})
    assert status == 400 and body["error"]["code"] == "invalid_request" and "tenant-a" not in str(body)
    assert len(engine.bodies) == 1

    door, keyring, engine, _ = front_door(clock, family=EngineFamily.LLAMACPP)
    _, token = keyring.create("tenant", cache_salt="tenant-a")
    status, _, body = await call(door, token, {"model": "m", "messages": []})
    assert status == 400 and body["error"]["code"] == "cache_salt_unsupported"
    assert "'tenant'" in body["error"]["message"] and engine.bodies == []
    assert keyring.get("tenant")[1].used == 0


def test_the_digest_is_sha256_in_hex_as_stored_by_earlier_versions() -> None:
    """Keys stored before the digest moved to CPython's own SHA-256 module must still match."""
    import hashlib

    from capyctl.domain.keys import digest

    for secret in ["", "a", "k" * 43, "é-ünïcode ☃", "x" * 1000]:
        assert digest(secret) == hashlib.sha256(secret.encode()).hexdigest()
