"""TensorFold 0.6.x, the Python server (``tensorfold serve``).

Registered by the directory of the virtualenv TensorFold is installed in (it
is installed from git, not from a registry); the version is that of the
``tensorfold`` distribution, read from its metadata without importing it.
Started with the virtualenv's ``bin/tensorfold serve MODEL``; ``--alias``
names the model after the deployment and ``--context`` carries
``engine_config.context_length``.

``GET /health`` answers 200 with ``{"status": "ok", ...}`` once the model
serves (only ``{"status": "ok"}`` when API keys are set; a version is read
from it when present, TensorFold has no version route). Running and waiting
counts are the ``/metrics`` gauges ``tensorfold:requests_running`` and
``tensorfold:requests_waiting`` (the same readings are also published under
vLLM-style names, ``tensorfold:num_requests_running`` ..., used when the
first are missing). Metrics exist from 0.6.0; a family TensorFold cannot count
is left out, never published as 0. No API key is set, so ``/metrics`` is open.
"""

from __future__ import annotations

from pathlib import Path

from capyctl.adapters.engines import _prom, _venv
from capyctl.adapters.engines._capabilities import DecisionsByVersion, RestartOnly
from capyctl.adapters.engines._http import EngineClient, fetch_json, fetch_ok
from capyctl.domain.deployments import DeploymentSpec
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.ports import EngineAdapter, EngineLoad

DISTRIBUTION = "tensorfold"
PROGRAM = "tensorfold"
_RUNNING = ["tensorfold:requests_running", "tensorfold:num_requests_running"]
_WAITING = ["tensorfold:requests_waiting", "tensorfold:num_requests_waiting"]


class TensorfoldEngine(DecisionsByVersion, RestartOnly, EngineAdapter):
    family = EngineFamily.TENSORFOLD
    owned_env: tuple[str, ...] = ("TENSORFOLD_API_KEY",)
    owned_options = {
        "--host": "the listen address, always 127.0.0.1",
        "--port": "the port CapyCTL picks",
        "--alias": "the model's name, from the deployment's name",
        "--api-key": "engine authentication; CapyCTL is the only client",
        "--api-key-file": "engine authentication; CapyCTL is the only client",
        "--context": "use engine_config.context_length",
    }

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def recognises(self, path: Path) -> bool:
        return _venv.find(path, DISTRIBUTION) is not None

    def probe(self, path: Path) -> tuple[str, str]:
        return _venv.probe(path, (DISTRIBUTION,), "TensorFold", PROGRAM)

    def command(self, engine: EngineInstall, spec: DeploymentSpec, port: int) -> list[str]:
        argv = [str(_venv.program(Path(engine.path), PROGRAM)), "serve", str(spec.model)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--alias", spec.name]
        if spec.engine_config.context_length is not None:
            argv += ["--context", str(spec.engine_config.context_length)]
        return argv + list(spec.engine_config.extra_args)

    def environment(self, engine: EngineInstall, spec: DeploymentSpec) -> dict[str, str | None]:
        return {"TENSORFOLD_API_KEY": None}  # an inherited key would lock CapyCTL out

    async def _health(self, base_url: str) -> dict[str, object] | None:
        return await fetch_json(self._client, base_url + "/health")

    async def probe_version(self, base_url: str) -> str | None:
        health = await self._health(base_url)
        version = health.get("version") if health is not None else None
        return _venv.public_version(version) if isinstance(version, str) and version else None

    async def ready(self, base_url: str) -> bool:
        health = await self._health(base_url)
        return health is not None and health.get("status") == "ok"

    async def load(self, base_url: str) -> EngineLoad | None:
        metrics = await fetch_ok(self._client, base_url + "/metrics")
        return (
            None
            if metrics is None
            else _prom.running_waiting(
                metrics, _RUNNING, _WAITING, ["tensorfold:kv_cache_usage_ratio", "tensorfold:kv_cache_usage_perc"]
            )
        )
