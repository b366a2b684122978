"""``uncache_blocks`` (vLLM's ``evict_blocks``: a load failed) and the store's writes.
The blocks a step computed on top of a block whose KV turned out invalid hold invalid KV
too (the engine recomputes from the first invalid block): none of them may be written to
the shared store, where its key (the chain hash, the same for every replica) would serve
that KV to whoever reads the chain once another replica stored the blocks before it."""

import hashlib

from prefixkv import KVCacheManager, StoreFetched, StorePut
from prefixkv.store import SharedStore, encode_value
from waiting import LIVE

from .conftest import always
from .test_shared_store import admit

BS = 4
A = list(range(1, 18))  # four full blocks + 1


def kv(tokens):
    """A block's KV in a no-cache run: a digest of every token up to its end (8 bytes)."""
    return hashlib.sha256(repr(tokens).encode()).digest()[:8]


def manager(shared):
    return KVCacheManager(12, BS, hash_mode="sha256", host_blocks=6, store=shared)


def puts(m):
    return [op for op in m.take_kv_ops() if isinstance(op, StorePut)]


def test_blocks_computed_on_top_of_an_uncached_block_are_not_written(backend, layout):
    shared = SharedStore(backend, layout, cost=always(), timeout=LIVE)
    bad = manager(shared)
    assert admit(bad, "b", A).num_cached_tokens == 0     # computes A in one step
    bad.take_kv_ops()
    good = manager(shared)                           # another replica computes A right
    assert admit(good, "g", A).num_cached_tokens == 0
    good.take_kv_ops()
    backend.put([(op.key, encode_value(op.head, kv(A[:BS * (j + 1)])))
                 for j, op in enumerate(puts(good))])
    blocks = bad.get_block_ids("b")
    # bad's load of block 1 failed: its KV, and what the step computed on it, is junk
    bad.uncache_blocks([blocks[1]])
    bad.check_invariants()
    written = puts(bad)
    # before: StorePut of blocks 2 and 3 (computed on top of block 1), written over the
    # good replica's values; a reader then got block 2's junk, which passed every check
    assert [blocks.index(op.src) for op in written] == [0]
    backend.put([(op.key, encode_value(op.head, kv(A[:BS]) if op.src == blocks[0] else b"junk" * 2))
                 for op in written])
    reader = manager(shared)
    assert admit(reader, "r", A).num_cached_tokens == 16
    got = [bytes(op.payload) for op in reader.take_kv_ops() if isinstance(op, StoreFetched)]
    assert got == [kv(A[:BS * (j + 1)]) for j in range(len(got))]
    assert len(got) == 4


def test_a_hit_block_uncached_drops_the_writes_of_the_blocks_computed_after_it(backend, layout):
    """Found by the tiers reference machine: ``b`` hit blocks 0 and 1 and computed 2
    and 3; block 0 then turned out invalid, named alone. Block 1, a hit, has no pending
    write, so the writes of 2 and 3 (whose parent is block 1) were kept."""
    m = manager(SharedStore(backend, layout, cost=always(), timeout=LIVE))
    admit(m, "a", A[:8] + [0])
    m.take_kv_ops()
    assert len(puts(m)) == 2
    assert admit(m, "b", A).num_cached_tokens == 8
    m.take_kv_ops()
    m.uncache_blocks([m.get_block_ids("b")[0]])
    m.check_invariants()
    assert puts(m) == []
