"""Metrics with vLLM's names, driven by a real manager's steps."""

from prometheus_client.parser import text_string_to_metric_families

from prefixkv import KVCacheManager
from prefixkv.fleet.metrics import CacheMetrics


def samples(metrics):
    out = {}
    for fam in text_string_to_metric_families(metrics.exposition().decode()):
        for s in fam.samples:
            out[(s.name, s.labels.get("source"))] = s.value
            assert s.labels["model_name"] == "m" and s.labels["engine"] == "3"
    return out


def test_names_and_values_follow_the_manager():
    mgr = KVCacheManager(8, 4, enable_events=True)
    met = CacheMetrics(model_name="m", engine="3")
    system = list(range(1, 9))
    mgr.add_request("a", system + [50])
    met.observe(mgr.take_stats(), mgr.usage, mgr.take_events())
    mgr.free("a")
    mgr.add_request("b", system + [60])  # hits 8 tokens
    mgr.free("b")
    mgr.add_request("c", list(range(100, 129)))  # 8 blocks: evicts the cached ones
    met.observe(mgr.take_stats(), mgr.usage, mgr.take_events(), dropped_batches=2)
    met.observe(mgr.take_stats(), mgr.usage, (), dropped_batches=2)
    s = samples(met)
    assert s[("vllm:prefix_cache_queries_total", None)] == 9 + 9 + 29
    assert s[("vllm:prefix_cache_hits_total", None)] == 8
    assert s[("prefixkv:prefix_cache_hits_by_source_total", "GPU")] == 8
    assert s[("vllm:kv_cache_usage_perc", None)] == 1.0
    assert s[("prefixkv:block_evictions_total", None)] == 2  # the two system-prompt blocks
    assert s[("prefixkv:kv_events_dropped_total", None)] == 2


def test_two_engines_in_one_process_do_not_collide():
    a, b = CacheMetrics(engine="0"), CacheMetrics(engine="1")
    assert a.registry is not b.registry
