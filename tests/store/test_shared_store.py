"""The shared store on a real Redis: two managers, one store, exact plans; values that
fail the content check are misses; salts isolate; configuration errors. block_size 4,
8-byte payloads (the KV bytes a simulated engine writes: the block id, repeated)."""

import time

import pytest

from prefixkv import (
    BlockLoads,
    BlockStored,
    ConfigError,
    ExtraKeys,
    KVCacheManager,
    StoreFetched,
    StorePut,
    StoreWait,
)
from prefixkv.store import SharedStore, StoreLayout, StoreWriter, decode_value, encode_value
from prefixkv.store.record import block_head
from waiting import LIVE, PATIENCE

from .conftest import always

A = list(range(1, 14))                  # three full blocks + 1


def manager(shared, num_blocks=8, host_blocks=4, **kw):
    kw.setdefault("hash_mode", "sha256")
    return KVCacheManager(num_blocks, 4, host_blocks=host_blocks, store=shared, **kw)


def payload(block_id):
    return bytes([block_id]) * 8


def write(backend, ops):
    """The engine's part of the plan for StorePut: each block's KV is its id, repeated."""
    puts = [op for op in ops if isinstance(op, StorePut)]
    backend.put([(op.key, encode_value(op.head, payload(op.src))) for op in puts])
    return puts


def admit(m, rid, prompt, **kw):
    """The engine's loop for one request: admit it, or wait for its store fetch."""
    while isinstance(adm := m.add_request(rid, prompt, **kw), StoreWait):
        deadline = time.monotonic() + PATIENCE
        while rid not in m.poll_store():
            assert time.monotonic() < deadline, "a fetch that never ended"
            time.sleep(0.001)
    return adm


def from_store(m, prompt, **kw):
    """Tokens of ``prompt`` an admission on ``m`` finds on the device, in host slots
    and in the store (the request is freed again)."""
    adm = admit(m, "probe", prompt, **kw)
    m.free("probe")
    return adm.num_cached_tokens


def computed(m, backend, rid, prompt, **kw):
    """Admit ``rid`` and run two steps, so the store holds its full blocks."""
    admit(m, rid, prompt, **kw)
    assert not write(backend, m.take_kv_ops())       # step 1: computing
    return write(backend, m.take_kv_ops())           # step 2: written


def test_a_second_manager_loads_what_the_first_computed(backend, shared):
    m1, m2 = manager(shared), manager(shared)
    puts = computed(m1, backend, "a", A)
    assert [p.src for p in puts] == [0, 1, 2]
    assert backend.held([p.key for p in puts]) == 3
    assert m2.lookup(A) == 0                         # a lookup never asks the store
    adm = admit(m2, "b", A)
    assert (adm.block_ids, adm.num_cached_tokens, adm.num_new_tokens) == ((0, 1, 2, 3), 12, 1)
    assert m2.take_kv_ops() == [
        StoreFetched(0, payload(0)), StoreFetched(1, payload(1)), StoreFetched(2, payload(2)),
        BlockLoads((0, 1, 2), (0, 1, 2))]
    assert (m2.stats.hits, m2.stats.store_hits, m2.stats.host_hits) == (12, 12, 0)
    assert m2.take_kv_ops() == []                    # loaded content is not written back
    m2.check_invariants()
    m2.free("b")
    assert m2.lookup(A) == 12                        # now on the device
    assert m2.stats.store_errors == 0


def test_writes_follow_the_step_that_computed_and_skip_what_was_never_computed(backend, shared):
    m = manager(shared)
    admit(m, "a", A)
    m.free("a", num_computed_tokens=4)               # blocks 1, 2 never computed
    m.take_kv_ops()
    assert [p.src for p in m.take_kv_ops()] == [0]
    admit(m, "b", [7] * 9, num_new_tokens=4)        # chunked prefill: one block a step
    assert m.take_kv_ops() == []
    m.extend("b", 4)
    # b's block 0, now computed: a's block 3, reused first (a's tail, vLLM 0.33's order)
    assert [p.src for p in m.take_kv_ops()] == [3]
    assert [p.src for p in m.take_kv_ops()] == [2]


def test_a_hit_continues_from_device_to_store(backend, shared):
    m1, m2 = manager(shared), manager(shared)
    computed(m1, backend, "a", A)
    m2.add_request("x", A[:4] + [0], read_cache=False)  # m2 computes block 0 itself
    m2.take_kv_ops()
    m2.free("x")
    adm = admit(m2, "b", A)
    assert adm.num_cached_tokens == 12 and adm.block_ids[0] == 0
    ops = m2.take_kv_ops()
    assert [type(op) for op in ops] == [StorePut, StoreFetched, StoreFetched, BlockLoads]
    assert len(ops[3].src) == 2
    assert [op.payload for op in ops[1:3]] == [payload(1), payload(2)]  # m1's blocks 1, 2
    assert m2.stats.store_hits == 8


def bad_values(good: bytes, head: bytes, foreign_head: bytes):
    tail = good[len(head):]
    flipped = bytearray(good)
    flipped[-1] ^= 1
    return {
        "corrupted payload": bytes(flipped),
        "truncated": good[:-1],
        "longer": good + b"\0",
        "foreign layout": foreign_head + tail,
        "empty": b"",
    }


@pytest.mark.parametrize("case", ["corrupted payload", "truncated", "longer", "foreign layout",
                                  "empty", "other tokens"])
def test_a_value_that_fails_the_check_is_a_miss_and_ends_the_run(backend, shared, layout, case):
    m1, m2 = manager(shared), manager(shared)
    puts = computed(m1, backend, "a", A)
    key, head = puts[1].key, puts[1].head
    good = encode_value(head, payload(1))
    if case == "other tokens":  # a collision: another block's value under this key
        bad = encode_value(puts[2].head, payload(1))
    else:
        other = StoreLayout(layout.model, "bfloat16", 8).digest()
        bad = bad_values(good, head, head[:4] + other + head[20:])[case]
    backend.put([(key, bad)])
    assert from_store(m2, A) == 4                     # block 0 only: the run stops at 1
    assert (m2.stats.store_errors, m2.stats.store_rejected) == (0, 1)   # counted, not absent


def test_decode_value_accepts_exactly_one_value():
    head = block_head(b"L" * 16, 4, b"p" * 32, b"t" * 16, b"")
    good = encode_value(head, b"kv" * 4)
    assert decode_value(good, head, 8) == b"kv" * 4
    assert decode_value(good, head, 7) is None
    assert decode_value(None, head, 8) is None
    assert decode_value(bytearray(good), head, 8) is None
    assert decode_value(good, block_head(b"L" * 16, 4, b"p" * 32, b"t" * 16, b"x"), 8) is None


def test_salts_and_layouts_isolate(backend, shared, layout):
    tenant_a, tenant_b = ExtraKeys(cache_salt="a"), ExtraKeys(cache_salt="b")
    m1 = manager(shared)
    puts = computed(m1, backend, "a", A, extra=tenant_a)
    assert from_store(manager(shared), A, extra=tenant_a) == 12
    assert from_store(manager(shared), A, extra=tenant_b) == 0
    assert from_store(manager(shared), A) == 0
    unsalted = computed(m1, backend, "u", A)
    assert {p.key.split(b":")[1] for p in puts} != {p.key.split(b":")[1] for p in unsalted}
    other = SharedStore(backend, StoreLayout(layout.model, layout.dtype, 16), cost=always(),
                        timeout=LIVE)
    assert from_store(manager(other), A) == 0         # another payload size: another namespace
    seeded = manager(shared, hash_mode="xxhash", seed=5)
    assert from_store(seeded, A) == 0                 # another hash mode: another namespace


def test_fetches_are_bounded_by_max_fetch_and_by_free_host_slots(backend, layout):
    shared = SharedStore(backend, layout, max_fetch=2, cost=always(), timeout=LIVE)
    m1 = manager(shared)
    computed(m1, backend, "a", A)
    assert from_store(manager(shared), A) == 8
    assert from_store(manager(SharedStore(backend, layout, cost=always(), timeout=LIVE), host_blocks=1),
                      A) == 4


def test_fetched_blocks_landed_on_the_device_are_announced_there_alone(backend, shared):
    """The host slots only held the payload until the loads ran (issue 25, store-r12):
    the tier keeps none of it, and announces nothing."""
    m1, m2 = manager(shared), manager(shared, enable_events=True)
    computed(m1, backend, "a", A)
    admit(m2, "b", A[:5])
    events = [e for e in m2.take_events() if isinstance(e, BlockStored)]
    assert [(e.medium, list(e.block_ids), e.token_ids) for e in events] == [
        ("GPU", [0], [1, 2, 3, 4])]
    assert events[0].parent_block_hash is None
    m2.take_kv_ops()
    assert len(m2._host) == 0 and m2._host.num_free == len(m2._host.slots)
    m2.check_invariants()


def test_the_writer_sends_puts_from_its_thread(backend, shared):
    m = manager(shared)
    admit(m, "a", A)
    m.take_kv_ops()
    writer = StoreWriter(backend)
    for op in m.take_kv_ops():
        assert writer.put(op, payload(op.src))
    writer.flush()
    assert (writer.written, writer.errors, writer.dropped) == (3, 0, 0)
    assert from_store(manager(shared), A) == 12


@pytest.mark.parametrize("kw", [dict(hash_mode="xxhash"), dict(hash_mode=lambda b: b[:8]),
                                dict(host_blocks=0), dict(enable_caching=False)])
def test_a_store_needs_shared_hashes_and_host_slots(shared, kw):
    with pytest.raises(ConfigError):
        manager(shared, **kw)


def test_bad_store_arguments(backend, layout):
    with pytest.raises(ConfigError):
        KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4, store=backend)
    for bad in (dict(max_fetch=0), dict(max_fetch=1.5), dict(retry_after=-1),
                dict(retry_after=float("nan")), dict(timeout=0), dict(timeout=float("inf")),
                dict(connections=0), dict(connections=2.0), dict(cost=1.0)):
        with pytest.raises(ConfigError):
            SharedStore(backend, layout, **bad)
    with pytest.raises(ConfigError):
        SharedStore(backend, "layout")
    for bad in (("", "f32", 8), ("m", "", 8), ("m", "f32", 0), ("m", "f32", True)):
        with pytest.raises(ConfigError):
            StoreLayout(*bad)


def test_key_prefix_names_a_tenants_keys(backend, shared):
    m = manager(shared)
    puts = computed(m, backend, "a", A, extra=ExtraKeys(cache_salt="t7"))
    prefix = shared.key_prefix(4, "sha256", cache_salt="t7")
    assert all(p.key.startswith(prefix) for p in puts)
    assert shared.key_prefix(4, "sha256") != prefix
    with pytest.raises(ConfigError):
        shared.key_prefix(4, "xxhash")


def test_an_acl_user_limited_to_prefixkv_keys_and_three_commands_suffices(redis_url, layout):
    """The recipe in docs/security.md, read from it and run as written (user and
    password replaced), on a real server."""
    import pathlib
    import re
    import shlex

    import redis

    from prefixkv.store import RedisStore
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    single = [shlex.split(line) for line in re.findall(r"^ACL SETUSER .*$", doc, flags=re.M)
              if "cluster|" not in line]
    assert len(single) == 1, "docs/security.md gives no single ACL line for one server"
    rules = [(">s3cret" if rule.startswith(">") else rule) for rule in single[0][3:]]
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "fleet", *rules)
    if not redis_url.startswith("unix://"):
        pytest.skip("the URL is not a Unix socket; the recipe is tested on the local server")
    path = redis_url[len("unix://"):]
    user = RedisStore(f"unix://fleet:s3cret@{path}", timeout=LIVE)
    shared = SharedStore(user, layout, cost=always(), timeout=LIVE)
    computed(manager(shared), user, "a", A)
    assert from_store(manager(shared), A) == 12
    assert user.put([(b"elsewhere", b"v")]) == 1    # refused (NOPERM), counted
    intruder = SharedStore(RedisStore(f"unix://fleet:wrong@{path}"), layout, cost=always())
    m = manager(intruder)
    assert from_store(m, A) == 0 and m.stats.store_errors == 1
    admin.execute_command("ACL", "DELUSER", "fleet")


def test_xxhash_with_one_seed_shares_across_managers(backend, shared):
    m1 = manager(shared, hash_mode="xxhash", seed=11)
    computed(m1, backend, "a", A)
    assert from_store(manager(shared, hash_mode="xxhash", seed=11), A) == 12
    assert from_store(manager(shared, hash_mode="xxhash", seed=12), A) == 0


@pytest.mark.parametrize("stored", [3, 2])  # blocks of A in the store: all, or fewer than reserved
def test_fetched_blocks_landed_in_host_slots_alone_are_announced_there_with_their_slots(
        backend, shared, stored):
    """A run that lands in host slots alone (the device is short) is announced on the
    host: each block with the slot that holds it, the run's tokens alone (mutation pass:
    the token bytes ``f.chunks[lo - 1:hi]``, or one slot too many, passed every test), and
    each slot's copy is stated (the staged payloads ``f.fetched[lo - 1:hi]`` of a run
    shorter than its reservation, none, passed too)."""
    m1, m2 = manager(shared), manager(shared, enable_events=True)
    computed(m1, backend, "a", A[:4 * stored + 1])
    m2.add_request("h", list(range(200, 224)), read_cache=False)   # 6 of the 8 blocks
    m2.take_kv_ops()
    m2.take_events()
    assert m2.add_request("b", A) == StoreWait("b", 3)
    deadline = time.monotonic() + PATIENCE
    while "b" not in m2.poll_store():
        assert time.monotonic() < deadline, "a fetch that never ended"
        time.sleep(0.001)
    events = [e for e in m2.take_events() if isinstance(e, BlockStored)]
    held = {s.block_id: s.hash for s in m2._host.slots if s.key is not None}
    assert [(e.medium, e.token_ids, e.first_block) for e in events] == [("CPU", A[:4 * stored], 0)]
    assert len(events[0].block_ids) == stored == len(held)
    assert {i: held[i] for i in events[0].block_ids} == dict(
        zip(events[0].block_ids, events[0].block_hashes, strict=True))
    fetched = [op for op in m2.take_kv_ops() if isinstance(op, StoreFetched)]
    assert fetched == [StoreFetched(i, payload(j)) for j, i in enumerate(events[0].block_ids)]
    m2.check_invariants()
