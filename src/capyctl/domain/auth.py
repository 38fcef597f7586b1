"""API key checks for the inference endpoint."""

from __future__ import annotations

import hmac

from capyctl.domain.errors import InvalidApiKey, MissingApiKey


def check_bearer(authorization: str | None, keys: list[str]) -> None:
    """Accept ``Bearer <key>`` for one of ``keys``; compare in constant time.

    Every key is compared, even after a match, so timing tells nothing about
    which key (or how much of one) matched.
    """
    if not authorization:
        raise MissingApiKey()
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise MissingApiKey()
    given_bytes = given.strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given_bytes, key.encode())
    if not matched:
        raise InvalidApiKey()
