"""Loaded by ``bench/request_path.py`` only (through PYTHONPATH): with ``CAPYCTL_TRACE_FILES`` set, SIGUSR1
starts noting the source file of every Python function called on the main thread, and SIGUSR2 stops (once
the tasks started meanwhile are done) and writes them (``file:function``), as a JSON list, to the file that
variable names.

Calls made in a task that was already running at SIGUSR1 (the server's own loops: switching, probes) are
left out; calls in tasks started since (the request's) and in the event loop's callbacks (the sockets'
reads) are noted."""

import asyncio
import contextlib
import json
import os
import signal
import sys

_out = os.environ.get("CAPYCTL_TRACE_FILES")

if _out:
    _seen: set[str] = set()
    _before: set[object] = set()

    def _note(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            try:
                task = asyncio.current_task()
            except RuntimeError:  # no loop running
                task = None
            if task is None or task not in _before:
                code = frame.f_code
                _seen.add(f"{code.co_filename}:{code.co_qualname}")

    def _start(signum, frame):  # type: ignore[no-untyped-def]
        _seen.clear()
        _before.clear()
        with contextlib.suppress(RuntimeError):
            _before.update(asyncio.all_tasks())
        sys.setprofile(_note)
        open(_out + ".on", "w").close()  # the tracer is on: the next request is traced

    def _write() -> None:
        sys.setprofile(None)
        with open(_out + ".tmp", "w") as out:
            json.dump(sorted(_seen), out)
        os.replace(_out + ".tmp", _out)

    def _stop(signum, frame):  # type: ignore[no-untyped-def]
        """Stop once every task started since SIGUSR1 is done (the request's bookkeeping after its last byte
        included), or after 5 s."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            _write()
            return
        deadline = loop.time() + 5

        def settled() -> None:
            if loop.time() < deadline and any(not t.done() for t in asyncio.all_tasks(loop) - _before):
                loop.call_later(0.01, settled)
            else:
                _write()

        loop.call_soon(settled)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
