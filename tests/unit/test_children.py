"""Engine child processes: started with no Python between fork and exec, dying with CapyCTL, logs pruned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from capyctl.adapters.process import children
from capyctl.adapters.process.children import PopenProcessControl, prune_logs
from tests.integration.harness import pid_alive


async def test_no_python_runs_in_the_child_between_fork_and_exec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict = {}
    real = subprocess.Popen

    def spy(args, **kwargs):
        seen.update(kwargs, args=args)
        return real(args, **kwargs)

    monkeypatch.setattr(children.subprocess, "Popen", spy)
    process = await PopenProcessControl().spawn(["sh", "-c", "echo $$"], tmp_path / "a.log", None)
    with anyio.fail_after(5):
        while process.returncode() is None:
            await anyio.sleep(0.01)
    assert "preexec_fn" not in seen or seen["preexec_fn"] is None
    assert seen["start_new_session"] is True
    # the launcher execs the engine in its place: the PID CapyCTL holds is the engine's own
    assert (tmp_path / "a.log").read_text().strip() == str(process.pid)
    assert process.returncode() == 0


async def test_an_engine_that_cannot_be_run_says_so_in_its_log(tmp_path: Path) -> None:
    process = await PopenProcessControl().spawn([str(tmp_path / "no-such-engine")], tmp_path / "b.log", None)
    with anyio.fail_after(5):
        while process.returncode() is None:
            await anyio.sleep(0.01)
    assert process.returncode() != 0
    assert "could not run" in (tmp_path / "b.log").read_text() and "no-such-engine" in (tmp_path / "b.log").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_an_engine_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A parent (standing in for CapyCTL) starts a long sleep through PopenProcessControl, then is SIGKILLed."""
    pid_file = tmp_path / "pid"
    script = (
        "import anyio, sys\n"
        "from pathlib import Path\n"
        "from capyctl.adapters.process.children import PopenProcessControl\n"
        "async def main():\n"
        f"    p = await PopenProcessControl().spawn(['sleep', '300'], Path({str(tmp_path / 'c.log')!r}), None)\n"
        f"    Path({str(pid_file)!r}).write_text(str(p.pid))\n"
        "    await anyio.sleep(300)\n"
        "anyio.run(main)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        engine = int(pid_file.read_text())
        while time.monotonic() < deadline and "sleep" not in Path(f"/proc/{engine}/cmdline").read_bytes().decode():
            time.sleep(0.02)  # until the launcher has exec'd the engine
        assert pid_alive(engine)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while pid_alive(engine) and time.monotonic() < deadline:
        time.sleep(0.02)
    alive = pid_alive(engine)
    if alive:
        os.kill(engine, signal.SIGKILL)
    assert not alive, "the engine outlived the process that started it"


def test_only_the_newest_launch_logs_are_kept(tmp_path: Path) -> None:
    for n in range(15):
        path = tmp_path / f"{1000 + n}-{n}.log"
        path.write_text(str(n))
        os.utime(path, ns=(n * 10**9, n * 10**9))
    (tmp_path / "notes.txt").write_text("not a launch log")
    prune_logs(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.glob("*.log")) == [f"{1000 + n}-{n}.log" for n in range(11, 15)]
    assert (tmp_path / "notes.txt").exists()


async def test_a_launch_keeps_the_folder_within_its_log_count(tmp_path: Path) -> None:
    control = PopenProcessControl(keep_logs=3)
    for n in range(6):
        process = await control.spawn(["true"], tmp_path / f"{n}.log", None)
        with anyio.fail_after(5):
            while process.returncode() is None:
                await anyio.sleep(0.01)
        os.utime(tmp_path / f"{n}.log", ns=(n * 10**9, n * 10**9))
    assert sorted(p.name for p in tmp_path.glob("*.log")) == ["3.log", "4.log", "5.log"]


async def test_engine_environment_changes_reach_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real child process: variables the adapter sets are there, the ones it removes are gone."""
    monkeypatch.setenv("LLAMA_ARG_API_KEY", "leaked")
    monkeypatch.setenv("KEEP_ME", "kept")
    log = tmp_path / "env.log"
    process = await PopenProcessControl().spawn(
        ["sh", "-c", 'echo "key=${LLAMA_ARG_API_KEY-unset} keep=$KEEP_ME new=$NEW"'],
        log,
        {"LLAMA_ARG_API_KEY": None, "NEW": "1"},
    )
    with anyio.fail_after(5):
        while process.returncode() is None:
            await anyio.sleep(0.01)
    assert log.read_text().strip() == "key=unset keep=kept new=1"
