"""Reading gauges from an engine's Prometheus text (``GET /metrics``).

Engines label their gauges (vLLM: ``engine``, ``model_name``; SGLang: ranks and
priorities), so one gauge can have several samples: its value is the sum over
all its label sets. A gauge with no sample at all is reported missing, never 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from capyctl.domain.ports import EngineLoad

# name, optional {labels} (quoted values may hold "}" or escaped quotes), value, optional timestamp
_SAMPLE = re.compile(
    rb'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?:[^"}]|"(?:[^"\\\n]|\\.)*")*\})?[ \t]+([^ \t\r\n]+)(?:[ \t]+-?\d+)?[ \t]*\r?$',
    re.M,
)


def gauges(text: bytes, names: Iterable[str], peak: bool = False) -> dict[str, float]:
    """Each named metric summed over its label sets (``peak``: the largest of them); names without a sample
    are left out."""
    wanted = {name.encode(): name for name in names}
    found: dict[str, float] = {}
    for match in _SAMPLE.finditer(text):
        name = wanted.get(match.group(1))
        if name is None:
            continue
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if not math.isfinite(value):  # NaN (the engine could not count it) or an infinity: no count at all
            continue
        found[name] = max(found.get(name, value), value) if peak else found.get(name, 0.0) + value
    return found


def running_waiting(
    text: bytes, running: Iterable[str], waiting: Iterable[str], kv: Iterable[str] = ()
) -> EngineLoad | None:
    """(running, waiting, KV-cache use) from the first name of each list that has a sample; None without a
    running gauge.

    A missing waiting gauge reads as 0 (an engine with no queue does not publish one); a missing KV gauge as
    None (not reported). The KV share is the fullest of its label sets (one per engine of a data-parallel
    server), as a fraction of 1.
    """
    running, waiting, kv = list(running), list(waiting), list(kv)
    found = gauges(text, running + waiting)
    run = next((found[name] for name in running if name in found), None)
    if run is None:
        return None
    wait = next((found[name] for name in waiting if name in found), 0.0)
    shares = gauges(text, kv, peak=True) if kv else {}
    share = next((shares[name] for name in kv if name in shares), None)
    return EngineLoad(int(run), int(wait), None if share is None else min(1.0, max(0.0, share)))
