"""llama.cpp's ``llama-server``.

Registered by the path of its binary; the version comes from
``llama-server --version`` (``version: 0.6.0-dev (build 0, commit unknown)``
reads as 0.6.0; a build-numbered ``version: 6123 (abcdef)`` reads as b6123).
Ready when ``GET /health`` answers 200 (503 while the model loads). Running
and waiting counts come from ``/metrics`` (``--metrics`` is forced):
``llamacpp:requests_processing`` and ``llamacpp:requests_deferred``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from capyctl.adapters.engines import _prom
from capyctl.adapters.engines._capabilities import RestartOnly
from capyctl.adapters.engines._http import EngineClient, fetch_json, fetch_ok
from capyctl.domain.deployments import DeploymentSpec
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import InvalidEngine
from capyctl.domain.ports import EngineAdapter, EngineLoad

_SEMVER = re.compile(r"version:\s*v?(\d+\.\d+\.\d+)")
_BUILD = re.compile(r"version:\s*b?(\d+)\b")
_RUNNING, _WAITING = "llamacpp:requests_processing", "llamacpp:requests_deferred"


def parse_version(text: str) -> str:
    if match := _SEMVER.search(text):
        return match.group(1)
    if match := _BUILD.search(text):
        return "b" + match.group(1)
    raise InvalidEngine(f"could not read a llama.cpp version from: {text.strip()[:200]!r}")


class LlamaCppEngine(RestartOnly, EngineAdapter):
    family = EngineFamily.LLAMACPP
    owned_env: tuple[str, ...] = ("LLAMA_ARG_",)
    owned_options = {
        "-m": "the model file, from the deployment's model",
        "--model": "the model file, from the deployment's model",
        "--host": "the listen address, always 127.0.0.1",
        "--port": "the port CapyCTL picks",
        "--metrics": "the metrics endpoint CapyCTL reads",
        "--no-metrics": "the metrics endpoint CapyCTL reads",
        "--api-key": "engine authentication; CapyCTL is the only client",
        "--api-key-file": "engine authentication; CapyCTL is the only client",
        "-c": "use engine_config.context_length",
        "--ctx-size": "use engine_config.context_length",
    }

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def recognises(self, path: Path) -> bool:
        return path.is_file()

    def environment(self, engine: EngineInstall, spec: DeploymentSpec) -> dict[str, str | None]:
        # llama-server reads LLAMA_ARG_<OPTION> variables: inherited ones must not override CapyCTL's flags
        return {name: None for name in os.environ if name.startswith("LLAMA_ARG_")}

    async def probe_version(self, base_url: str) -> str | None:
        """llama.cpp's /props carries ``build_info`` (e.g. ``b0-unknown``); only a real build number helps."""
        props = await fetch_json(self._client, base_url + "/props")
        build = str(props.get("build_info", "")) if props is not None else ""
        match = re.match(r"b(\d+)", build)
        return f"b{match.group(1)}" if match and match.group(1) != "0" else None

    def probe(self, path: Path) -> tuple[str, str]:
        if not path.is_file():
            raise InvalidEngine(f"{path} is not a file: give the path of the llama-server binary")
        try:
            done = subprocess.run([str(path), "--version"], capture_output=True, timeout=30, check=False)
        except OSError as exc:
            raise InvalidEngine(f"could not run {path} --version: {exc}") from exc
        except subprocess.TimeoutExpired as exc:
            raise InvalidEngine(f"{path} --version did not answer within 30 s") from exc
        text = (done.stdout + done.stderr).decode("utf-8", "replace")
        if done.returncode != 0:
            raise InvalidEngine(f"{path} --version exited with {done.returncode}: {text.strip()[:300]}")
        return parse_version(text), text.strip()

    def command(self, engine: EngineInstall, spec: DeploymentSpec, port: int) -> list[str]:
        # No --alias: the engine names the model after its file, and the relay
        # rewrites `model` to the deployment's name on every chunk.
        argv = [engine.path, "-m", str(spec.model)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--metrics"]
        if spec.engine_config.context_length is not None:
            argv += ["-c", str(spec.engine_config.context_length)]
        return argv + list(spec.engine_config.extra_args)

    async def ready(self, base_url: str) -> bool:
        return await fetch_ok(self._client, base_url + "/health") is not None

    async def load(self, base_url: str) -> EngineLoad | None:
        metrics = await fetch_ok(self._client, base_url + "/metrics")
        return None if metrics is None else _prom.running_waiting(metrics, [_RUNNING], [_WAITING])

    def serves_decisions(self, engine: EngineInstall) -> bool:
        """Only some builds have ``POST /v1/systemone``: the route's path is in the server's code when they do,
        in the binary or in a library beside it (``libllama-server-impl.so`` in some packagings)."""
        binary = Path(engine.path)
        for path in (binary, *sorted(binary.parent.glob("*.so*"))):
            try:
                if path.is_file() and b"/v1/systemone" in path.read_bytes():
                    return True
            except OSError:
                continue
        return False
