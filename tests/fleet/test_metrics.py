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


def test_health_metrics_expose_publisher_and_subscriber_failures():
    from prefixkv.fleet.metrics import HealthMetrics

    met = HealthMetrics(model_name="m", engine="3")
    pub = {"sender_alive": True, "send_errors": 2}
    sub = {"alive": False, "counters": {"restarts": 1, "bad_batches": 4},
           "replicas": {"r": {"connected": False, "block_size_mismatches": 3, "lossy": 2,
                                 "index_refused": 6, "hash_mismatches": 7}}}
    met.observe_publisher(pub)
    met.observe_subscriber(sub)
    met.observe_publisher({"sender_alive": False, "send_errors": 5})
    met.observe_subscriber({**sub, "counters": {"restarts": 2, "bad_batches": 4}})
    got = {}
    for fam in text_string_to_metric_families(met.exposition().decode()):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                got[(s.name, s.labels.get("event") or s.labels.get("replica"))] = s.value
    assert got == {
        ("prefixkv:kv_events_sender_up", None): 0, ("prefixkv:kv_events_send_errors_total", None): 5,
        ("prefixkv:router_subscriber_up", None): 0,
        ("prefixkv:router_stream_events_total", "restarts"): 2,
        ("prefixkv:router_stream_events_total", "bad_batches"): 4,
        ("prefixkv:router_replica_connected", "r"): 0,
        ("prefixkv:router_block_size_mismatches_total", "r"): 3,
        ("prefixkv:router_index_refused_total", "r"): 6,
        ("prefixkv:router_hash_mismatches_total", "r"): 7,
        ("prefixkv:router_replica_lossy_batches", "r"): 2}


def test_queue_gauges_are_what_a_router_reads():
    from prefixkv.router import ReplicaLoad, from_metrics

    mgr = KVCacheManager(8, 4)
    met = CacheMetrics(model_name="m", engine="3")
    mgr.add_request("a", list(range(1, 10)))  # 3 of 8 blocks
    met.observe(mgr.take_stats(), mgr.usage, num_waiting=4, num_running=1)
    met.observe(mgr.take_stats(), mgr.usage)  # None: the gauges keep their values
    s = samples(met)
    assert s[("vllm:num_requests_waiting", None)] == 4 and s[("vllm:num_requests_running", None)] == 1
    assert from_metrics(met.exposition().decode(), num_blocks=8) == ReplicaLoad(3 / 8, 4, None, 8)


def test_health_metrics_expose_the_load_poller():
    from prefixkv.fleet.metrics import HealthMetrics

    met = HealthMetrics()
    state = {"scrapes": 5, "failures": 2, "stale": True, "stale_spells": 1}
    met.observe_poller({"replicas": {"r": state}})
    met.observe_poller({"replicas": {"r": {**state, "scrapes": 7, "stale": False}}})
    got = {(s.name, s.labels["replica"]): s.value
           for fam in text_string_to_metric_families(met.exposition().decode())
           for s in fam.samples if s.name.startswith("prefixkv:router_load")
           and not s.name.endswith("_created")}
    assert got == {("prefixkv:router_load_scrapes_total", "r"): 7,
                   ("prefixkv:router_load_scrape_failures_total", "r"): 2,
                   ("prefixkv:router_load_stale", "r"): 0,
                   ("prefixkv:router_load_stale_spells_total", "r"): 1}
