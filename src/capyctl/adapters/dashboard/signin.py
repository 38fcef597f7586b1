"""Signing in and out: the one-time link (``capyctl dashboard``), the admin token, sign-out."""

from __future__ import annotations

import hmac
from typing import Any

from litestar import Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Redirect

from capyctl.adapters.dashboard.sessions import admin_token_ok
from capyctl.adapters.dashboard.web import COOKIE, NO_STORE, SignInRefused, checked, dash, html, log
from capyctl.domain.errors import Unauthorized


# --- sign-in ------------------------------------------------------------------------------------------
def require_admin(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """The management API's own check (``Authorization: Bearer <admin token>``, constant time)."""
    token: str = connection.app.state.admin_token
    given = connection.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {token}".encode()):
        raise Unauthorized()


@post("/ui/sign-ins", guards=[require_admin], status_code=201, sync_to_thread=False)
def issue_sign_in(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """For ``capyctl dashboard`` (admin token): a sign-in link good once, for a minute."""
    parts = dash(request)
    return {"url": f"{parts.base_url}/ui/sign-in/{parts.signins.issue()}", "expires_in_s": 60}


def _signed_in(request: Request[Any, Any, Any], how: str) -> Response[str]:
    session_id, session = dash(request).sessions.open(how)
    log.info("dashboard session %s opened (%s)", session.label, how)
    return Redirect(
        "/ui/",
        status_code=303,
        headers=NO_STORE,
        cookies=[Cookie(key=COOKIE, value=session_id, path="/", httponly=True, samesite="strict", secure=False)],
    )


@get("/ui/sign-in", sync_to_thread=False)
def sign_in_page(request: Request[Any, Any, Any]) -> Response[str]:
    return html(request, "signin.html", page="sign in", session=None, live=None, message=None)


@post("/ui/sign-in", status_code=303)
async def sign_in_with_token(request: Request[Any, Any, Any]) -> Response[str]:
    form = await request.form()
    token = form.get("token")
    if isinstance(token, str) and admin_token_ok(token, dash(request).admin_token):
        return _signed_in(request, "admin token")
    raise SignInRefused("that is not this server's admin token (API keys do not sign in)")


@get("/ui/sign-in/{token:str}", sync_to_thread=False)
def sign_in_with_link(request: Request[Any, Any, Any], token: str) -> Response[str]:
    if dash(request).signins.redeem(token):
        return _signed_in(request, "one-time link")
    raise SignInRefused(
        "this sign-in link was used already or has expired (a link works once, for 60 s): "
        "run `capyctl dashboard` again for a new one"
    )


@post("/ui/sign-out", status_code=303)
async def sign_out(request: Request[Any, Any, Any]) -> Response[str]:
    session, _ = await checked(request)
    dash(request).sessions.close(request.cookies.get(COOKIE))
    log.info("dashboard session %s closed", session.label)
    response: Response[str] = Redirect("/ui/sign-in", status_code=303, headers=NO_STORE)
    response.delete_cookie(COOKIE, path="/")
    return response
