"""The ``capyctl`` command: ``capyctl <action> <resource> [name] [options]``.

``start standalone`` runs the server in the foreground; every other command
talks to that server's management API, found through the state directory.
Each module below registers its commands on the apps of ``common``.
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
