"""Who may see the dashboard: one-time sign-in links, and the sessions they (or the admin token) open.

The sequence:

1. ``capyctl dashboard`` asks the management API (admin token) for a sign-in
   link: a random token, good once, for ``LINK_TTL`` seconds (``SignIns``).
2. The browser opens the link, or posts the admin token on the sign-in page;
   either opens a ``Session``: an opaque random ID that only the cookie
   carries (HttpOnly, SameSite=Strict), never the token itself.
3. Each state-changing request carries the session's CSRF token, compared in
   constant time.

Tokens and session IDs are kept only as SHA-256 digests, looked up by digest:
the dict lookup's timing says nothing about a secret, and a memory dump shows
no usable cookie. Sessions live in memory: a server restart signs everyone
out. A session ends at logout, after ``SESSION_IDLE`` seconds without a
request, or ``SESSION_MAX`` seconds after it opened; at most ``MAX_SESSIONS``
are kept (the least recently used goes first).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

from capyctl.domain.ports import Clock

LINK_TTL = 60.0  # seconds a sign-in link is good for
SESSION_IDLE = 8 * 3600.0  # seconds without a request after which a session ends
SESSION_MAX = 24 * 3600.0  # seconds after sign-in at which a session ends anyway
MAX_SESSIONS = 64
MAX_LINKS = 64  # unused links kept at most: a script asking in a loop cannot grow the table


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


@dataclass
class Session:
    label: str  # names the session in events and logs: random, unrelated to its ID
    csrf: str  # the token each form of this session carries
    opened: float  # monotonic
    seen: float  # monotonic, last request
    how: str  # "link" or "admin token"

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self.csrf.encode())


@dataclass
class SignIns:
    """One-time sign-in links: ``issue`` gives the token for the URL, ``redeem`` takes it back, once."""

    clock: Clock
    _links: dict[bytes, float] = field(default_factory=dict)  # digest -> monotonic expiry

    def issue(self) -> str:
        now = self.clock.monotonic()
        self._links = {d: until for d, until in self._links.items() if until > now}
        while len(self._links) >= MAX_LINKS:
            self._links.pop(next(iter(self._links)))  # the oldest
        token = secrets.token_urlsafe(32)
        self._links[_digest(token)] = now + LINK_TTL
        return token

    def redeem(self, token: str) -> bool:
        """True once for a link issued less than ``LINK_TTL`` seconds ago; False when used, expired or unknown."""
        until = self._links.pop(_digest(token), None)
        return until is not None and self.clock.monotonic() < until


@dataclass
class Sessions:
    clock: Clock
    _sessions: dict[bytes, Session] = field(default_factory=dict)  # digest of the ID -> session

    def open(self, how: str) -> tuple[str, Session]:
        """A new session: its ID (for the cookie, shown nowhere else) and the session."""
        now = self.clock.monotonic()
        self._prune(now)
        while len(self._sessions) >= MAX_SESSIONS:
            oldest = min(self._sessions, key=lambda d: self._sessions[d].seen)
            del self._sessions[oldest]
        session_id = secrets.token_urlsafe(32)
        session = Session(label=secrets.token_hex(4), csrf=secrets.token_urlsafe(32), opened=now, seen=now, how=how)
        self._sessions[_digest(session_id)] = session
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        """The live session of this cookie value (its last use noted), or None."""
        if not session_id:
            return None
        key = _digest(session_id)
        session = self._sessions.get(key)
        if session is None:
            return None
        now = self.clock.monotonic()
        if self._expired(session, now):
            del self._sessions[key]
            return None
        session.seen = now
        return session

    def close(self, session_id: str | None) -> None:
        if session_id:
            self._sessions.pop(_digest(session_id), None)

    def __len__(self) -> int:
        return len(self._sessions)

    def _expired(self, session: Session, now: float) -> bool:
        return now - session.seen >= SESSION_IDLE or now - session.opened >= SESSION_MAX

    def _prune(self, now: float) -> None:
        self._sessions = {d: s for d, s in self._sessions.items() if not self._expired(s, now)}


def admin_token_ok(given: str, admin_token: str) -> bool:
    """The sign-in page's check: the admin token itself, compared in constant time (an API key never matches)."""
    return hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), admin_token.encode())
