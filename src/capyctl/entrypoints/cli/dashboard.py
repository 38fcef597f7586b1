"""``capyctl dashboard``: a one-time sign-in link to the web dashboard (through the management API)."""

from __future__ import annotations

import sys

from capyctl.entrypoints.cli.common import JsonOpt, StateDirOpt, app, client, reports_errors
from capyctl.entrypoints.cli.output import print_json


@app.command("dashboard")
@reports_errors
def dashboard(state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """Print a sign-in link to the web dashboard: it works once, within 60 seconds.

    The link alone goes to stdout (one line), so `xdg-open "$(capyctl dashboard)"` opens it; the rest goes
    to stderr. The dashboard is served on the management listener (127.0.0.1:7443 by default).
    """
    link = client(state_dir).call("POST", "/ui/sign-ins")
    if json:
        print_json(link)
        return
    sys.stdout.write(link["url"] + "\n")
    sys.stderr.write(f"open it within {link['expires_in_s']} s; it signs in one browser, once\n")
