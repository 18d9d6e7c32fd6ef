"""Metrics: counters and latency histograms per manager, readable as ``manager.stats()`` and exportable
to Prometheus (optional ``prometheus-client``; nothing is imported unless you ask for the exporter).

Exported families (prefix ``aiotransfer_``): ``events_total{event=...}`` (bytes, entries, rooms by
outcome, aux by path, dropped control messages by cause...), ``failures_total{reason=...}``, and
``latency_seconds{op=...}`` histograms (``send_kv``, ``room_tx``, ``room_rx``, ``aux_engine``,
``aux_tcp``), plus ``loop_lag_seconds`` when a lag monitor runs.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["BUCKETS", "Histogram", "Metrics", "PrometheusExporter", "failure_category"]

BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


class Histogram:
    """Fixed-bucket latency histogram (seconds) with quantile estimates."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds
        self.n += 1

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (0 when empty)."""
        if not self.n:
            return 0.0
        target = q * self.n
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= target:
                return self.buckets[i] if i < len(self.buckets) else float("inf")
        return float("inf")

    def summary(self) -> dict[str, float]:
        return {
            "count": self.n,
            "mean_s": self.total / self.n if self.n else 0.0,
            "p50_s": self.quantile(0.5),
            "p99_s": self.quantile(0.99),
        }


_CATEGORY = re.compile(r"[^a-z]+")


def failure_category(reason: str) -> str:
    """A short, bounded-cardinality label for a failure reason (first words, digits stripped)."""
    head = reason.split(":")[0].lower()
    words = [w for w in _CATEGORY.split(head) if w][:4]
    return "_".join(words) or "unknown"


class Metrics:
    """Per-manager metrics store."""

    def __init__(self) -> None:
        self.histograms: dict[str, Histogram] = {}
        self.failures: Counter[str] = Counter()

    def observe(self, op: str, seconds: float) -> None:
        h = self.histograms.get(op)
        if h is None:
            h = self.histograms[op] = Histogram()
        h.observe(seconds)

    def failure(self, reason: str) -> None:
        self.failures[failure_category(reason)] += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "latency": {op: h.summary() for op, h in sorted(self.histograms.items())},
            "failures_by_reason": dict(self.failures),
        }


_GAUGES = frozenset({
    "senders_active", "receivers_active", "in_flight", "pinned_bytes", "open_sockets", "decode_peers",
    "prefill_peers", "pending_requests", "dead_peers", "staging_bytes_in_use", "rooms_awaiting_release",
    "engine_holds_pending", "staging_requests_held",
})
"""Stats that are a current level (exported as gauges); ``pages_*`` and ``bytes_*`` are too."""


class _Observed(Protocol):
    """What the exporter reads: a manager's stats and histograms."""

    @property
    def metrics(self) -> Metrics: ...

    def stats(self) -> Mapping[str, Any]: ...


class PrometheusExporter:
    """Register a collector that reads ``manager.stats()`` at scrape time.

    ``PrometheusExporter(mgr).register()`` uses the default registry. Needs
    ``pip install aiotransfer[prometheus]``.

    Args:
        manager: What to read: a [`KVManager`][aiotransfer.KVManager].
        registry: A ``prometheus_client`` registry; None is the default one.
        labels: Constant labels added to every sample (``{"role": "prefill"}``).
    """

    def __init__(self, manager: _Observed, *, registry: Any = None, labels: dict[str, str] | None = None) -> None:
        self.manager = manager
        self.registry = registry
        self.labels = dict(labels or {})

    def register(self) -> PrometheusExporter:
        from prometheus_client import REGISTRY

        (self.registry or REGISTRY).register(self)
        return self

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        stats = self.manager.stats()
        keys = sorted(self.labels)
        values = [self.labels[k] for k in keys]
        events = CounterMetricFamily("aiotransfer_events", "Counted events", labels=[*keys, "event"])
        gauges = GaugeMetricFamily("aiotransfer_state", "Current state", labels=[*keys, "what"])
        for name, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if name in _GAUGES or name.startswith(("pages_", "bytes_")):
                gauges.add_metric([*values, name], float(value))
            else:
                events.add_metric([*values, name], float(value))
        for cause, n in stats.get("control_dropped", {}).items():
            events.add_metric([*values, f"control_dropped_{failure_category(cause)}"], float(n))
        yield events
        yield gauges
        failures = CounterMetricFamily("aiotransfer_failures", "Room failures by reason", labels=[*keys, "reason"])
        for reason, n in stats.get("failures_by_reason", {}).items():
            failures.add_metric([*values, reason], float(n))
        yield failures
        for op, h in sorted(self.manager.metrics.histograms.items()):
            fam = HistogramMetricFamily("aiotransfer_latency_seconds", "Operation latency", labels=[*keys, "op"])
            cumulative, buckets = 0, []
            for bound, c in zip((*h.buckets, float("inf")), h.counts, strict=True):
                cumulative += c
                buckets.append((str(bound) if bound != float("inf") else "+Inf", float(cumulative)))
            fam.add_metric([*values, op], buckets, h.total)
            yield fam
