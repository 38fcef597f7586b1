"""The files of ``src/`` a streamed chat request runs code in, from the client's socket to the engine's and back.

    python bench/request_path.py [--stream | --no-stream] [--json]

Starts the replay engine and a CapyCTL with it attached (as the integration tests do), sends a few
requests to warm it, then records which of CapyCTL's source files have a function called while one more
request is served: the server turns Python's profiler on at SIGUSR1 and writes what it saw at SIGUSR2
(``bench/trace_site/sitecustomize.py``, loaded only by this script). Files whose code merely defines a
type the path uses, without a function of theirs being called, are not counted. Prints each file with its
line count (and with ``--functions`` the functions called in it), and the total; ``docs/development.md``
lists the same path room by room.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.harness import replay_behind_capyctl  # noqa: E402

RECORDING = ROOT / "tests" / "contract" / "recordings" / "vllm" / "0.32.0"
SRC = ROOT / "src" / "capyctl"


def _ask(base_url: str, key: str, stream: bool) -> None:
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    with httpx.Client(timeout=30) as client:
        answer = client.post(base_url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
    answer.raise_for_status()
    if stream and not answer.text.rstrip().endswith("data: [DONE]"):
        raise SystemExit(f"the stream did not end with [DONE]:\n{answer.text[-500:]}")


def _until(path: Path, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"the server's tracer did not write {path} in {timeout} s")
        time.sleep(0.02)


def trace(stream: bool) -> dict[str, list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "files.json"
        os.environ["CAPYCTL_TRACE_FILES"] = str(out)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "bench" / "trace_site"), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        with replay_behind_capyctl(Path(tmp), RECORDING, "--default-case", "chat_stream_eos_stop") as capy:
            for _ in range(3):
                _ask(capy.base_url, capy.api_key, stream)
            assert capy.process is not None
            capy.process.send_signal(signal.SIGUSR1)
            _until(Path(str(out) + ".on"))
            _ask(capy.base_url, capy.api_key, stream)
            capy.process.send_signal(signal.SIGUSR2)
            _until(out)
            seen = json.loads(out.read_text())
    calls: dict[str, list[str]] = {}
    for entry in seen:
        path, _, function = entry.rpartition(":")
        if Path(path).resolve().is_relative_to(SRC):
            calls.setdefault(str(Path(path).resolve().relative_to(SRC)), []).append(function)
    return dict(sorted(calls.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trace a streamed request (default) or a non-streamed one",
    )
    parser.add_argument("--json", action="store_true", help="print the files and their functions called as JSON")
    parser.add_argument("--functions", action="store_true", help="name the functions called in each file")
    args = parser.parse_args()
    files = trace(args.stream)
    if args.json:
        print(json.dumps(files))
        return
    total = 0
    for name in files:
        lines = len((SRC / name).read_text().splitlines())
        total += lines
        print(f"{lines:6} src/capyctl/{name}")
        if args.functions:
            print("         " + ", ".join(sorted(files[name])))
    print(f"{len(files)} files, {total} lines")


if __name__ == "__main__":
    main()
