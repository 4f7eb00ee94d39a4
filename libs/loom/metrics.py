"""Prometheus metrics, one registry per service process (served over NATS and optionally HTTP)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets in seconds, wide enough for tool calls and long generations.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        self.bad_messages = self.counter("bad_messages_total", "Messages rejected as malformed", ["subject"])
        self.handler_errors = self.counter("handler_errors_total", "Handler exceptions", ["subject"])

    def counter(self, name: str, doc: str, labels: list[str] | None = None) -> Counter:
        return Counter(f"loom_{self.service}_{name}", doc, labels or [], registry=self.registry)

    def gauge(self, name: str, doc: str, labels: list[str] | None = None) -> Gauge:
        return Gauge(f"loom_{self.service}_{name}", doc, labels or [], registry=self.registry)

    def histogram(
        self,
        name: str,
        doc: str,
        labels: list[str] | None = None,
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
    ) -> Histogram:
        return Histogram(
            f"loom_{self.service}_{name}", doc, labels or [], registry=self.registry, buckets=buckets
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
