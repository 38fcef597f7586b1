"""The ``capyctl`` command: ``capyctl <action> <resource> [name] [options]``.

``start standalone`` runs the server in the foreground; every other command
talks to that server's management API, found through the state directory.
Each module below registers its commands on the apps of ``common``.
"""

from capyctl.entrypoints.cli import deployments, engines, keys, requests, server  # noqa: F401 - they register the commands
from capyctl.entrypoints.cli import dashboard  # noqa: F401 - capyctl dashboard
from capyctl.entrypoints.cli import hosts  # noqa: F401 - several machines
from capyctl.entrypoints.cli.common import app


def main() -> None:
    app()
