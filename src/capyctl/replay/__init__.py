"""capyctl.replay: a stand-in LLM engine that serves recorded engine traffic.

It answers ``POST /v1/chat/completions`` with the exact bytes of a recording
folder (``tests/contract/recordings/<engine>/<version>/``) and mimics the
engine's side routes (health, version, metrics with live running/waiting
gauges, sleep/wake). It is the baseline of CapyCTL's relay benchmark and the
engine behind the contract tests, so it imports nothing from the rest of
``capyctl``.

Run it as ``python -m capyctl.replay`` or ``capyctl-replay`` (see ``--help``).
"""

__all__ = ["DIALECTS"]

DIALECTS = ("vllm", "sglang", "llamacpp", "tensorfold")
