"""The ``capyctl`` command: ``capyctl <action> <resource> [name] [options]``.

``start standalone`` runs the server in the foreground; every other command
talks to that server's management API, found through the state directory.
Each module below registers its commands on the apps of ``common``.

Every command pays for what these modules import, so they import at their top only what registering the
commands needs (typer, the state directory, the errors, the output helpers); the rest (YAML,
cryptography, the server) is imported by the commands that use it, when they run.
``tests/unit/test_cli_start.py`` holds this; ``bench/cli_start.py`` times it.
"""

from capyctl.entrypoints.cli import (  # noqa: F401 - they register the commands
    dashboard,  # capyctl dashboard
    deployments,
    engines,
    hosts,  # several machines
    keys,
    requests,
    server,
)
from capyctl.entrypoints.cli.common import app


def main() -> None:
    app()
