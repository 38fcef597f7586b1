"""Engine child processes.

Each engine runs in its own session and process group, so one signal reaches
everything it forked. It is stopped with SIGTERM to the group, then SIGKILL
after a grace period. Linux's parent-death signal makes the kernel SIGTERM an
engine if CapyCTL itself dies without stopping it, so no engine outlives
CapyCTL. Exit is observed by polling ``returncode`` (never a blocking wait).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from capyctl.domain.ports import ProcessControl, ProcessHandle

_POLL = 0.02


def _die_with_parent() -> None:  # runs in the child, between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class PopenProcessHandle(ProcessHandle):
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process
        self.pid = process.pid

    def returncode(self) -> int | None:
        return self._process.poll()

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    async def terminate(self, grace: float) -> int:
        if self._process.poll() is None:
            self._signal_group(signal.SIGTERM)
            with anyio.move_on_after(grace):
                while self._process.poll() is None:
                    await anyio.sleep(_POLL)
        if self._process.poll() is None:
            self._signal_group(signal.SIGKILL)
            while self._process.poll() is None:
                await anyio.sleep(_POLL)
        else:  # the leader is gone; make sure nothing it forked lingers
            self._signal_group(signal.SIGKILL)
        return self._process.returncode


class PopenProcessControl(ProcessControl):
    async def spawn(self, argv: Sequence[str], log_path: Path, env: dict[str, str | None] | None) -> ProcessHandle:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        environment = dict(os.environ)
        for name, value in (env or {}).items():
            if value is None:
                environment.pop(name, None)
            else:
                environment[name] = value
        with open(log_path, "ab") as log:
            process = subprocess.Popen(  # noqa: S603 - argv comes from the engine adapter
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl, async-signal-safe enough
            )
        return PopenProcessHandle(process)
