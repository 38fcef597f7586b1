"""The server configuration file and default_model, through a real CapyCTL and its CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.fakes.broken_engine import BrokenEngine
from tests.integration.harness import CapyServer

pytestmark = pytest.mark.integration


def attach(server: CapyServer, tmp: Path, engine: BrokenEngine, name: str) -> None:
    doc = {"name": name, "engine": "vllm", "endpoint": engine.url, "engine_version": "0.32.0"}
    (tmp / f"{name}.yaml").write_bytes(msgspec.yaml.encode(doc))
    server.cli("deploy", "model", "--file", str(tmp / f"{name}.yaml"))


def chat(server: CapyServer, **body: object) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/chat/completions",
        headers=server.headers(),
        timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], **body},
    )


def test_default_model_from_the_state_dirs_config_serves_requests_without_model(
    tmp_path: Path, engine: BrokenEngine
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "config.yaml").write_text("default_model: helper\n")  # found without --config
    server = CapyServer(state).start()
    try:
        attach(server, tmp_path, engine, "helper")
        attach(server, tmp_path, engine, "other")
        whole = chat(server)
        assert whole.status_code == 200 and whole.json()["model"] == "helper"
        assert whole.json()["choices"][0]["message"]["content"] == "Hello there!"
        stream = chat(server, stream=True)
        assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
        events = [msgspec.json.decode(e[6:]) for e in stream.text.split("\n\n") if e.startswith("data: {")]
        assert events and all(e["model"] == "helper" for e in events)
        assert chat(server, model="other").json()["model"] == "other"  # a named model still wins
        assert chat(server, model=None).json()["model"] == "helper"  # null counts as absent
    finally:
        server.stop()


def test_without_a_default_model_a_request_without_model_is_refused(tmp_path: Path, engine: BrokenEngine) -> None:
    server = CapyServer(tmp_path / "state").start()
    try:
        attach(server, tmp_path, engine, "only")
        for stream in (False, True):
            r = chat(server, stream=stream)
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["code"] == "invalid_request" and error["param"] == "model"
            assert "default_model" in error["message"]
    finally:
        server.stop()


def test_flags_win_over_the_file(tmp_path: Path, engine: BrokenEngine) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("queue:\n  request_deadline: 1h\n")
    server = CapyServer(tmp_path / "state", "--config", str(config), "--request-deadline", "1s").start()
    try:
        attach(server, tmp_path, engine, "slow")
        r = chat(server, model="slow", broken_case="hold_headers")  # an engine that never answers
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    finally:
        server.stop()


def capyctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capyctl", *args], capture_output=True, text=True, timeout=60)


def test_a_bad_file_stops_the_server_before_it_starts_with_the_line(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("queue:\n  request_deadline: 90s\n  max_pending: 3\n")
    done = capyctl(
        "start",
        "standalone",
        "--config",
        str(config),
        "--state-dir",
        str(tmp_path / "s"),
        "--listen",
        "127.0.0.1:0",
        "--management",
        "127.0.0.1:0",
    )
    assert done.returncode == 6
    assert f"error [invalid_config]: {config}: line 3: Object contains unknown field `max_pending`" in done.stderr


def test_devices_auto_without_a_gpu_stops_the_server_and_says_what_to_do(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("memory:\n  devices: auto\n")
    empty = tmp_path / "bin"
    empty.mkdir()  # a PATH with no nvidia-smi
    # and an NVML whose driver library is missing, as on a machine without a GPU, whatever this one has
    (tmp_path / "nvml").mkdir()
    (tmp_path / "nvml" / "pynvml.py").write_text(
        "class NVMLError(Exception):\n    pass\n\n\n"
        "def nvmlInit():\n    raise NVMLError('NVML Shared Library Not Found')\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "capyctl",
            "start",
            "standalone",
            "--config",
            str(config),
            "--state-dir",
            str(tmp_path / "s"),
            "--listen",
            "127.0.0.1:0",
            "--management",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(empty), "PYTHONPATH": str(tmp_path / "nvml")},
    )
    assert "NVML did not load (NVML Shared Library Not Found)" in done.stderr
    assert done.returncode == 6
    assert "error [invalid_config]: memory.devices: auto found no GPU" in done.stderr
    assert "declare the devices in the file" in done.stderr


def test_config_check_and_schema(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("default_model: smollm2\nlimits:\n  max_body: 1MiB\n")
    done = capyctl("config", "check", str(good), "--json")
    assert done.returncode == 0
    view = msgspec.json.decode(done.stdout)
    assert view["default_model"] == "smollm2" and view["limits"]["max_body_bytes"] == 1 << 20
    bad = tmp_path / "bad.yaml"
    bad.write_text("limits:\n  max_body: 1MiB\n  max_body: 2MiB\n")
    done = capyctl("config", "check", str(bad), "--json")
    assert done.returncode == 6
    assert msgspec.json.decode(done.stdout) == {
        "error": {"code": "invalid_config", "message": f"{bad}: duplicate key 'max_body' on line 3"}
    }
    done = capyctl("config", "schema")
    assert (
        done.returncode == 0
        and "request_deadline" in msgspec.json.decode(done.stdout)["$defs"]["QueueConfig"]["properties"]
    )


def test_config_check_takes_a_zero_reserve_and_says_what_a_refused_size_or_duration_may_be(tmp_path: Path) -> None:
    zero = tmp_path / "zero.yaml"
    zero.write_text(
        "memory:\n  devices:\n    - name: gpu0\n      capacity: 8GiB\n      reserve: 0GiB\n"
        "switching:\n  admission_window: 0s\n"
    )
    done = capyctl("config", "check", str(zero), "--json")
    assert done.returncode == 0, done.stderr
    assert msgspec.json.decode(done.stdout)["memory"]["devices"] == [
        {"name": "gpu0", "capacity_bytes": 8 << 30, "reserve_bytes": 0}
    ]
    done = capyctl("config", "check", str(zero))
    assert done.returncode == 0 and "memory.devices.gpu0  capacity_bytes 8589934592  reserve_bytes 0" in done.stdout
    for text, says in (
        (
            "memory:\n  devices:\n    - {name: gpu0, capacity: 0GiB}\n",
            "line 3: Expected a size more than zero such as 64KiB, 4MiB or 6GiB, "
            "with a unit of B, KiB, MiB, GiB, TiB, KB, MB, GB or TB (none: bytes)",
        ),
        (
            "memory:\n  devices:\n    - {name: gpu0, capacity: 8GiB, reserve: lots}\n",
            "line 3: Expected a size of zero or more such as 0GiB, 512MiB or 2GiB, with a unit of B, KiB",
        ),
        (
            "queue:\n  request_deadline: 0s\n",
            "line 2: Expected a duration more than zero such as 90s, 10m or 1h, "
            "with a unit of ms, s, m or h (none: seconds)",
        ),
        ("limits:\n  max_body: 0\n", "limits.max_body: 0 is not a size more than zero such as 64KiB"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        done = capyctl("config", "check", str(bad))
        assert done.returncode == 6
        assert done.stderr.startswith(f"error [invalid_config]: {bad}: ") and says in done.stderr, done.stderr


def test_json_commands_report_failures_as_json(tmp_path: Path) -> None:
    done = capyctl("list", "deployments", "--json", "--state-dir", str(tmp_path / "nothing"))
    assert done.returncode == 3
    error = msgspec.json.decode(done.stdout)["error"]
    assert error["code"] == "server_not_running" and error["message"]
