"""Every documented ``Raises:``: a typed ValueError subclass, and no state change."""

import re

import pytest

from prefixkv import (
    MAX_BLOCKS,
    ConfigError,
    ContiguousAllocator,
    ExtraKeys,
    ExtraKeysError,
    KVCacheManager,
    MultiModalInput,
    PagedAllocator,
    RequestError,
    TokenError,
)
from prefixkv.errors import check_positive
from prefixkv.event_log import NullSink
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window
from prefixkv.tiers import HostTier


@pytest.fixture
def m():
    m = KVCacheManager(8, 4, seed=0, vocab_size=100)
    m.add_request("live", [1, 2, 3, 4, 5])
    return m


def state(m):
    return (m.free_block_order(), m.stats, m.num_cached_blocks,
            {r: m.get_block_ids(r) for r in ("live",) if _live(m, r)})


def _live(m, rid):
    try:
        m.get_block_ids(rid)
        return True
    except RequestError:
        return False


@pytest.mark.parametrize("kwargs", [
    dict(num_blocks=0), dict(num_blocks=-1), dict(num_blocks=2.0), dict(num_blocks=True),
    dict(block_size=0), dict(block_size="16"), dict(vocab_size=0),
    dict(hash_mode="md5"), dict(hash_mode=lambda data: 7), dict(hash_mode=lambda data: b""),
    dict(seed=-1), dict(seed="abc"), dict(seed=1.5),
    dict(enable_caching="no"), dict(enable_events=1), dict(max_events=0),
    dict(hash_mode=lambda: b"x"), dict(hash_mode=lambda data: 1 // 0),
    dict(num_blocks=2**62), dict(num_blocks=MAX_BLOCKS + 1),
    dict(host_blocks=2**62), dict(host_blocks=MAX_BLOCKS + 1),
])
def test_bad_config(kwargs):
    args = dict(num_blocks=8, block_size=4) | kwargs
    with pytest.raises(ConfigError):
        KVCacheManager(**args)


STORE_RULE = ("store must be a SharedStore, with enable_caching=True and host_blocks > 0 (store "
              "hits land in host slots), got ")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(block_size=0), "block_size must be a positive int, got 0"),
    (dict(block_size="16"), "block_size must be a positive int, got '16'"),
    (dict(block_size=0, enable_caching=False), "block_size must be a positive int, got 0"),
    (dict(host_blocks=-1), "host_blocks must be a positive int, got -1"),
    (dict(host_blocks=1.5), "host_blocks must be a positive int, got 1.5"),
    (dict(host_blocks=True), "host_blocks must be a positive int, got True"),
    (dict(host_blocks=0.0), "host_blocks must be an int >= 0, got 0.0"),
    (dict(host_blocks=None), "host_blocks must be an int >= 0, got None"),
    (dict(store="redis://", host_blocks=4), STORE_RULE + "'redis://', enable_caching=True, host_blocks=4"),
])
def test_bad_config_is_named_by_its_own_check(kwargs, message):
    """Each argument's own check answers, not a later step it would break (mutants-r23:
    without ``block_size``'s, ``host_blocks``' or ``store``'s check another error, or
    none, came; the content index checks ``block_size`` again, but none is made without
    caching)."""
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        KVCacheManager(**(dict(num_blocks=8, block_size=4) | kwargs))


@pytest.mark.parametrize("call, error", [
    (lambda m: m.add_request("x", []), TokenError),
    (lambda m: m.add_request("x", [1, -1]), TokenError),
    (lambda m: m.add_request("x", [1, 2**32]), TokenError),
    (lambda m: m.add_request("x", [1, 100]), TokenError),   # >= vocab_size
    (lambda m: m.add_request("x", [1, 2.5]), TokenError),
    (lambda m: m.add_request("x", ["a"]), TokenError),
    (lambda m: m.add_request("live", [1]), RequestError),
    (lambda m: m.add_request(["unhashable"], [1]), RequestError),
    (lambda m: m.add_request("x", [1], extra={"cache_salt": "a"}), ExtraKeysError),
    (lambda m: m.add_request("x", [1, 2], extra=ExtraKeys(mm=(MultiModalInput("h", 1, 5),))),
     ExtraKeysError),
    (lambda m: m.add_request("x", [1], num_new_tokens=0), RequestError),
    (lambda m: m.lookup([]), TokenError),
    (lambda m: m.append_tokens("nope", [1]), RequestError),
    (lambda m: m.append_tokens("live", [1, 1000]), TokenError),
    (lambda m: m.extend("live", 1), RequestError),          # nothing left to schedule
    (lambda m: m.extend("nope", 1), RequestError),
    (lambda m: m.fork("nope", "c"), RequestError),
    (lambda m: m.fork("live", "live"), RequestError),
    (lambda m: m.free("nope"), RequestError),
    (lambda m: m.preempt("nope"), RequestError),
    (lambda m: m.get_block_ids("nope"), RequestError),
    # containers and flags that are not what they seem (read as packed bytes, or truthy)
    (lambda m: m.add_request("x", b"abcd"), TokenError),
    (lambda m: m.add_request("x", bytearray(b"abcd")), TokenError),
    (lambda m: m.add_request("x", memoryview(b"abcd")), TokenError),
    (lambda m: m.add_request("x", {1: 2}), TokenError),
    (lambda m: m.add_request("x", {1, 2}), TokenError),
    (lambda m: m.add_request("x", "12"), TokenError),
    (lambda m: m.add_request("x", None), TokenError),
    (lambda m: m.add_request("x", 7), TokenError),
    (lambda m: m.add_request("x", [True, 2]), TokenError),
    (lambda m: m.add_request("x", (1, False)), TokenError),
    (lambda m: m.add_request("x", [1], resumed="no"), RequestError),
    (lambda m: m.add_request("x", [1], read_cache="no"), RequestError),
    (lambda m: m.add_request("x", [1], require_full_fit=1), RequestError),
    (lambda m: m.add_request("x", [1], num_lookahead_tokens=-1), RequestError),
    (lambda m: m.append_tokens("live", None), TokenError),
    (lambda m: m.append_tokens("live", 5), TokenError),
    (lambda m: m.append_tokens("live", [True]), TokenError),
    (lambda m: m.append_tokens("live", b"a"), TokenError),
    (lambda m: m.append_step(["live"], [1, 2]), RequestError),
    (lambda m: m.append_step(["live", "live"], [1, 2]), RequestError),
    (lambda m: m.append_step(["live", "nope"], [1, 2]), RequestError),
    (lambda m: m.append_step(["live"], [1000]), TokenError),
    (lambda m: m.append_step("live", [1]), RequestError),
    (lambda m: m.reserve("live", -1), RequestError),
    (lambda m: m.reserve("nope", 1), RequestError),
    (lambda m: m.uncache_blocks([8]), RequestError),
    (lambda m: m.uncache_blocks([0, -1]), RequestError),
    (lambda m: m.uncache_blocks([True]), RequestError),
    (lambda m: m.uncache_blocks(None), RequestError),   # was a TypeError
    (lambda m: m.uncache_blocks(3), RequestError),
])
def test_bad_calls_raise_typed_errors_before_any_change(m, call, error):
    before = state(m)
    with pytest.raises(error) as info:
        call(m)
    assert isinstance(info.value, ValueError)
    assert state(m) == before
    m.check_invariants()


def test_double_free(m):
    m.free("live")
    with pytest.raises(RequestError, match="already freed"):
        m.free("live")
    m.check_invariants()


def test_append_before_prefill_is_scheduled_and_fork_then():
    m = KVCacheManager(8, 4, seed=0)
    m.add_request("r", list(range(10)), num_new_tokens=3)
    with pytest.raises(RequestError, match="extend"):
        m.append_tokens("r", [1])
    with pytest.raises(RequestError, match="prefill"):
        m.fork("r", "c")
    with pytest.raises(RequestError, match=r"\[1, 7\]"):
        m.extend("r", 8)


@pytest.mark.parametrize("make", [
    lambda: ExtraKeys(lora=""), lambda: ExtraKeys(cache_salt=3), lambda: ExtraKeys(mm=[]),
    lambda: ExtraKeys(mm=("h",)), lambda: MultiModalInput("", 0, 1),
    lambda: MultiModalInput("h", -1, 1), lambda: MultiModalInput("h", 0, 0),
    lambda: MultiModalInput(5, 0, 1), lambda: MultiModalInput("h", 0.0, 1),
])
def test_malformed_extra_keys(make):
    with pytest.raises(ExtraKeysError):
        make()


def test_contiguous_allocator_errors():
    with pytest.raises(ConfigError):
        ContiguousAllocator(8, 4, max_model_len=0)
    a = ContiguousAllocator(8, 4, max_model_len=8)
    with pytest.raises(TokenError):
        a.add_request("x", list(range(9)))
    a.add_request("x", list(range(8)))
    with pytest.raises(TokenError, match="max_model_len"):
        a.append_tokens("x", [1])
    with pytest.raises(RequestError):
        a.add_request("x", [1])
    with pytest.raises(RequestError):
        a.free("y")


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["x"]])
def test_single_token_decode_path_rejects_bad_ids_without_change(bad):
    m = KVCacheManager(4, 4, seed=0)   # no vocab_size: the one-token fast path
    m.add_request("a", [1, 2, 3, 4, 5])
    with pytest.raises(TokenError):
        m.append_tokens("a", bad)
    assert m.num_scheduled_tokens("a") == 5 and m.preempt("a") == (1, 2, 3, 4, 5)


@pytest.mark.parametrize("count", [-1, 6, 2.0])
def test_free_with_a_computed_count_out_of_range(m, count):
    before = state(m)
    with pytest.raises(RequestError, match=r"\[0, 5\]"):
        m.free("live", num_computed_tokens=count)
    assert state(m) == before


def test_generators_are_token_ids_everywhere(m):
    assert m.add_request("g", (t for t in [1, 2, 3])).num_new_tokens == 3
    assert m.append_tokens("g", (t for t in [4])) == ()
    assert m.num_tokens("g") == 4
    m.check_invariants()


@pytest.mark.parametrize("field", ["lora", "cache_salt"])
def test_a_lone_surrogate_is_refused_at_construction(field):
    with pytest.raises(ExtraKeysError, match="UTF-8"):
        ExtraKeys(**{field: "tenant\udc00"})
    with pytest.raises(ExtraKeysError, match="UTF-8"):
        MultiModalInput("img\ud800", 0, 1)


def test_lora_id_needs_a_name_and_is_not_hashed():
    with pytest.raises(ExtraKeysError):
        ExtraKeys(lora_id=3)
    with pytest.raises(ExtraKeysError):
        ExtraKeys(lora="a", lora_id=True)
    assert ExtraKeys(lora="a", lora_id=3).base_bytes() == ExtraKeys(lora="a").base_bytes()


@pytest.mark.parametrize("make", [
    lambda n: HybridKVCacheManager([full_attention(), sliding_window(8)], n, 4),
    lambda n: PagedAllocator(n, 4),
    lambda n: ContiguousAllocator(n, 4, max_model_len=8),
    lambda n: HostTier(n, NullSink()),
], ids=["hybrid", "paged", "contiguous", "host-tier"])
@pytest.mark.parametrize("size", [2**62, MAX_BLOCKS + 1])
def test_absurd_sizes_are_refused_before_anything_is_built(make, size):
    with pytest.raises(ConfigError, match=f"at most {MAX_BLOCKS:,}"):
        make(size)


def test_the_size_bound_itself_is_allowed():
    assert check_positive("num_blocks", MAX_BLOCKS, MAX_BLOCKS) == MAX_BLOCKS == 2**24


@pytest.mark.parametrize("hash_mode", [lambda: b"x", lambda data: 1 // 0, lambda data: None])
def test_a_hash_mode_callable_is_probed_at_construction(hash_mode):
    with pytest.raises(ConfigError, match="hash_mode callable"):
        KVCacheManager(8, 4, hash_mode=hash_mode)
    with pytest.raises(ConfigError, match="hash_mode callable"):
        HybridKVCacheManager([full_attention()], 8, 4, hash_mode=hash_mode)


class _HashRaises:
    def __hash__(self):
        raise ValueError("no hash")


class _EqRaises:  # collides with "live": the dict compares, and that raises
    def __hash__(self):
        return hash("live")

    def __eq__(self, other):
        raise RuntimeError("no eq")


_CALLS = {
    "add_request": lambda m, r: m.add_request(r, [1, 2]),
    "fork child": lambda m, r: m.fork("live", r),
    "fork parent": lambda m, r: m.fork(r, "child"),
    "free": lambda m, r: m.free(r),
    "preempt": lambda m, r: m.preempt(r),
    "get_block_ids": lambda m, r: m.get_block_ids(r),
    "num_tokens": lambda m, r: m.num_tokens(r),
    "extend": lambda m, r: m.extend(r, 1),
    "append_tokens": lambda m, r: m.append_tokens(r, [1]),
    "append_step": lambda m, r: m.append_step(["live", r], [1, 2]),
    "reserve": lambda m, r: m.reserve(r, 1),
}


@pytest.mark.parametrize("make", [
    lambda: KVCacheManager(8, 4, seed=0),
    lambda: HybridKVCacheManager([full_attention(), sliding_window(4)], 8, 4, seed=0),
], ids=["manager", "hybrid"])
@pytest.mark.parametrize("bad", [_HashRaises, _EqRaises])
@pytest.mark.parametrize("call", list(_CALLS))
def test_a_request_id_that_cannot_be_looked_up_is_a_request_error(make, bad, call):
    m = make()
    m.add_request("live", [1, 2, 3, 4, 5])
    before = (m.free_block_order(), m.stats, m.get_block_ids("live"), m.num_tokens("live"))
    with pytest.raises(RequestError, match="request id must be hashable"):
        _CALLS[call](m, bad())
    assert (m.free_block_order(), m.stats, m.get_block_ids("live"), m.num_tokens("live")) == before
    m.check_invariants()


@pytest.mark.parametrize("make", [
    lambda: KVCacheManager(8, 4, seed=0),
    lambda: HybridKVCacheManager([full_attention()], 8, 4, seed=0),
    lambda: ContiguousAllocator(8, 4, max_model_len=8),
], ids=["manager", "hybrid", "contiguous"])
def test_extend_with_nothing_left_to_schedule_says_so(make):
    m = make()
    m.add_request("a", [1, 2, 3])
    with pytest.raises(RequestError, match="'a' has no known token left to schedule"):
        m.extend("a", 1)
    assert m.num_scheduled_tokens("a") == 3


@pytest.mark.parametrize("make", [
    lambda: KVCacheManager(8, 4, seed=0),
    lambda: HybridKVCacheManager([full_attention(), sliding_window(4)], 8, 4, seed=0),
], ids=["manager", "hybrid"])
@pytest.mark.parametrize("read", ["num_tokens", "num_scheduled_tokens", "get_block_ids"])
def test_reading_an_unknown_or_freed_request_is_a_request_error(make, read):
    """The read calls' documented Raises: an id never admitted, and one already freed."""
    m = make()
    m.add_request("gone", [1, 2, 3, 4, 5])
    m.free("gone")
    for rid in ("never", "gone"):
        with pytest.raises(RequestError, match="unknown request"):
            getattr(m, read)(rid)
    m.check_invariants()


def test_a_count_bounded_below_only_states_its_bound_plainly(m):
    """``num_new_tokens must be an int >= 1``; before: ``an int in >= 1``."""
    with pytest.raises(RequestError, match=r"num_new_tokens must be an int >= 1, got -1$"):
        m.add_request("q", [1, 2, 3], num_new_tokens=-1)
    m.check_invariants()


@pytest.mark.parametrize("make", [
    lambda: KVCacheManager(8, 4, seed=0),
    lambda: HybridKVCacheManager([full_attention(), sliding_window(4)], 8, 4, seed=0),
], ids=["manager", "hybrid"])
def test_an_unknown_id_of_another_type_than_the_live_ones_says_so(make):
    """An engine that admits by its request id (str) and frees by its batch index (int)
    is told the types differ; an unknown id of the live ids' type is not."""
    m = make()
    m.add_request("req-0", [1, 2, 3, 4, 5])
    with pytest.raises(RequestError, match=r"1 live; their ids are str, this one is int\)$"):
        m.free(0)
    with pytest.raises(RequestError, match=r"already freed; 1 live\)$"):
        m.free("req-1")
    assert m.get_block_ids("req-0")
    m.check_invariants()


def test_a_live_id_given_again_says_when_it_is_free_again(m):
    """add_request and fork onto a live id: the message says the id stays taken until
    free or preempt. Before: ``request 'live' is already live``, nothing more."""
    m.add_request("other", [1, 2, 3])
    for call in (lambda: m.add_request("other", [1, 2]), lambda: m.fork("live", "other")):
        with pytest.raises(RequestError, match=r"already live \(it holds blocks until free or preempt"):
            call()
    m.check_invariants()


def test_host_memory_without_a_store_says_what_the_manager_lacks():
    """attach_host_memory on a manager built without ``store=`` names the argument."""
    m = KVCacheManager(8, 4, host_blocks=4)
    with pytest.raises(ConfigError, match=r"built without store= \(host_blocks=N, store=SharedStore\)"):
        m.attach_host_memory([[memoryview(bytearray(8))]] * 4)


@pytest.mark.parametrize("groups", [["full"], [], 8])
def test_groups_that_are_not_specs_name_the_calls_that_make_them(groups):
    """A hybrid manager given names, nothing, or its arguments swapped (num_blocks
    first) is told which calls make a GroupSpec and the argument order. Before: ``groups
    must be a non-empty sequence of GroupSpec, got ['full']``."""
    with pytest.raises(ConfigError, match=r"full_attention\(\), sliding_window\(window\), "
                                          r"chunked_local\(chunk\) or mamba\(\): "
                                          r"HybridKVCacheManager\(groups, num_blocks, block_size\)"):
        HybridKVCacheManager(groups, 8, 4)
