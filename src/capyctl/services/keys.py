"""The keyring: named API keys held in memory, checked per request, counted per UTC day, stored as digests.

Every key lives in a dict by its id, so checking one costs a lookup and a
hash whatever the number of keys. Creating or revoking a key changes the
dict and the store at once: a revoked key fails its very next request.

Counting (ID-5): the front door lets a call in (``let_in``: a place taken,
refused at the limit), the service counts it once admission grants it an
engine slot (``admitted``), and the front door gives back a place that was
never counted (``done``). So 20 concurrent calls with 10 left give exactly
10 answers, and a call CapyCTL refused uses nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from capyctl.domain.errors import AlreadyExists, DailyLimit, KeyNotFound
from capyctl.domain.keys import (
    DEFAULT_NAME,
    ID_ALPHABET,
    ID_LENGTH,
    ApiKey,
    Usage,
    bearer,
    check_key,
    check_key_salt,
    check_limit,
    check_models,
    check_name,
    digest,
    format_key,
    key_shape,
    split_key,
    take,
    today,
    utc_day,
)
from capyctl.domain.ports import Clock, KeyStore
from capyctl.services.events import Events

_BOOTSTRAPPED = "default_key"  # meta: the key named default was made or imported once


def new_key_parts() -> tuple[str, str]:
    """A fresh (id, secret): 50 random bits of id, 256 of secret."""
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH)), secrets.token_urlsafe(32)


class Keyring:
    def __init__(
        self,
        store: KeyStore,
        clock: Clock,
        events: Events,
        new_parts: Callable[[], tuple[str, str]] = new_key_parts,
        forget_default: Callable[[], None] = lambda: None,
    ) -> None:
        self._store = store
        self._clock = clock
        self._events = events
        self._new_parts = new_parts
        self._forget_default = forget_default  # the credentials file's key was revoked
        self._by_id: dict[str, ApiKey] = {}
        self._by_name: dict[str, ApiKey] = {}
        self._legacy: ApiKey | None = None
        self._usage: dict[str, Usage] = {}
        self._letting: dict[str, str] = {}  # request id -> key id: let in, not yet counted
        self._day, self._day_starts = "", float("inf")  # the UTC day now, and when it began (Unix seconds)
        self.load()

    def load(self) -> None:
        day = utc_day(self._clock.wall())
        counts = self._store.key_usage(day)
        for key, last_used in self._store.list_keys():
            self._hold(key)
            self._usage[key.id] = Usage(day=day, used=counts.get(key.id, 0), last_used=last_used)

    def _hold(self, key: ApiKey) -> None:
        self._by_id[key.id] = self._by_name[key.name] = key
        if key.legacy:
            self._legacy = key

    # --- the key named default, in identity/credentials ------------------------------------------
    def bootstrap(self, existing: str | None, write: Callable[[str], None]) -> None:
        """Once per state directory: the credentials file's key becomes the key named ``default``
        (a key written before named keys keeps working), or a new one is made and written there."""
        if self._store.get_meta(_BOOTSTRAPPED) is not None:
            return
        if existing:
            parts = split_key(existing)
            key_id = parts[0] if parts else self._fresh_id()
            key = ApiKey(
                id=key_id,
                name=DEFAULT_NAME,
                digest=digest(parts[1] if parts else existing),
                created=self._clock.wall(),
                legacy=parts is None,
            )
        else:
            key_id, secret = self._new_id_and_secret()
            write(format_key(key_id, secret))  # before it is stored: a crash in between imports it next time
            key = ApiKey(id=key_id, name=DEFAULT_NAME, digest=digest(secret), created=self._clock.wall())
        if DEFAULT_NAME not in self._by_name:
            self._store.add_key(key)
            self._hold(key)
            self._usage[key.id] = Usage(day=utc_day(self._clock.wall()))
        self._store.set_meta(_BOOTSTRAPPED, key.id)

    # --- per request ------------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> ApiKey:
        """The key of this ``Authorization`` header, or 401 missing_api_key / invalid_api_key."""
        token = bearer(authorization)
        # a key of this keyring by the id where the named form has it; anything else through split_key
        shaped = key_shape(token)
        stored = self._by_id.get(shaped[0]) if shaped is not None else None
        if shaped is not None and stored is not None:
            key = check_key(stored, shaped[1])
        else:
            parts = split_key(token)
            key = check_key(self._by_id.get(parts[0]), parts[1]) if parts else check_key(self._legacy, token)
        wall = self._clock.wall()
        usage = self._today(key.id, wall)
        usage.last_used = wall
        self._store.note_key_use(key.id, usage.day, usage.used, wall)
        return key

    def let_in(self, key: ApiKey, request_id: str) -> None:
        """Take a place for this call today, or raise 429 daily_limit (nothing taken)."""
        wall = self._clock.wall()
        usage = self._today(key.id, wall)
        try:
            take(key, usage, wall)
        except DailyLimit:
            if usage.refused == 1:  # the first refusal of the day is an event; the rest are only counted
                self._events.emit(None, "daily_limit_reached", key=key.name, daily_limit=key.daily_limit)
            raise
        self._letting[request_id] = key.id

    def admitted(self, request_id: str) -> None:
        """The call was admitted for an engine: it counts today."""
        key_id = self._letting.pop(request_id, None)
        if key_id is None or key_id not in self._by_id:
            return
        usage = self._today(key_id, self._clock.wall())
        usage.pending -= 1
        usage.used += 1
        self._store.note_key_use(key_id, usage.day, usage.used, usage.last_used)

    def done(self, request_id: str) -> None:
        """The call ended; a place it took and never counted is given back."""
        key_id = self._letting.pop(request_id, None)
        if key_id is not None and key_id in self._usage:
            self._usage[key_id].pending -= 1

    def _today(self, key_id: str, wall: float) -> Usage:
        if not self._day_starts <= wall < self._day_starts + 86400:  # a new UTC day (or the clock went back)
            self._day, self._day_starts = utc_day(wall), wall - wall % 86400
        usage = self._usage.get(key_id)
        if usage is None or usage.day != self._day:
            usage = self._usage[key_id] = today(usage, self._day)
        return usage

    # --- what operators do ------------------------------------------------------------------------
    def create(
        self, name: object, daily_limit: object = None, models: object = None, cache_salt: object = None
    ) -> tuple[ApiKey, str]:
        """A new key and its secret (shown once, never stored)."""
        key_name = check_name(name)
        if key_name in self._by_name:
            raise AlreadyExists(f"a key named {key_name!r} exists; revoke it first with: capyctl revoke key {key_name}")
        key_id, secret = self._new_id_and_secret()
        key = ApiKey(
            id=key_id,
            name=key_name,
            digest=digest(secret),
            created=self._clock.wall(),
            daily_limit=check_limit(daily_limit),
            models=check_models(models),
            cache_salt=check_key_salt(cache_salt),
        )
        self._store.add_key(key)
        self._hold(key)
        self._usage[key.id] = Usage(day=utc_day(self._clock.wall()))
        self._events.emit(
            None,
            "key_created",
            key=key.name,
            key_id=key.id,
            daily_limit=key.daily_limit,
            models=list(key.models) if key.models is not None else None,
            cache_salt=key.cache_salt is not None,
        )
        return key, format_key(key_id, secret)

    def revoke(self, name: str) -> ApiKey:
        key = self._by_name.get(name)
        if key is None:
            raise KeyNotFound(name)
        self._store.delete_key(key.id)
        del self._by_name[name], self._by_id[key.id]
        self._usage.pop(key.id, None)
        if self._legacy is key:
            self._legacy = None
        if key.name == DEFAULT_NAME and self._store.get_meta(_BOOTSTRAPPED) == key.id:
            self._forget_default()
        self._events.emit(None, "key_revoked", key=key.name, key_id=key.id)
        return key

    def with_usage(self) -> list[tuple[ApiKey, Usage]]:
        """Every key, by name, with its use today."""
        wall = self._clock.wall()
        return [(key, self._today(key.id, wall)) for _, key in sorted(self._by_name.items())]

    def get(self, name: str) -> tuple[ApiKey, Usage]:
        key = self._by_name.get(name)
        if key is None:
            raise KeyNotFound(name)
        return key, self._today(key.id, self._clock.wall())

    def _fresh_id(self) -> str:
        return self._new_id_and_secret()[0]

    def _new_id_and_secret(self) -> tuple[str, str]:
        while True:
            key_id, secret = self._new_parts()
            if key_id not in self._by_id:
                return key_id, secret
