"""The router's Prometheus metrics, read from its ReplicaSet at each scrape.

tokenmill_router:replica_healthy{replica}          1 up, 0 down
tokenmill_router:replica_in_flight{replica}        requests being served
tokenmill_router:replica_requests_total{replica}   attempts sent (retries included)
tokenmill_router:replica_failures_total{replica}   attempts that failed before a response
tokenmill_router:routing_decisions_total{reason}   prefix_hit, next_healthy, fallback, retry
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.router.policy import Reason
from tokenmill.router.replicas import ReplicaSet

PREFIX = "tokenmill_router:"


class RouterCollector(Collector):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        per_replica = (
            (GaugeMetricFamily, "replica_healthy", "Whether the replica is up.", "healthy"),
            (GaugeMetricFamily, "replica_in_flight", "Requests in flight.", "in_flight"),
            (CounterMetricFamily, "replica_requests", "Attempts sent.", "num_requests"),
            (CounterMetricFamily, "replica_failures", "Attempts that failed.", "num_failures"),
        )
        for family_cls, name, doc, attr in per_replica:
            family = family_cls(PREFIX + name, doc, labels=["replica"])
            for r in self.replicas.replicas:
                family.add_metric([r.url], float(getattr(r, attr)))
            yield family
        decisions = CounterMetricFamily(
            PREFIX + "routing_decisions", "Routing decisions by reason.", labels=["reason"]
        )
        for reason in Reason:
            decisions.add_metric([reason.value], float(self.replicas.decisions[reason]))
        yield decisions


def create_registry(replicas: ReplicaSet) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(replicas))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
