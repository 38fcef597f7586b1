"""Engine child processes.

Each engine runs in its own session and process group, so one signal reaches
everything it forked. It is stopped with SIGTERM to the group, then SIGKILL
after a grace period. Exit is observed by polling ``returncode`` (never a
blocking wait).

No engine outlives CapyCTL: on Linux, the kernel's parent-death signal
SIGTERMs an engine whose CapyCTL died without stopping it. Setting it must
not run Python or load a library between fork and exec (in a threaded
parent that can deadlock on a lock another thread held at fork time), so
the child execs a tiny separate Python first (``_DIE_WITH_PARENT``): a fresh
single-threaded process that sets the signal, checks that CapyCTL did not
die in between, and execs the engine in its place (same PID). The signal
follows the thread that started the child, which is the event loop's, alive
as long as CapyCTL.

Each launch has its own log file; a deployment's folder keeps the newest
``keep_logs`` of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from capyctl.domain.ports import ProcessControl, ProcessHandle

_POLL = 0.02
KEEP_LOGS = 10
# argv: python -I -S -c _DIE_WITH_PARENT <parent pid> <engine argv...>
_DIE_WITH_PARENT = (
    "import ctypes,os,sys\n"
    "libc=ctypes.CDLL(None,use_errno=True)\n"
    "if libc.prctl(1,15,0,0,0)!=0:sys.exit('capyctl: prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid()!=int(sys.argv[1]):sys.exit('capyctl: CapyCTL exited before the engine started')\n"
    "try:os.execvp(sys.argv[2],sys.argv[2:])\n"
    "except OSError as e:sys.exit(f'capyctl: could not run {sys.argv[2]}: {e}')\n"
)


def launcher(argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` so that it dies with CapyCTL (Linux), else ``argv`` itself."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def prune_logs(folder: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest launch logs in one deployment's folder."""
    logs = sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime_ns)
    for old in logs[: max(len(logs) - keep, 0)]:
        old.unlink(missing_ok=True)


class PopenProcessHandle(ProcessHandle):
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process
        self.pid = process.pid

    def returncode(self) -> int | None:
        return self._process.poll()

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)

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
    def __init__(self, keep_logs: int = KEEP_LOGS) -> None:
        self._keep_logs = keep_logs

    async def spawn(self, argv: Sequence[str], log_path: Path, env: dict[str, str | None] | None) -> ProcessHandle:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        prune_logs(log_path.parent, self._keep_logs - 1)  # room for this launch's
        environment = dict(os.environ)
        for name, value in (env or {}).items():
            if value is None:
                environment.pop(name, None)
            else:
                environment[name] = value
        with open(log_path, "ab") as log:
            process = subprocess.Popen(  # argv comes from the engine adapter
                launcher(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,  # setsid() in the child, done by the C fork code: no Python runs there
                close_fds=True,
            )
        return PopenProcessHandle(process)
