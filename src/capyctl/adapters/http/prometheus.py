"""CapyCTL's own Prometheus metrics (MET-5), served at ``GET /metrics`` behind the API key.

Counters and histograms get one figure per request (never per chunk), held
in a list and counted in one go when Prometheus scrapes (or every few
thousand requests); in-flight and waiting requests, deployment states and
engine restarts are read from the live objects when Prometheus scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from capyctl.domain.deployments import InstanceState
from capyctl.domain.settlement import ENGINE_IDLE, ENGINE_STOP
from capyctl.services.admission import AdmissionService
from capyctl.services.fleet import Fleet
from capyctl.services.routing import Router

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_WAIT_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
_HELD_MOST = 4096  # per-request figures held before they are counted (see RequestStats._held)
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class _LiveCollector(Collector):
    def __init__(self, fleet: Fleet, admission: AdmissionService, router: Router | None) -> None:
        self._fleet = fleet
        self._admission = admission
        self._router = router

    def collect(self) -> Iterator[Metric]:
        admission = self._admission.state
        flight = GaugeMetricFamily(
            "capyctl_requests_in_flight", "Requests granted a slot at their deployment's engine", labels=["deployment"]
        )
        queue = GaugeMetricFamily(
            "capyctl_requests_waiting",
            "Requests waiting in line for their deployment (to start, or for a slot)",
            labels=["deployment"],
        )
        states = GaugeMetricFamily(
            "capyctl_deployment_state", "1 for the state each deployment is in", labels=["deployment", "state"]
        )
        restarts = CounterMetricFamily(
            "capyctl_engine_restarts", "Engine relaunches after a crash or failed start", labels=["deployment"]
        )
        unsettled = GaugeMetricFamily(
            "capyctl_requests_unsettled",
            "Cut requests still counted against their deployment, by how they settle",
            labels=["deployment", "rule"],
        )
        instance_flight = GaugeMetricFamily(
            "capyctl_instance_requests_in_flight",
            "Requests at each instance's engine now, as the router counts them",
            labels=["deployment", "instance", "host"],
        )
        for found in self._fleet.deployments():
            name = found.name
            counts: dict[str, int] = {}
            for member in found.members:
                for entry in member.settlement.ledger.counts():
                    counts[entry["rule"]] = counts.get(entry["rule"], 0) + entry["count"]
                host = member.host or ""
                instance_flight.add_metric([name, str(member.index), host], member.in_flight)
            for rule in (ENGINE_IDLE, ENGINE_STOP):
                unsettled.add_metric([name, rule], counts.get(rule, 0))
            flight.add_metric([name], admission.in_flight(name))
            queue.add_metric([name], admission.waiting(name))
            restarts.add_metric([name], sum(m.status.restarts for m in found.members))
            for state in InstanceState:
                states.add_metric([name, str(state)], 1.0 if found.state is state else 0.0)
        charged = GaugeMetricFamily(
            "capyctl_memory_charged_bytes",
            "Device memory CapyCTL counts as held, by device and deployment",
            labels=["device", "deployment"],
        )
        capacity = GaugeMetricFamily(
            "capyctl_memory_capacity_bytes", "A device's capacity and its reserve", labels=["device", "kind"]
        )
        room = self._fleet.room
        for device in room.every_device():
            capacity.add_metric([device.name, "capacity"], device.capacity)
            capacity.add_metric([device.name, "reserve"], device.reserve)
            for name, size in room.charged(device).items():
                charged.add_metric([device.name, name], size)
        yield from (flight, queue, states, restarts, unsettled, charged, capacity, instance_flight)
        if self._router is not None:
            yield from self._routing(self._router)

    @staticmethod
    def _routing(router: Router) -> Iterator[Metric]:
        selections = CounterMetricFamily(
            "capyctl_instance_selections",
            "Requests the router sent to each instance of a deployment",
            labels=["deployment", "instance"],
        )
        for (deployment, index), count in sorted(router.selections.items()):
            selections.add_metric([deployment, str(index)], count)
        failovers = CounterMetricFamily(
            "capyctl_router_failovers",
            "Requests that reached no engine at an instance and went to another, by reason",
            labels=["deployment", "reason"],
        )
        for (deployment, reason), count in sorted(router.failovers.items()):
            failovers.add_metric([deployment, reason], count)
        yield from (selections, failovers)


class RequestStats:
    """Per-request figures for Prometheus, and the text exposition of everything."""

    def __init__(self, fleet: Fleet, admission: AdmissionService, router: Router | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = PromCounter(
            "capyctl_requests",
            "Chat and decision requests answered, by deployment, code and the name of the API key",
            ["deployment", "code", "key"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "capyctl_time_to_first_token_seconds",
            "Time to first token of completed answers",
            ["deployment"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.relay = Histogram(
            "capyctl_relay_latency_seconds",
            "Time CapyCTL took to pass an engine's first chunk on to the client",
            ["deployment"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.cuts = PromCounter(
            "capyctl_client_connections_cut",
            "Client connections cut or refused before a request was read, by reason "
            "(slow_headers, slow_body, too_many_connections)",
            ["reason"],
            registry=self.registry,
        )
        self.waits = Histogram(
            "capyctl_queue_wait_seconds",
            "Time a request waited in line for its deployment before it was sent to the engine",
            ["deployment"],
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.refusals = PromCounter(
            "capyctl_refusals",
            "Chat requests refused, by code: before a request record "
            "exists (401, 400, 404, 413) and by the scheduler (429, 503)",
            ["code"],
            registry=self.registry,
        )
        self.parks = PromCounter(
            "capyctl_parks",
            "Engines parked (host_backed, deep), by deployment and why (switch, idle, operator)",
            ["deployment", "why"],
            registry=self.registry,
        )
        self.wakes = PromCounter(
            "capyctl_wakes", "Parked engines woken, by deployment", ["deployment"], registry=self.registry
        )
        self.wake_seconds = Histogram(
            "capyctl_wake_seconds",
            "Time from a wake's start to the engine ready again",
            ["deployment"],
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.switches = PromCounter(
            "capyctl_switches",
            "Switches that made room on a device, by outcome",
            ["device", "outcome"],
            registry=self.registry,
        )
        self.registry.register(_LiveCollector(fleet, admission, router))
        admission.on_wait = self.waited
        self._park_reason: dict[str, str] = {}
        # the labelled children of the per-request metrics, by labels: prometheus_client's labels() checks and
        # looks them up under a lock each call; the children live as long as the registry (none is removed)
        self._children: dict[tuple[Any, ...], Any] = {}
        # the per-request figures not yet counted: (child, None) for a counter's 1, (child, value) for a
        # histogram's observation; counted when Prometheus reads them (exposition) or past _HELD_MOST, in one
        # loop, rather than under two or three locks and a bucket search during each request
        self._held: list[tuple[Any, float | None]] = []

    def _child(self, metric: Any, *labels: str) -> Any:
        child = self._children.get((metric, *labels))
        if child is None:
            child = self._children[(metric, *labels)] = metric.labels(*labels)
        return child

    def event(self, deployment: str | None, kind: str, detail: dict[str, Any]) -> None:
        """Counts what the events tell: parks, wakes and their durations, switches."""
        if kind == "operator_park" or kind == "idle_park":
            self._park_reason[str(deployment)] = kind.split("_")[0]
        elif kind == "switch_planned":
            for victim in detail.get("victims", ()):
                self._park_reason[victim["name"]] = "switch"
        elif kind == "parked":
            self.parks.labels(deployment, self._park_reason.pop(str(deployment), "switch")).inc()
        elif kind == "woken":
            self.wakes.labels(deployment).inc()
            self.wake_seconds.labels(deployment).observe(float(detail.get("seconds", 0.0)))
        elif kind in ("switch_completed", "switch_failed") and "device" in detail:
            self.switches.labels(detail["device"], kind.removeprefix("switch_")).inc()

    def answered(self, deployment: str, code: str, ttft_ms: float | None, key: str = "-") -> None:
        self._hold(self._child(self.requests, deployment, code, key), None)
        if ttft_ms is not None:
            self._hold(self._child(self.ttft, deployment), ttft_ms / 1000)

    def waited(self, deployment: str, seconds: float) -> None:
        self._hold(self._child(self.waits, deployment), seconds)

    def _hold(self, child: Any, value: float | None) -> None:
        """A counter's 1 (``value`` None) or a histogram's observation, counted later (see ``_held``)."""
        self._held.append((child, value))
        if len(self._held) >= _HELD_MOST:
            self._count_held()

    def _count_held(self) -> None:
        held, self._held = self._held, []
        for child, value in held:
            if value is None:
                child.inc()
            else:
                child.observe(value)

    def refused(self, code: str) -> None:
        self.refusals.labels(code).inc()

    def client_cut(self, reason: str) -> None:
        self.cuts.labels(reason).inc()

    def relayed_first_chunk(self, deployment: str, seconds: float) -> None:
        self._hold(self._child(self.relay, deployment), seconds)

    def exposition(self) -> bytes:
        self._count_held()
        return generate_latest(self.registry)
