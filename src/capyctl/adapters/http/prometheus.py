"""CapyCTL's own Prometheus metrics (MET-5), served at ``GET /metrics`` behind the API key.

Counters and histograms are updated once per request (never per chunk);
in-flight and waiting requests, deployment states and engine restarts are
read from the live objects when Prometheus scrapes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter as PromCounter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from capyctl.domain.deployments import InstanceState
from capyctl.domain.requests import Phase
from capyctl.services.chat import ChatService
from capyctl.services.fleet import Fleet

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class _LiveCollector(Collector):
    def __init__(self, fleet: Fleet, chat: ChatService) -> None:
        self._fleet = fleet
        self._chat = chat

    def collect(self) -> Iterator[Metric]:
        waiting, in_flight = Counter[str](), Counter[str]()
        for record in list(self._chat.live.values()):
            (waiting if record.phase is Phase.WAITING else in_flight)[record.deployment] += 1
        flight = GaugeMetricFamily("capyctl_requests_in_flight", "Requests an engine is working on", labels=["deployment"])
        queue = GaugeMetricFamily("capyctl_requests_waiting", "Requests waiting for their deployment to be ready",
                                  labels=["deployment"])
        states = GaugeMetricFamily("capyctl_deployment_state", "1 for the state each deployment is in",
                                   labels=["deployment", "state"])
        restarts = CounterMetricFamily("capyctl_engine_restarts", "Engine relaunches after a crash or failed start",
                                       labels=["deployment"])
        for supervisor in self._fleet.supervisors():
            name = supervisor.name
            flight.add_metric([name], in_flight[name])
            queue.add_metric([name], waiting[name])
            restarts.add_metric([name], supervisor.status.restarts)
            for state in InstanceState:
                states.add_metric([name, str(state)], 1.0 if supervisor.status.state is state else 0.0)
        yield from (flight, queue, states, restarts)


class RequestStats:
    """Per-request figures for Prometheus, and the text exposition of everything."""

    def __init__(self, fleet: Fleet, chat: ChatService) -> None:
        self.registry = CollectorRegistry()
        self.requests = PromCounter("capyctl_requests", "Chat requests answered, by deployment and code",
                                    ["deployment", "code"], registry=self.registry)
        self.ttft = Histogram("capyctl_time_to_first_token_seconds", "Time to first token of completed answers",
                              ["deployment"], buckets=_TTFT_BUCKETS, registry=self.registry)
        self.relay = Histogram("capyctl_relay_latency_seconds",
                               "Time CapyCTL took to pass an engine's first chunk on to the client",
                               ["deployment"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.cuts = PromCounter("capyctl_client_connections_cut",
                                "Client connections cut or refused before a request was read, by reason "
                                "(slow_headers, slow_body, too_many_connections)", ["reason"], registry=self.registry)
        self.registry.register(_LiveCollector(fleet, chat))

    def answered(self, deployment: str, code: str, ttft_ms: float | None) -> None:
        self.requests.labels(deployment, code).inc()
        if ttft_ms is not None:
            self.ttft.labels(deployment).observe(ttft_ms / 1000)

    def client_cut(self, reason: str) -> None:
        self.cuts.labels(reason).inc()

    def relayed_first_chunk(self, deployment: str, seconds: float) -> None:
        self.relay.labels(deployment).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
