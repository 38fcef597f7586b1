"""Named API keys (ID-3 … ID-5, SALT-1): their form, how a presented key is checked, daily limits, scopes.

A key reads ``capy_<id>_<secret>``: ``id`` (10 characters of lowercase
base32) names the record to look up, ``secret`` (43 characters of url-safe
base64, 256 random bits) is what proves it. Only a SHA-256 digest of the
secret is stored: for a secret of 256 random bits a fast hash is right
(nobody can guess one, so a slow hash would only cost each request time).
The digest is compared in constant time.

A key from before named keys (``capy-<secret>``, one per state directory)
has no id part; its digest covers the whole key, and it stays the key named
``default``.

Daily limits count calls per UTC day. A call takes a place when it is
let in, and counts once CapyCTL admits it for an engine; a call refused
before that gives its place back, so concurrent calls can never pass the
limit and refused ones never use it.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

import msgspec

from capyctl.domain.deployments import NAME_PATTERN
from capyctl.domain.errors import DailyLimit, InvalidApiKey, InvalidRequest, MissingApiKey, ModelNotFound

PREFIX = "capy_"
LEGACY_PREFIX = "capy-"
ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
ID_LENGTH = 10
# A salt bound to a key must be taken by every engine that honours cache_salt: vLLM 0.30+ refuses
# more than 128 characters and the characters @ / \ and NUL.
_SALT_FORBIDDEN = frozenset("@/\\\x00")
MAX_KEY_SALT = 128
DEFAULT_NAME = "default"


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    """One named key as stored: never its secret, only the secret's digest."""

    id: str
    name: str
    digest: str  # SHA-256 (hex) of the secret; of the whole key for a legacy one
    created: float  # Unix seconds
    daily_limit: int | None = None  # calls per UTC day; None: no limit
    models: tuple[str, ...] | None = None  # the only models it may see and use; None: all
    cache_salt: str | None = None  # sent to the engine with every request made with it
    legacy: bool = False  # a key from before named keys: ``capy-<secret>``, no id part

    def sees(self, model: str) -> bool:
        return self.models is None or model in self.models


class Usage(msgspec.Struct, kw_only=True):
    """A key's calls on one UTC day: counted (admitted for an engine) and under way (let in, not yet)."""

    day: str
    used: int = 0
    pending: int = 0
    last_used: float | None = None
    refused: int = 0  # calls refused today at the daily limit (kept in memory: a restart counts afresh)


# One hasher made at import and copied for each key: a copy starts from its state, so no call looks the
# algorithm up again (hashlib's public API; CPython's private _sha256 module is not used).
_SHA256 = hashlib.sha256()


def digest(secret: str) -> str:
    """A key secret's SHA-256, in hex: what is stored and compared."""
    hasher = _SHA256.copy()
    hasher.update(secret.encode())
    return hasher.hexdigest()


def format_key(key_id: str, secret: str) -> str:
    return f"{PREFIX}{key_id}_{secret}"


_KEY_LENGTH = len(PREFIX) + ID_LENGTH + 1 + 43  # capy_<id>_<secret>
_ID_END = len(PREFIX) + ID_LENGTH
_ID_CHARS = frozenset(ID_ALPHABET)


def key_shape(token: str) -> tuple[str, str] | None:
    """(id, secret) of a token shaped as a named key, the id's characters unchecked; None for any other.
    A keyring looks its keys up with it (an id it holds passed ``split_key`` when its key was made)."""
    if len(token) != _KEY_LENGTH or token[_ID_END] != "_" or not token.startswith(PREFIX):
        return None
    return token[len(PREFIX) : _ID_END], token[_ID_END + 1 :]


def split_key(token: str) -> tuple[str, str] | None:
    """(id, secret) of a key in the named form, None for anything else.

    Plain slicing, no regular expression: it runs on every request. The secret's characters need no
    check: one that is not the key's fails the digest comparison.
    """
    parts = key_shape(token)
    if parts is None or not _ID_CHARS.issuperset(parts[0]):
        return None
    return parts


def bearer(authorization: str | None) -> str:
    """The key of an ``Authorization: Bearer <key>`` header; MissingApiKey without one."""
    if not authorization:
        raise MissingApiKey()
    scheme, _, given = authorization.partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        raise MissingApiKey()
    return given


_NO_KEY = digest("no key has this digest")


def matches(stored: ApiKey | None, secret: str) -> bool:
    """True when ``secret`` is ``stored``'s; compares digests in constant time, even for no key."""
    expected = stored.digest if stored is not None else _NO_KEY
    same = hmac.compare_digest(digest(secret).encode(), expected.encode())
    return same and stored is not None


def check_key(stored: ApiKey | None, secret: str) -> ApiKey:
    if not matches(stored, secret):
        raise InvalidApiKey()
    assert stored is not None
    return stored


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidRequest(
            f"a key name must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit; "
            f"got {name!r}",
            param="name",
        )
    return name


def check_limit(limit: object) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidRequest(
            f"'daily_limit' must be a whole number of calls from 1, or absent; got {limit!r}", param="daily_limit"
        )
    return limit


def check_models(models: object) -> tuple[str, ...] | None:
    if models is None:
        return None
    if not isinstance(models, list | tuple) or not models:
        raise InvalidRequest(
            "'models' must be a non-empty list of model names, or absent (every model)", param="models"
        )
    for name in models:
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise InvalidRequest(f"'models' holds {name!r}, which is not a model name", param="models")
    return tuple(dict.fromkeys(models))


def check_key_salt(salt: object) -> str | None:
    """A salt to bind to a key: one that every engine honouring cache_salt accepts (SALT-1, vLLM 0.30+)."""
    if salt is None:
        return None
    if (
        not isinstance(salt, str)
        or not salt
        or len(salt) > MAX_KEY_SALT
        or any(char in _SALT_FORBIDDEN for char in salt)
    ):
        raise InvalidRequest(
            f"'cache_salt' must be a non-empty string of at most {MAX_KEY_SALT} characters without "
            "'@', '/', '\\' or NUL (what vLLM accepts)",
            param="cache_salt",
        )
    return salt


def bind_salt(key: ApiKey, obj: dict[str, object]) -> None:
    """SALT-1 for a salted key: the request carries the key's salt; a different one from the client is refused.

    The message never shows the key's salt.
    """
    if key.cache_salt is None:
        return
    given = obj.get("cache_salt")
    if given is not None and given != key.cache_salt:
        raise InvalidRequest(
            f"the key {key.name!r} is bound to a cache salt, and this request sent another one; "
            "send no cache_salt (CapyCTL adds the key's own) or the key's own",
            param="cache_salt",
        )
    obj["cache_salt"] = key.cache_salt


def check_scope(key: ApiKey, model: str, deployed: Callable[[], list[str]]) -> None:
    """A scoped key learns only of its own models: a name outside its list, or on its list but not deployed,
    is not found, and ``available`` holds only its own deployed models. ``deployed`` (the names of every
    deployment) is asked only for a scoped key."""
    if key.models is None:
        return
    names = deployed()
    if model not in key.models or model not in names:
        raise ModelNotFound(model, [name for name in names if key.sees(name)])


def utc_day(wall: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(wall))


def seconds_to_midnight(wall: float) -> int:
    """Whole seconds from ``wall`` to the next 00:00 UTC (1 to 86400), rounded up."""
    left = 86400 - (wall % 86400)
    return max(1, int(-(-left // 1)))


def today(usage: Usage | None, day: str) -> Usage:
    """The usage of ``day``: a new day starts from zero; what is under way stays under way."""
    if usage is None:
        return Usage(day=day)
    if usage.day != day:
        return Usage(day=day, pending=usage.pending, last_used=usage.last_used)
    return usage


def take(key: ApiKey, usage: Usage, wall: float) -> None:
    """Let one call of ``key`` in (a place under way), or refuse it with 429 daily_limit."""
    limit = key.daily_limit
    if limit is not None and usage.used + usage.pending >= limit:
        usage.refused += 1
        raise DailyLimit(key.name, limit, usage.used + usage.pending, seconds_to_midnight(wall))
    usage.pending += 1
