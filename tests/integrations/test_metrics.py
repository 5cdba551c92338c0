"""KVOffloadStats: what a step's scheduler-side counters carry to vLLM's metrics."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvoffload.connector.stats import SchedulerStats
from kvoffload.integrations.vllm.metrics import KVOffloadStats


def test_failed_load_tokens_of_a_step_without_lookups_reach_the_stats() -> None:
    # A load fails steps after its request's lookup: its tokens must not wait for (or miss) a step with lookups.
    stats = KVOffloadStats.of(lookups=SchedulerStats(failed_load_tokens=64))
    assert not stats.is_empty() and stats.lookups.failed_load_tokens == 64
    assert KVOffloadStats.of(lookups=SchedulerStats(skipped_slow_tokens=32)).lookups.skipped_slow_tokens == 32
    assert KVOffloadStats.of(lookups=SchedulerStats()).is_empty()


def test_store_admission_counts_reach_the_stats_add_up_and_show_in_the_log_line() -> None:
    step = KVOffloadStats.of(lookups=SchedulerStats(admitted_blocks=3, declined_blocks=5))
    assert not step.is_empty()
    total = step.aggregate(step)
    assert (total.lookups.admitted_blocks, total.lookups.declined_blocks) == (6, 10)
    reduced = total.reduce()
    assert reduced["admitted_blocks"] == 6 and reduced["declined_blocks"] == 10
    # With every block admitted (store_admission: all) the log line says nothing of admission.
    assert "declined_blocks" not in KVOffloadStats.of(lookups=SchedulerStats(admitted_blocks=3)).reduce()


class _Metric:
    """A stand-in for a Prometheus counter or gauge: remembers what was added per label values."""

    def __init__(self, name: str, documentation: str, labelnames: list[str], **_: object) -> None:
        self.name = name
        self.values: dict[tuple[object, ...], float] = {}

    def labels(self, *values: object) -> _Metric:
        self._at = values
        return self

    def inc(self, value: float) -> None:
        self.values[self._at] = self.values.get(self._at, 0) + value

    def set(self, value: float) -> None:
        self.values[self._at] = value


def test_store_admission_counts_feed_their_prometheus_counters() -> None:
    from types import SimpleNamespace

    from prometheus_client import Counter, Gauge, Histogram

    from kvoffload.integrations.vllm.metrics import KVOffloadPromMetrics

    prom = KVOffloadPromMetrics(SimpleNamespace(kv_transfer_config=None),
                                {Counter: _Metric, Gauge: _Metric, Histogram: _Metric},  # type: ignore[dict-item]
                                ["engine"], {0: ["0"]})
    data = KVOffloadStats.of(lookups=SchedulerStats(admitted_blocks=3, declined_blocks=5)).data
    prom.observe(data)
    prom.observe(data)
    assert prom._tokens["admitted_blocks"].name == "vllm:kvoffload_store_admitted_blocks"
    assert prom._tokens["admitted_blocks"].values == {("0",): 6}
    assert prom._tokens["declined_blocks"].values == {("0",): 10}


def _registered(extra_config: dict[str, object]) -> str:
    """What /metrics shows for a fresh KVOffloadPromMetrics of this kvoffload config, before any event."""
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvoffload.integrations.vllm.metrics import KVOffloadPromMetrics

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra_config))
    KVOffloadPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_every_series_is_listed_at_zero_before_the_first_event(tmp_path) -> None:
    text = _registered({"disk_path": str(tmp_path), "disk_bytes": 1 << 30})
    labels = 'engine="0",model_name="tiny"'
    for name in ("hit_tokens", "miss_tokens", "failed_load_tokens", "skipped_slow_hit_tokens",
                 "store_admitted_blocks", "store_declined_blocks", "unanswered_lookups", "undeleted_blocks"):
        assert f"vllm:kvoffload_{name}_total{{{labels}}} 0.0" in text
    for direction in ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host"):
        for name in ("transfer_bytes", "transfer_seconds", "transfer_jobs", "transfer_failed_jobs"):
            assert f'vllm:kvoffload_{name}_total{{direction="{direction}",{labels}}} 0.0' in text
    assert f"vllm:kvoffload_host_used_bytes{{{labels}}} 0.0" in text


def test_only_the_configured_tiers_directions_are_listed() -> None:
    text = _registered({})  # host tier only
    assert 'direction="host_to_device"' in text
    assert "disk" not in text and "remote" not in text


def test_the_node_pool_counters_are_gauges_listed_only_with_the_node_scope() -> None:
    assert "node_pool" not in _registered({})
    text = _registered({"host_scope": "node"})
    for counter in ("capacity", "used", "stores", "evictions", "cross_hits", "repairs", "reclaimed", "attached",
                    "served"):
        assert f'vllm:kvoffload_node_pool{{counter="{counter}",engine="0",model_name="tiny"}} 0.0' in text


def test_the_node_pool_counters_reach_the_gauges_the_latest_winning() -> None:
    from types import SimpleNamespace

    from prometheus_client import Counter, Gauge, Histogram

    from kvoffload.integrations.vllm.metrics import KVOffloadPromMetrics

    older = KVOffloadStats.of(node_pool={"cross_hits": 3, "used": 10})
    newer = KVOffloadStats.of(node_pool={"cross_hits": 5, "used": 12})
    assert older.aggregate(newer).data["node_pool"] == {"cross_hits": 5, "used": 12}
    assert older.aggregate(KVOffloadStats.of()).data["node_pool"] == {"cross_hits": 3, "used": 10}
    assert newer.reduce()["node_pool_cross_hits"] == 5
    node = SimpleNamespace(kv_connector_extra_config={"host_scope": "node"})
    prom = KVOffloadPromMetrics(SimpleNamespace(kv_transfer_config=node),
                                {Counter: _Metric, Gauge: _Metric, Histogram: _Metric},  # type: ignore[dict-item]
                                ["engine"], {0: ["0"]})
    prom.observe(older.data)
    prom.observe(newer.data)
    assert prom._node_pool.values[("0", "cross_hits")] == 5 and prom._node_pool.values[("0", "used")] == 12


def test_the_pool_wide_gauges_read_the_pool_when_scraped(node_path) -> None:
    """Two engines scraped at once show one figure: the gauges read the shared index at scrape time, not each
    engine's reading at its last step (which missed what other engines did since)."""
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from tests.tiers.node.pools import engine_in, keys, store

    from kvoffload.integrations.vllm.metrics import KVOffloadPromMetrics

    mine, _ = engine_in(node_path)
    theirs, _ = engine_in(node_path)
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    node = SimpleNamespace(kv_connector_extra_config={"host_scope": "node"})
    prom = KVOffloadPromMetrics(SimpleNamespace(kv_transfer_config=node), types,  # type: ignore[arg-type]
                                ["engine"], {0: ["0"]})
    store(mine, keys(2))
    step = KVOffloadStats.of(node_pool=mine.pool_counters(), node_pool_path=mine.pool_directory())
    prom.observe(step.data)
    store(theirs, keys(3))  # the other engine stores after this engine's last step
    text = generate_latest(registry).decode()
    assert 'vllm:kvoffload_node_pool{counter="stores",engine="0"} 5.0' in text  # the step said 2
    assert 'vllm:kvoffload_node_pool{counter="attached",engine="0"} 2.0' in text
    assert 'vllm:kvoffload_node_pool{counter="served",engine="0"} 0.0' in text  # this engine's own, per step


def test_gauges_that_cannot_read_at_scrape_time_keep_each_step_reading(node_path) -> None:
    from types import SimpleNamespace

    from prometheus_client import Counter, Gauge, Histogram

    from kvoffload.integrations.vllm.metrics import KVOffloadPromMetrics

    node = SimpleNamespace(kv_connector_extra_config={"host_scope": "node"})
    prom = KVOffloadPromMetrics(SimpleNamespace(kv_transfer_config=node),
                                {Counter: _Metric, Gauge: _Metric, Histogram: _Metric},  # type: ignore[dict-item]
                                ["engine"], {0: ["0"]})
    prom.observe(KVOffloadStats.of(node_pool={"stores": 4}, node_pool_path=str(node_path)).data)  # no set_function
    assert prom._node_pool.values[("0", "stores")] == 4 and not prom._live


TENANTS = {"tenant_by": "cache_salt", "tenant_quota": {"default": 0.5, "acme": 0.5}}


def test_tenant_series_are_listed_at_zero_for_the_named_tenants_and_other_only_with_tenants(tmp_path) -> None:
    text = _registered({**TENANTS, "disk_path": str(tmp_path), "disk_bytes": 1 << 30})
    for tenant in ("acme", "other"):
        labels = f'engine="0",model_name="tiny",tenant="{tenant}"'
        for name in ("tenant_query_tokens", "tenant_hit_tokens"):
            assert f"vllm:kvoffload_{name}_total{{{labels}}} 0.0" in text
        for tier in ("host", "disk"):
            tiered = f'engine="0",model_name="tiny",tenant="{tenant}",tier="{tier}"'
            assert f"vllm:kvoffload_tenant_used_bytes{{{tiered}}} 0.0" in text
            for name in ("stored", "evicted", "hit"):
                assert f"vllm:kvoffload_tenant_{name}_blocks_total{{{tiered}}} 0.0" in text
    assert "tenant" not in _registered({})


def test_tenant_figures_reach_their_series_counters_adding_up_and_gauges_the_latest() -> None:
    from types import SimpleNamespace

    from prometheus_client import Counter, Gauge, Histogram

    from kvoffload.connector.stats import TenantFigures
    from kvoffload.integrations.vllm.metrics import KVOffloadPromMetrics

    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=TENANTS))
    prom = KVOffloadPromMetrics(config, {Counter: _Metric, Gauge: _Metric, Histogram: _Metric},  # type: ignore[dict-item]
                                ["engine"], {0: ["0"]})
    for used in (4096, 2048):
        figures = TenantFigures({"acme": [100, 64]}, {"host": {"acme": [used, 3, 1, 2]}})
        stats = KVOffloadStats.of(lookups=SchedulerStats(requests=1, tenants=figures))
        prom.observe(KVOffloadStats(data=dict(stats.data)).aggregate(KVOffloadStats()).data)
    tenants = prom._tenants
    assert tenants is not None
    assert tenants.query.values[("0", "acme")] == 200 and tenants.hit.values[("0", "acme")] == 128
    assert tenants.used.values[("0", "acme", "host")] == 2048
    assert [m.values[("0", "acme", "host")] for m in tenants.blocks] == [6, 2, 4]
