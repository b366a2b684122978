"""The content index: duplicated content stays findable, events predict ``lookup``,
the event log is bounded and resynchronises, a failing hash callable changes nothing.

block_size is 4 throughout."""

import pytest

from prefixkv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ConfigError,
    ExtraKeys,
    KVCacheManager,
)
from prefixkv.hashing import chain, encode_tokens, make_hash_fn, token_bytes


class Mirror:
    """A router's view: count of stores minus removals per chain hash."""

    def __init__(self, m: KVCacheManager, mode="xxhash", seed=0):
        self.m, self.count = m, {}
        self.fn, self.root = make_hash_fn(mode, seed)

    def drain(self):
        for ev in self.m.take_events():
            if isinstance(ev, AllBlocksCleared):
                self.count.clear()
            elif isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self.count[h] = self.count.get(h, 0) + 1
            else:
                for h in ev.block_hashes:
                    self.count[h] -= 1
                    if not self.count[h]:
                        del self.count[h]

    def predict(self, prompt, extra=None):
        n = (len(prompt) - 1) // 4
        extras = [extra.base_bytes() if extra else b""] * n
        hashes, _ = chain(self.fn, self.root, token_bytes(encode_tokens(prompt[:n * 4])), extras)
        k = 0
        while k < n and hashes[k] in self.count:
            k += 1
        return 4 * k


def test_issue_repro_a_duplicate_block_keeps_its_content_and_children_findable():
    m = KVCacheManager(8, 4, seed=0, enable_events=True)
    mirror = Mirror(m)
    prompt = [1, 2, 3, 4, 5, 6]
    m.add_request("A", prompt)
    m.add_request("B", prompt)                 # hits A's block 0
    m.append_tokens("A", [7, 8])
    m.append_tokens("B", [7, 8])               # B's block 1 repeats A's: a spare
    m.append_tokens("B", [9, 10, 11, 12])
    m.free("A")                                # A's block 1 is cached, free
    m.add_request("C", list(range(100, 120)))  # 5 blocks: evicts A's block 1
    m.free("C")
    full = prompt + [7, 8, 9, 10, 11, 12]
    assert m.lookup(full + [0]) == 12          # B's identical blocks took over
    mirror.drain()
    assert mirror.predict(full + [0]) == 12
    tokens = m.preempt("B")
    assert m.add_request("B", tokens, resumed=True).num_cached_tokens == 8
    m.check_invariants()


def test_a_spare_goes_empty_when_freed_and_refreshes_the_cached_copy():
    m = KVCacheManager(6, 4, seed=0)
    m.add_request("a", [1, 2, 3, 4, 5])        # 0 full, 1 partial
    m.add_request("b", [1, 2, 3, 4], read_cache=False)  # 2: same content as 0
    assert m.get_block_ids("b") == (2,)
    m.free("a")
    assert m.free_block_order() == [1, 3, 4, 5, 0]
    m.free("b")                                 # 2 is a spare: empty; 0 becomes MRU
    assert m.free_block_order() == [2, 1, 3, 4, 5, 0]
    assert m.num_cached_blocks == 1 and m.lookup([1, 2, 3, 4, 9]) == 4
    m.check_invariants()


def test_events_announce_a_content_once_and_withdraw_it_once():
    m = KVCacheManager(6, 4, seed=0, enable_events=True)
    m.add_request("a", [1, 2, 3, 4, 5])
    m.add_request("b", [1, 2, 3, 4], read_cache=False)   # a spare of block 0
    assert [type(e) for e in m.take_events()] == [BlockStored]
    m.free("a")                                   # the cached copy stays
    m.add_request("x", list(range(30, 50)))       # evicts block 0: b's spare takes over
    assert [(type(e), len(e.block_hashes)) for e in m.take_events()] == [(BlockStored, 5)]
    assert m.lookup([1, 2, 3, 4, 9]) == 4
    m.free("x")
    m.free("b")
    m.add_request("y", list(range(60, 84)))       # evicts everything cached: x's 5 and 2
    kinds = [type(e) for e in m.take_events() for _ in e.block_hashes]  # one per block
    assert kinds.count(BlockRemoved) == 6 and kinds.count(BlockStored) == 6
    m.check_invariants()


def test_the_event_log_is_bounded_and_a_lagging_consumer_resyncs_exactly():
    m = KVCacheManager(16, 4, seed=0, enable_events=True, max_events=5)
    mirror = Mirror(m)
    prompts = [[i] * 4 + [i + 1] * 4 + [0] for i in range(1, 40, 2)]
    for k, p in enumerate(prompts):              # 2 stores per request, evictions later
        m.add_request(k, p)
        m.free(k)
    assert m.events_dropped > 0
    first = m.take_events()
    assert first[0] == AllBlocksCleared()
    assert all(isinstance(e, BlockStored) for e in first[1:])
    assert len(first) - 1 == m.num_cached_blocks
    mirror.count = {}
    for e in first[1:]:
        (h,) = e.block_hashes
        mirror.count[h] = 1
    for p in prompts:
        assert mirror.predict(p) == m.lookup(p)
    assert m.take_events() == []
    m.check_invariants()


class Flaky:
    """A hash_mode callable that works at construction and fails on demand later."""

    def __init__(self):
        self.mode = "ok"

    def __call__(self, data):
        if self.mode == "raise":
            raise RuntimeError("hash service down")
        if self.mode == "none":
            return None
        import hashlib
        return hashlib.sha256(data).digest()


@pytest.mark.parametrize("failure", ["raise", "none"])
def test_a_failing_hash_callable_changes_nothing(failure):
    fn = Flaky()
    m = KVCacheManager(8, 4, hash_mode=fn, enable_events=True)
    m.add_request("a", [1, 2, 3])
    m.take_events()
    fn.mode = failure
    before = (m.free_block_order(), m.stats, m.num_cached_blocks, m.num_tokens("a"))
    with pytest.raises(ConfigError, match="hash_mode callable"):
        m.add_request("b", [5, 6, 7, 8, 9])
    with pytest.raises(ConfigError, match="hash_mode callable"):
        m.append_tokens("a", [4])                 # fills block 0
    with pytest.raises(ConfigError, match="hash_mode callable"):
        m.append_step(["a"], [4])
    assert (m.free_block_order(), m.stats, m.num_cached_blocks, m.num_tokens("a")) == before
    assert m.take_events() == []
    m.check_invariants()
    fn.mode = "ok"
    assert m.append_tokens("a", [4]) == ()
    assert m.lookup([1, 2, 3, 4, 0]) == 4


def test_salted_prompts_mirror_exactly():
    m = KVCacheManager(8, 4, seed=0, enable_events=True)
    mirror = Mirror(m)
    salt = ExtraKeys(cache_salt="t1")
    m.add_request("a", [1, 2, 3, 4, 5], extra=salt)
    mirror.drain()
    assert mirror.predict([1, 2, 3, 4, 5], salt) == m.lookup([1, 2, 3, 4, 5], extra=salt) == 4
    assert mirror.predict([1, 2, 3, 4, 5]) == m.lookup([1, 2, 3, 4, 5]) == 0


def test_a_stored_run_and_its_blocks():
    import dataclasses
    import struct

    from prefixkv.events import BlockStored
    from prefixkv.extra_keys import ExtraKeys, MultiModalInput
    extra = ExtraKeys(cache_salt="s", mm=(MultiModalInput("img", 9, 2),))  # tokens 9, 10
    hs = [b"a" * 16, b"b" * 16, b"c" * 16]
    ev = BlockStored(hs, b"p" * 16, struct.pack("<12I", *range(12)), [7, 8, 9], extra, 1)
    assert (ev.block_size, ev.token_ids, ev.medium) == (4, list(range(12)), "GPU")
    assert ev.block_extra(0) == ExtraKeys(cache_salt="s")  # the run's tokens are 4..15 of
    assert ev.block_extra(1) == extra                      # its request: the image is in
    assert ev.block_extra(2) == ExtraKeys(cache_salt="s")  # block 1 (8..11) alone
    one = ev.block_of(b"b" * 16, 3, "CPU")
    assert one == BlockStored((b"b" * 16,), b"a" * 16, struct.pack("<4I", 4, 5, 6, 7), (3,),
                              extra, 2, "CPU")
    first = ev.block(0, 7, "GPU")
    assert (first.parent_block_hash, first.token_ids, first.first_block) == (b"p" * 16, [0, 1, 2, 3], 1)
    assert first.block(0, 7, "GPU") is first
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.first_block = 0  # type: ignore[misc]
