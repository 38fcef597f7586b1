"""SGLang's server (``python -m sglang.launch_server``).

Registered by the directory of the virtualenv SGLang is installed in; the
version is that of the ``sglang`` distribution, read from its metadata without
importing it. ``--enable-metrics`` is forced (without it there is no
``/metrics``, so no load reading) and so is ``--enable-cache-report`` (cached
prompt tokens in ``usage``, MET-4); neither can be turned off by a deployment.

``GET /health`` answers 503 while the server starts (and shuts down), then 200
without running a generation. Running and waiting counts are the ``/metrics``
gauges ``sglang:num_running_reqs`` and ``sglang:num_queue_reqs``, labelled by
model, engine type and ranks (summed over label sets). The running version is
the ``version`` field of ``GET /get_server_info`` (``GET /server_info`` where
that older route is gone). A deployment whose residency parks gets
``--enable-memory-saver`` (the release and resume routes), and a host_backed
one ``--enable-weights-cpu-backup`` too (its weights survive a release).
"""

from __future__ import annotations

from pathlib import Path

from capyctl.adapters.engines import _prom, _venv
from capyctl.adapters.engines._capabilities import DecisionsByVersion
from capyctl.adapters.engines._http import EngineClient, fetch_json, fetch_ok, post_ok
from capyctl.domain.deployments import DeploymentSpec
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.memory import Residency
from capyctl.domain.ports import EngineAdapter, EngineLoad

DISTRIBUTION = "sglang"
_RUNNING = "sglang:num_running_reqs"
_KV = ["sglang:token_usage"]  # the KV cache's use, 1.0 = full
_WAITING = "sglang:num_queue_reqs"

_OWNED = {
    "--config": "a file of options, which could set those CapyCTL owns; list options in extra_args",
    "--model-path": "the model, from the deployment's model",
    "--model": "the model, from the deployment's model",
    "--served-model-name": "the model's name, from the deployment's name",
    "--host": "the listen address, always 127.0.0.1",
    "--port": "the port CapyCTL picks",
    "--api-key": "engine authentication; CapyCTL is the only client",
    "--admin-api-key": "engine authentication; CapyCTL is the only client",
    "--enable-metrics": "the metrics endpoint CapyCTL reads, always on",
    "--no-enable-metrics": "the metrics endpoint CapyCTL reads, always on",
    "--enable-cache-report": "cached-token counts in usage, always on (MET-4)",
    "--no-enable-cache-report": "cached-token counts in usage, always on (MET-4)",
    "--context-length": "use engine_config.context_length",
    "--enable-memory-saver": "parking, from the deployment's residency",
    "--enable-weights-cpu-backup": "parking, from the deployment's residency",
}


class SglangEngine(DecisionsByVersion, EngineAdapter):
    family = EngineFamily.SGLANG
    owned_env: tuple[str, ...] = ()
    # also refuses abbreviations argparse would expand to one of these (--enable-cache-rep)
    owned_options = _venv.ArgparseOptions(_OWNED)

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def recognises(self, path: Path) -> bool:
        return _venv.find(path, DISTRIBUTION) is not None

    def probe(self, path: Path) -> tuple[str, str]:
        return _venv.probe(path, (DISTRIBUTION,), "SGLang")

    def command(self, engine: EngineInstall, spec: DeploymentSpec, port: int) -> list[str]:
        argv = [str(_venv.python(Path(engine.path))), "-m", "sglang.launch_server"]
        argv += ["--model-path", str(spec.model), "--served-model-name", spec.name]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--enable-metrics", "--enable-cache-report"]
        if spec.engine_config.context_length is not None:
            argv += ["--context-length", str(spec.engine_config.context_length)]
        if spec.residency is not Residency.RESTART_ONLY:
            argv.append("--enable-memory-saver")
        if spec.residency is Residency.HOST_BACKED:
            argv.append("--enable-weights-cpu-backup")
        return argv + list(spec.engine_config.extra_args)

    def environment(self, engine: EngineInstall, spec: DeploymentSpec) -> dict[str, str | None]:
        return {}

    async def probe_version(self, base_url: str) -> str | None:
        for route in ("/get_server_info", "/server_info"):
            body = await fetch_json(self._client, base_url + route)
            version = body.get("version") if body is not None else None
            if isinstance(version, str) and version:
                return _venv.public_version(version)
        return None

    async def ready(self, base_url: str) -> bool:
        return await fetch_ok(self._client, base_url + "/health") is not None

    async def load(self, base_url: str) -> EngineLoad | None:
        metrics = await fetch_ok(self._client, base_url + "/metrics")
        return None if metrics is None else _prom.running_waiting(metrics, [_RUNNING], [_WAITING], _KV)

    # --- parking (memory saver: release and resume; deep also reloads the weights) --------------
    async def park(self, base_url: str, residency: Residency) -> None:
        """Release the device memory (weights, KV cache, CUDA graphs); SGLang wants an idle server, which
        CapyCTL's drain gives it."""
        await post_ok(self._client, f"{base_url}/release_memory_occupation", {})

    async def wake(self, base_url: str, residency: Residency, model: str) -> None:
        await post_ok(self._client, f"{base_url}/resume_memory_occupation", {})
        if residency is Residency.DEEP:  # without the CPU backup the resumed weights must be read again
            await post_ok(self._client, f"{base_url}/update_weights_from_disk", {"model_path": model})
        await post_ok(self._client, f"{base_url}/flush_cache")

    async def parked(self, base_url: str) -> bool | None:
        """SGLang has no route that tells; its 200 to the release is the evidence."""
        return None
