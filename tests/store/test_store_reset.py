"""``reset_prefix_cache`` with a shared store (a weight update: RL trainers reset after
one in place). Until reset-r23 the reset dropped the device and the host only: the next
admission was served the store's blocks, computed with the old weights, and the
contents computed in the step before the reset were still written after it. Now the
store's blocks are named in a new namespace per reset (``store.link.reset_root``, the
vLLM connector's rule): nothing saved before is found, nothing computed before is
written, and managers that reset as often share again. ``keep_store=True`` drops only
the local caches. Real Redis, block size 4, 8-byte payloads."""

import pytest

from prefixkv import KVCacheManager, RequestError, StorePut
from prefixkv.hashing import make_hash_fn

from .test_shared_store import A, admit, computed, from_store, manager, write


def test_a_reset_leaves_every_block_saved_before_it_unfound(backend, shared):
    m = manager(shared)
    computed(m, backend, "a", A)
    m.free("a")
    assert m.reset_prefix_cache()
    assert from_store(m, A) == 0
    assert m.stats.store_hits == 0
    m.check_invariants()


def test_another_manager_that_did_not_reset_does_not_see_the_blocks_saved_after(backend, shared):
    m, other = manager(shared), manager(shared)
    assert m.reset_prefix_cache()
    puts = computed(m, backend, "a", A)
    assert len(puts) == 3 and backend.held([p.key for p in puts]) == 3
    assert from_store(other, A) == 0


def test_managers_that_reset_as_often_share_again(backend, shared):
    m, other = manager(shared), manager(shared)
    for x in (m, other):
        assert x.reset_prefix_cache() and x.reset_prefix_cache()
    computed(m, backend, "a", A)
    assert from_store(other, A) == 12 and other.stats.store_hits == 12


def test_keep_store_drops_only_the_local_caches(backend, shared):
    m = manager(shared)
    computed(m, backend, "a", A)
    m.free("a")
    assert m.reset_prefix_cache(keep_store=True)
    assert from_store(m, A) == 12 and m.stats.store_hits == 12
    m.check_invariants()


def test_contents_computed_before_a_reset_are_never_written_after_it(backend, shared):
    """The step that computed ``a`` ran, its writes were not planned yet (they go out
    with the next plan): after a reset they would write KV of the old weights under the
    new names, to be served to every replica that reset alike. (It held on main too:
    the reset empties every block, and a write goes out only for a block that still
    holds the content it recorded; the reset now also drops the list itself.)"""
    m = manager(shared)
    admit(m, "a", A)
    assert not write(backend, m.take_kv_ops())      # a's step: computed, writes next plan
    m.free("a")
    assert m.reset_prefix_cache()
    assert [op for op in m.take_kv_ops() if isinstance(op, StorePut)] == []
    twin = manager(shared)
    assert twin.reset_prefix_cache()
    assert from_store(twin, A) == 0


def test_the_keys_after_a_reset_carry_the_reset_roots_tag_within_the_namespace(backend, shared):
    """After the n-th reset a key is ``<namespace prefix><reset_tag(reset_root(first
    root, n))><chain hash>``, whatever the manager did meanwhile (one rule, shared with
    the connector), and stays under the namespace's prefix: a tenant's ACL key pattern
    (``SharedStore.key_prefix``) still covers it."""
    from prefixkv import ExtraKeys
    from prefixkv.store.link import reset_root, reset_tag

    m = manager(shared)
    m.reset_prefix_cache()
    m.reset_prefix_cache()
    salted = ExtraKeys(cache_salt="t7")
    (put, *_) = computed(m, backend, "a", A)
    (tenant, *_) = computed(m, backend, "b", A, extra=salted)
    fn, root = make_hash_fn("sha256", None)
    for p, salt in ((put, None), (tenant, "t7")):
        namespace = shared.key_prefix(4, "sha256", cache_salt=salt)
        assert p.key.startswith(namespace + reset_tag(reset_root(fn, root, 2)))
        assert len(p.key) == len(namespace) + 25 + 64      # (24 hex, a colon, sha256 hex)


def test_a_refused_reset_changes_nothing(backend, shared):
    m, other = manager(shared), manager(shared)
    computed(m, backend, "a", A)
    assert not m.reset_prefix_cache()                # a holds its blocks
    m.free("a")
    assert m.reset_prefix_cache(keep_store=True)
    assert from_store(m, A) == 12 and from_store(other, A) == 12


@pytest.mark.parametrize("flag", [None, 1, "yes"])
def test_keep_store_must_be_a_bool(backend, shared, flag):
    m = manager(shared)
    computed(m, backend, "a", A)
    m.free("a")
    with pytest.raises(RequestError, match="keep_store"):
        m.reset_prefix_cache(keep_store=flag)
    assert m.lookup(A) == 12                        # nothing changed


def test_a_manager_without_a_store_resets_as_before():
    m = KVCacheManager(8, 4)
    m.add_request("a", A)
    m.free("a")
    assert m.lookup(A) == 12
    assert m.reset_prefix_cache() and m.lookup(A) == 0
    m.check_invariants()
