"""How long the ``capyctl`` command takes as a whole process, start to exit: ``capyctl list hosts`` (the table and
``--json``) against a real server with ``--hosts`` hosts, ``capyctl --help``, and ``python -c pass`` beside them.

    .venv/bin/python bench/cli_start.py [--hosts 1000] [--runs 10] [--baseline OTHER_TREE/src]

The server is ``capyctl start server`` and the hosts are simulated as ``bench/fleet_idle.py`` does it (each one
invited, joined with CapyCTL's own ``join`` and linked by CapyCTL's own ``HostAgent``, heartbeating), in this
process. Once every host reads ``online``, each command is run ``--runs`` times by the ``capyctl`` script beside
this Python, and each figure is printed on one line: median, min and max of the whole process's wall time.
With ``--baseline``, the same commands are run with that tree's ``src`` first on ``PYTHONPATH`` (the code before a
change), alternating run by run with this tree's, against the same server.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fleet_idle import simulate, start_server  # noqa: E402

COMMANDS: dict[str, list[str]] = {
    "capyctl --help": ["--help"],
    "capyctl list hosts": ["list", "hosts"],
    "capyctl list hosts --json": ["list", "hosts", "--json"],
}


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, bytes]:
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, env=env)
    took = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-2000:]}")
    return took, done.stdout


def figure(name: str, times: list[float]) -> str:
    ms = [t * 1000 for t in times]
    return f"{name}: median {statistics.median(ms):.1f} ms, min {min(ms):.1f}, max {max(ms):.1f} ({len(ms)} runs)"


def measure(state: Path, hosts: int, runs: int, baseline: Path | None) -> list[str]:
    """The figures' lines, every command timed ``runs`` times per tree, the trees alternating."""
    capyctl = str(Path(sys.executable).parent / "capyctl")
    env = {**os.environ, "CAPYCTL_STATE_DIR": str(state)}
    env.pop("PYTHONPATH", None)
    trees: dict[str, dict[str, str]] = {"": env}
    if baseline is not None:
        trees = {"baseline ": {**env, "PYTHONPATH": str(baseline)}, "": env}
    times: dict[str, list[float]] = {}
    for tree_env in trees.values():  # one run each first, unmeasured: the files are in the page cache
        timed([sys.executable, "-c", "pass"], tree_env)
        for args in COMMANDS.values():
            timed([capyctl, *args], tree_env)
    for _ in range(runs):
        times.setdefault("python -c pass", []).append(timed([sys.executable, "-c", "pass"], env)[0])
        for label, tree_env in trees.items():
            for name, args in COMMANDS.items():
                took, out = timed([capyctl, *args], tree_env)
                times.setdefault(label + name, []).append(took)
                if args[-1] == "--json":
                    assert out.count(b'"name": "sim-') == hosts, "the JSON lists every host"
                elif args[0] == "list":
                    assert out.count(b"\nsim-") == hosts, "the table has a row for every host"
    return [figure(name, taken) for name, taken in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--baseline", type=Path, help="another tree's src directory, timed alternately with this one")
    args = parser.parse_args()
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="capyctl-cli-") as tmp:
        root = Path(tmp)
        process, client, control = start_server(root / "server")
        try:

            async def run() -> None:
                ready = anyio.Event()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(simulate, client, args.hosts, control, root / "hosts", ready)
                    await ready.wait()
                    while True:
                        listed = await anyio.to_thread.run_sync(client.get, "/hosts")
                        if [h["state"] for h in listed.json()].count("online") == args.hosts:
                            break
                        await anyio.sleep(0.5)
                    await anyio.sleep(3)  # what linking stirred up settles
                    cpu0, wall0 = time.process_time(), time.monotonic()
                    lines.extend(
                        await anyio.to_thread.run_sync(measure, root / "server", args.hosts, args.runs, args.baseline)
                    )
                    lines.append(
                        f"the simulated hosts (this process) while timing: "
                        f"{(time.process_time() - cpu0) / (time.monotonic() - wall0) * 100:.1f} % of one core"
                    )
                    tg.cancel_scope.cancel()

            anyio.run(run)
        finally:
            process.terminate()
            process.wait(30)
    trio = "installed" if importlib.util.find_spec("trio") else "not installed"
    print(
        f"{args.hosts} hosts linked to a real server (capyctl start server); {os.cpu_count()} CPUs; trio {trio} "
        "(httpcore, under httpx, imports it when it is: the test extras install it, requirements.lock does not)"
    )
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
