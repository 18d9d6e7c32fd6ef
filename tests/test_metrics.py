"""Metrics: histograms, failure labels, stats() and the Prometheus exporter over a real transfer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from aiotransfer import KVManager, ManagerStats
from aiotransfer._metrics import Histogram, PrometheusExporter, failure_category
from tests.remote import RemotePeer


def test_histogram_quantiles() -> None:
    h = Histogram()
    for v in [0.0002] * 90 + [0.02] * 10:
        h.observe(v)
    assert h.quantile(0.5) == 0.00025
    assert h.quantile(0.99) == 0.025
    assert h.summary()["count"] == 100
    assert Histogram().quantile(0.5) == 0.0


def test_failure_category_is_bounded() -> None:
    assert failure_category("aborted by decode: client went away") == "aborted_by_decode"
    assert failure_category("peer tcp://1.2.3.4:5 silent for 3.1s") == "peer_tcp"
    assert failure_category("transfer timed out: engine transfer exceeded") == "transfer_timed_out"
    assert failure_category("") == "unknown"


async def test_stats_and_prometheus_after_transfers(prefill: KVManager, decode: RemotePeer) -> None:
    for room in (1, 2):
        tx = prefill.sender(room)
        await decode.call("receiver", room=room, peer=prefill.endpoint, pages=[1, 2])
        await tx.wait_ready(timeout=10)
        if room == 1:
            await tx.send_kv([3, 4])
            await decode.call("done", room=room)
        else:
            await tx.abort("operator said no")
    stats = prefill.stats()
    assert stats["latency"]["send_kv"]["count"] == 1
    assert stats["latency"]["room_tx"]["count"] == 2
    assert stats["failures_by_reason"] == {"aborted_by_prefill": 1}  # the reason says which side aborted
    assert stats["rooms_sent_success"] == 1 and stats["rooms_sent_failed"] == 1
    declared = ManagerStats.__required_keys__ | ManagerStats.__optional_keys__
    assert ManagerStats.__required_keys__ <= set(stats)
    assert set(stats) <= declared, set(stats) - declared  # every key stats() returns is typed
    registry = CollectorRegistry()
    PrometheusExporter(prefill, registry=registry, labels={"role": "prefill"}).register()
    text = generate_latest(registry).decode()
    assert 'aiotransfer_events_total{event="kv_bytes_sent",role="prefill"}' in text
    assert 'aiotransfer_failures_total{reason="aborted_by_prefill",role="prefill"} 1.0' in text
    assert 'aiotransfer_latency_seconds_count{op="send_kv",role="prefill"} 1.0' in text
    assert 'aiotransfer_state{role="prefill",what="senders_active"} 0.0' in text
