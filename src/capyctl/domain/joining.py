"""Invitations: how a GPU machine earns the right to ask the server's CA for a host certificate.

The sequence (issue 31):

1. ``capyctl invite host NAME`` on the server draws a secret of
   ``SECRET_BYTES`` random bytes (the caller draws it: the domain has no
   randomness), makes an ``Invite`` with ``invite_for`` and keeps only that
   record, which holds the secret's SHA-256, never the secret. The secret,
   the control address and the CA certificate go into a ``JoinFile`` for
   the host's eyes only.
2. On the GPU machine the host makes its key and CSR, checks the server
   against the CA pinned in the file (the TLS layer's job) and only then
   sends its name, the secret and the CSR.
3. The server looks the invite up by the secret's hash and calls ``redeem``:
   the invite comes back marked used, or ``JoinRefused`` says why not.

A secret of at least 128 random bits cannot be guessed, so a fast hash is
the right one, and the hashes are compared in constant time all the same.
An unknown secret and a forged one look alike on purpose: the server knows
nothing more of either. A refusal for another host's name does not spend
the invite, so a typo at the join does not cost the operator a new file.

An invite is good from ``created_at`` up to, but not including,
``expires_at``: at the very second it ends it is expired.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from typing import Annotated, Final, Literal

import msgspec

from capyctl.domain.deployments import Strict
from capyctl.domain.errors import CapyError, InvalidConfig, InvalidRequest

DEFAULT_TTL = 900.0  # seconds an invitation lasts unless the operator says otherwise (15 min)
MAX_TTL = 3600.0  # the longest an invitation may last (1 h)
SECRET_BYTES = 32  # what ``capyctl invite host`` draws; 256 bits
MIN_SECRET_BYTES = 16  # 128 bits: the least ``invite_for`` takes
JOIN_FILE_VERSION: Final = 1

HOST_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")  # a DNS label in lower case; fullmatch
RESERVED_NAME = "capyctl-server"  # the name every host checks the control listener's certificate for
_URLSAFE = re.compile(r"[A-Za-z0-9_-]*")
_HOST_RULE = "1 to 63 characters of a-z, 0-9 and '-', neither starting nor ending with '-'"
_ASK_AGAIN = "ask the server's operator for a new invitation with `capyctl invite host {name}`"

JoinReason = Literal["unknown_secret", "used", "expired", "wrong_host"]


class JoinRefused(CapyError):
    """The server will not let a machine join with this secret; ``reason`` says why in one word."""

    code = "join_refused"

    def __init__(self, reason: JoinReason, message: str, **extra: object) -> None:
        super().__init__(message, reason=reason, **extra)
        self.reason = reason


class Invite(Strict, kw_only=True, frozen=True):
    """One invitation as the server keeps it: the hash of its secret, whom it is for, and its times."""

    name: str  # the host it admits
    secret_hash: str  # SHA-256 of the secret, lower-case hex
    created_at: float  # wall-clock seconds
    expires_at: float  # wall-clock seconds; good strictly before this instant
    used_at: float | None = None  # set once, when a host joined with it


class JoinFile(Strict, kw_only=True, frozen=True):
    """What ``capyctl invite host`` writes for one GPU machine (0600): everything it needs to join.

    Decoded strictly: an unknown field, a missing one or a value of the wrong
    form is refused, naming the field (``decode_join_file`` adds what to do).
    """

    version: Literal[1] = JOIN_FILE_VERSION
    host: Annotated[str, msgspec.Meta(pattern=f"^{HOST_NAME.pattern}$")]
    server: Annotated[str, msgspec.Meta(pattern=r"^\S+:[0-9]{1,5}$")]  # the control address, host:port
    ca_pem: Annotated[str, msgspec.Meta(pattern=r"^-----BEGIN CERTIFICATE-----")]  # the CA to pin
    secret: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{22,}$")]  # url-safe base64, no padding
    expires_at: float  # wall-clock seconds, for the operator to read


def check_host_name(name: object) -> str:
    """``name`` when it may name a host; InvalidRequest saying what a host name may be otherwise."""
    if not isinstance(name, str) or not HOST_NAME.fullmatch(name):
        raise InvalidRequest(f"a host name must be {_HOST_RULE}; got {name!r}", param="name")
    if name == RESERVED_NAME:
        raise InvalidRequest(
            f"{RESERVED_NAME!r} names the server's own certificate; pick another host name", param="name"
        )
    return name


def secret_hash(secret: bytes) -> str:
    """The SHA-256 of ``secret`` in lower-case hex: all the server keeps of an invitation's secret."""
    return hashlib.sha256(secret).hexdigest()


def invite_for(name: str, secret: bytes, now: float, ttl: float = DEFAULT_TTL) -> Invite:
    """A fresh invitation for host ``name`` with ``secret``, good from ``now`` for ``ttl`` seconds."""
    check_host_name(name)
    if not 0 < ttl <= MAX_TTL:  # also refuses NaN
        raise InvalidRequest(
            f"an invitation lasts more than 0 s and at most {MAX_TTL:g} s (1 h); got {ttl:g} s", param="ttl_s"
        )
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidRequest(
            f"an invitation's secret must be at least {MIN_SECRET_BYTES} bytes (128 bits); got {len(secret)}",
            param="secret",
        )
    return Invite(name=name, secret_hash=secret_hash(secret), created_at=now, expires_at=now + ttl)


_NO_INVITE = secret_hash(b"no invitation has this secret")


def redeem(invite: Invite | None, name: str, secret: bytes, now: float) -> Invite:
    """``invite`` marked used by host ``name`` at ``now``, or ``JoinRefused`` saying why it cannot be.

    ``invite`` is what the server found under the secret's hash (None: nothing).
    The checks run in this order: the secret (unknown or forged), the host's
    name, whether it was used, whether it expired.
    """
    expected = invite.secret_hash if invite is not None else _NO_INVITE
    same = hmac.compare_digest(secret_hash(secret).encode(), expected.encode())
    if invite is None or not same:
        raise JoinRefused(
            "unknown_secret",
            "the join file's secret matches no invitation of this server (it was "
            f"mistyped, forged, or made by another server); {_ASK_AGAIN.format(name=name)}",
            host=name,
        )
    if invite.name != name:
        raise JoinRefused(
            "wrong_host",
            f"this invitation is for host {invite.name!r}, not {name!r}; join with "
            f"the join file's own host name, or {_ASK_AGAIN.format(name=name)}",
            host=name,
        )
    if invite.used_at is not None:
        raise JoinRefused(
            "used",
            f"this invitation was already used (a host joined as {name!r} with it); "
            f"each works once: {_ASK_AGAIN.format(name=name)}",
            host=name,
        )
    if now >= invite.expires_at:
        raise JoinRefused(
            "expired",
            f"this invitation expired {now - invite.expires_at:.0f} s ago; {_ASK_AGAIN.format(name=name)}",
            host=name,
        )
    return msgspec.structs.replace(invite, used_at=now)


def secret_text(secret: bytes) -> str:
    """``secret`` as the join file holds it: url-safe base64 without padding."""
    return base64.urlsafe_b64encode(secret).rstrip(b"=").decode()


def secret_bytes(text: str) -> bytes:
    """The secret a join file's ``secret`` holds; InvalidRequest when it is not url-safe base64."""
    try:
        if not _URLSAFE.fullmatch(text):  # b64decode would also take '+' and '/'
            raise ValueError(text)
        return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest("the join secret is not url-safe base64", param="secret") from exc


_join_file = msgspec.json.Decoder(JoinFile)


def decode_join_file(data: bytes) -> JoinFile:
    """A join file from its bytes; InvalidConfig naming what is wrong when they are not one."""
    try:
        return _join_file.decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidConfig(
            f"not a CapyCTL join file of version {JOIN_FILE_VERSION}: {exc}; "
            "use the file `capyctl invite host NAME` wrote, unedited"
        ) from exc
    except msgspec.DecodeError as exc:
        raise InvalidConfig(f"not a CapyCTL join file (not JSON): {exc}") from exc
