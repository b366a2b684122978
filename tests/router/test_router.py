"""Router policies, scoring and bookkeeping, fed by real managers' events."""

import pytest

from prefixkv import KVCacheManager
from prefixkv.errors import ConfigError
from prefixkv.fleet.wire import encode_batch
from prefixkv.router import Cleared, Removed, Router, RouterError, Stored, decode_batch

BS = 4


def feed(router, replica, mgr):
    router.apply(replica, decode_batch(encode_batch(mgr.take_events(), block_size=BS))[1])


def managers(n):
    return [KVCacheManager(256, BS, hash_mode="sha256", enable_events=True) for _ in range(n)]


def test_prefix_follows_the_replica_holding_the_prompt():
    router = Router(["a", "b", "c"], block_size=BS)
    mgrs = managers(3)
    prompt = list(range(1, 40))
    mgrs[1].add_request("x", prompt)
    feed(router, "b", mgrs[1])
    assert router.cached_tokens(prompt + [7]) == {"a": 0, "b": 36, "c": 0}
    choice = router.route(prompt + [7])
    assert choice.replica == "b" and choice.cached_tokens == 36
    assert router.in_flight == {"a": 0, "b": 1, "c": 0}
    router.finish("b")
    # the real manager confirms the prediction
    assert mgrs[1].lookup(prompt + [7]) == 36


def test_longest_run_wins_and_eviction_is_seen():
    router = Router(["a", "b"], block_size=BS, load_weight=0)
    ma, mb = managers(2)
    prompt = list(range(1, 33))
    ma.add_request("x", prompt[:12])
    mb.add_request("x", prompt)
    feed(router, "a", ma)
    feed(router, "b", mb)
    assert router.route(prompt).replica == "b"
    router.apply("b", [Removed((router.prompt_hashes(prompt)[0],), "GPU")])
    assert router.cached_tokens(prompt)["b"] == 0
    assert router.route(prompt).replica == "a"
    router.apply("a", [Cleared()])
    assert router.cached_tokens(prompt) == {"a": 0, "b": 0}


def test_bounded_load_spreads_a_shared_prefix():
    router = Router([f"r{i}" for i in range(4)], block_size=BS, balance=1.25)
    prompt = list(range(1, 17))
    router.apply("r0", [Stored(tuple(router.prompt_hashes(prompt)), None, "GPU")])
    picks = [router.route(prompt).replica for _ in range(40)]
    counts = [picks.count(r) for r in router.replicas]
    assert max(counts) <= 1.25 * (sum(counts) / 4) + 1
    assert counts[0] == max(counts)


def test_cpu_blocks_count_less():
    router = Router(["a", "b"], block_size=BS, load_weight=0, cpu_weight=0.5)
    prompt = list(range(1, 17))
    hs = tuple(router.prompt_hashes(prompt))
    router.apply("a", [Stored(hs[:3], None, "GPU")])
    router.apply("b", [Stored(hs, None, "CPU")])  # 4 on CPU = 2 GPU blocks' worth
    assert router.route(prompt).replica == "a"


def test_baseline_policies():
    rr = Router(["a", "b", "c"], block_size=BS, policy="round-robin")
    assert [rr.route([1]).replica for _ in range(4)] == ["a", "b", "c", "a"]
    ll = Router(["a", "b"], block_size=BS, policy="least-loaded")
    assert ll.route([1]).replica == "a" and ll.route([1]).replica == "b"
    ll.finish("a")
    assert ll.route([1]).replica == "a" and ll.routed == {"a": 2, "b": 1}


def test_silent_replicas_are_skipped_until_heard_again():
    now = [0.0]
    router = Router(["a", "b"], block_size=BS, stale_after=5, clock=lambda: now[0],
                    policy="round-robin")
    router.apply("a", [])
    router.apply("b", [])
    now[0] = 4.0
    router.apply("a", [])
    now[0] = 7.0  # b silent for 7 s, a for 3 s
    assert router.live() == ["a"]
    assert {router.route([1]).replica for _ in range(3)} == {"a"}
    now[0] = 20.0  # everyone silent: route to all rather than to no one
    assert {router.route([1]).replica for _ in range(2)} == {"a", "b"}


def test_hash_format_bytes_and_extra_keys():
    from prefixkv import ExtraKeys
    m = KVCacheManager(64, BS, hash_mode="xxhash", seed=5, enable_events=True)
    salt = ExtraKeys(cache_salt="t")
    prompt = list(range(1, 13))
    m.add_request("x", prompt, extra=salt)
    router = Router(["a"], block_size=BS, hash_mode="xxhash", seed=5, hash_format="bytes")
    router.apply("a", decode_batch(encode_batch(m.take_events(), block_size=BS,
                                                hash_format="bytes"))[1])
    assert router.cached_tokens(prompt, salt) == {"a": 12}
    assert router.cached_tokens(prompt) == {"a": 0}


def test_errors():
    with pytest.raises(RouterError, match="distinct"):
        Router([], block_size=BS)
    with pytest.raises(RouterError, match="distinct"):
        Router(["a", "a"], block_size=BS)
    with pytest.raises(RouterError, match="policy"):
        Router(["a"], block_size=BS, policy="random")
    with pytest.raises(RouterError, match="hash_format"):
        Router(["a"], block_size=BS, hash_format="hex")
    with pytest.raises(RouterError, match="balance"):
        Router(["a"], block_size=BS, balance=0.5)
    with pytest.raises(ConfigError):
        Router(["a"], block_size=0)
    with pytest.raises(ConfigError, match="seed"):
        Router(["a"], block_size=BS, hash_mode="xxhash")
    router = Router(["a"], block_size=BS)
    with pytest.raises(RouterError, match="unknown replica"):
        router.apply("z", [])
    with pytest.raises(RouterError, match="unknown replica"):
        router.forget("z")
    with pytest.raises(RouterError, match="no request in flight"):
        router.finish("a")


def test_two_routers_share_a_redis_index(redis_server):
    """One router instance applies the events, another routes from the same index."""
    redis = pytest.importorskip("redis")
    from prefixkv.router.redis_index import RedisIndex

    other_client = redis.Redis(unix_socket_path=redis_server.socket_file)
    writer = Router(["a", "b"], block_size=BS, index=RedisIndex(redis_server, "shared"))
    reader = Router(["a", "b"], block_size=BS, index=RedisIndex(other_client, "shared"))
    mgr = KVCacheManager(64, BS, hash_mode="sha256", enable_events=True)
    prompt = list(range(1, 30))
    mgr.add_request("x", prompt)
    feed(writer, "b", mgr)
    assert reader.cached_tokens(prompt) == {"a": 0, "b": 28}
    assert reader.route(prompt).replica == "b"
    writer.forget("b")
    assert reader.cached_tokens(prompt)["b"] == 0


def test_route_rejects_a_bad_prompt_before_counting_it():
    from prefixkv.errors import ExtraKeysError, TokenError
    router = Router(["a"], block_size=BS)
    with pytest.raises(TokenError):
        router.route([-1] * 8)
    with pytest.raises(ExtraKeysError):
        router.route([1] * 8, extra="salt")
    assert router.in_flight == {"a": 0} and router.routed == {"a": 0}
