"""``Prompt`` (core/prompt.py): a prompt prepared once, off the scheduler's thread, and
admitted by ``add_request`` exactly as its token ids would be."""

import copy
import hashlib
import sys
import threading

import pytest

from prefixkv import (
    BlockStored,
    ExtraKeys,
    ExtraKeysError,
    KVCacheManager,
    MultiModalInput,
    Prompt,
    PromptError,
    RequestError,
    TokenError,
    block_hashes,
)
from prefixkv.groups import GroupSpec, HybridKVCacheManager
from prefixkv.index.hasher import Hasher


def spares(p: Prompt) -> list:
    """The spare copies ``p`` holds for its next admissions, read without taking them."""
    return list(copy.copy(p.spare))

BS = 4
P = list(range(1, 23))  # five full blocks and 2 tokens
SALT = ExtraKeys(cache_salt="t")
IMAGE = ExtraKeys(mm=(MultiModalInput("img", 2, 8),))


def state(m):
    """What a refused call must leave unchanged."""
    return m.free_block_order(), m.stats, m.num_cached_blocks, m.take_events()


# ---- prepare checks what admission checks ------------------------------------------------

@pytest.mark.parametrize("ids, error", [
    ([], TokenError), ([1, -1], TokenError), ([1, 2**32], TokenError), ("abc", TokenError),
    ([1, 99], TokenError),  # >= vocab_size
])
def test_prepare_refuses_bad_tokens_as_add_request_does(ids, error):
    m = KVCacheManager(8, BS, vocab_size=50)
    with pytest.raises(error):
        m.add_request("r", ids)
    with pytest.raises(error):
        m.prepare(ids)


def test_prepare_refuses_bad_extra_keys():
    m = KVCacheManager(8, BS)
    with pytest.raises(ExtraKeysError):
        m.prepare(P, extra="salt")
    with pytest.raises(ExtraKeysError):  # a multimodal input past the prompt
        m.prepare([1, 2, 3], extra=IMAGE)


def test_a_prompt_is_immutable_and_says_what_it_holds():
    m = KVCacheManager(8, BS, hash_mode="sha256", host_blocks=2, enable_events=True)
    p = m.prepare(P, extra=SALT)
    assert len(p) == len(P) and p.token_ids == tuple(P) and p.extra == SALT
    assert p.block_hashes == tuple(block_hashes(P, BS, extra=SALT))
    with pytest.raises(AttributeError):
        p.tokens = None
    with pytest.raises(AttributeError):
        del p.hashes
    with pytest.raises(PromptError):  # prepared already
        m.prepare(p)


@pytest.mark.parametrize("kw, hashed", [
    ({}, False),                                         # nobody consumes hashes
    ({"enable_events": True}, False),                    # events build them later, elsewhere
    ({"enable_events": True, "host_blocks": 2}, True),   # a tier below: hashed as stored
    ({"enable_caching": False}, False),
])
def test_hashes_are_computed_only_where_admission_would_compute_them(kw, hashed):
    m = KVCacheManager(8, BS, hash_mode="sha256", **kw)
    assert (m.prepare(P).block_hashes is not None) == hashed


# ---- refused with a typed error, before any change -----------------------------------------

@pytest.mark.parametrize("other", [
    dict(block_size=8), dict(vocab_size=100), dict(hash_mode="xxhash", seed=7),
    dict(seed=3), dict(hash_mode=lambda b: b[:8] or b"x"),
])
def test_a_prompt_of_another_configuration_is_refused(other):
    kw = dict(block_size=BS, hash_mode="sha256", seed=None, vocab_size=None) | other
    m = KVCacheManager(8, kw.pop("block_size"), **kw)
    p = KVCacheManager(8, BS, hash_mode="sha256").prepare(P)
    m.add_request("a", P[:9])
    before = state(m)
    for call in (lambda: m.add_request("r", p), lambda: m.lookup(p),
                 lambda: m.lookup_block_ids(p)):
        with pytest.raises(PromptError) as e:
            call()
        assert isinstance(e.value, RequestError)
    assert state(m) == before
    m.check_invariants()


def test_xxhash_prompts_need_the_same_seed():
    """Two managers drawing their own random xxhash seeds name blocks differently."""
    a, b = KVCacheManager(8, BS), KVCacheManager(8, BS)
    with pytest.raises(PromptError):
        b.add_request("r", a.prepare(P))
    c, d = KVCacheManager(8, BS, seed=5), KVCacheManager(16, BS, seed=5)
    assert d.add_request("r", c.prepare(P)) is not None  # equal configuration: taken


def test_extra_with_a_prompt_is_refused():
    m = KVCacheManager(8, BS)
    p = m.prepare(P, extra=SALT)
    before = state(m)
    with pytest.raises(PromptError):
        m.add_request("r", p, extra=SALT)
    with pytest.raises(PromptError):
        m.lookup(p, extra=SALT)
    assert state(m) == before


# ---- admitted as its token ids are -------------------------------------------------------------

def test_one_prompt_admitted_twice_decodes_into_two_token_stores():
    m = KVCacheManager(16, BS)
    p = m.prepare(P)
    a, b = m.add_request("a", p), m.add_request("b", p)
    assert b.num_cached_tokens == 20 and a.block_ids[:5] == b.block_ids[:5]
    m.append_tokens("a", [100, 101])
    m.append_tokens("b", [200])
    assert m.preempt("a")[-3:] == (22, 100, 101) and m.preempt("b")[-2:] == (22, 200)
    assert p.token_ids == tuple(P)  # the Prompt never saw either
    assert m.add_request("c", p, resumed=True).num_cached_tokens == 20  # and admits again
    m.check_invariants()


def test_the_first_admission_takes_the_copy_prepare_made():
    m = KVCacheManager(8, BS)
    p = m.prepare(P)
    (spare,) = spares(p)
    assert spare == p.tokens and spare is not p.tokens
    assert m.lookup(p) == 0 and m.lookup_block_ids(p) == () and spares(p) == [spare]  # (not a lookup's)
    m.add_request("a", p)
    assert spares(p) == [] and m._requests["a"].tokens is spare  # no copy on the scheduler's thread
    m.append_tokens("a", [100])
    m.add_request("b", p)  # later admissions copy
    assert m._requests["b"].tokens is not spare and m._requests["b"].tokens is not p.tokens
    m.append_tokens("b", [7])
    assert p.token_ids == tuple(P) and m.num_tokens("a") == m.num_tokens("b") == len(P) + 1
    # refused (the pool is short now): the copy it took goes back, unwritten, for the next
    q = m.prepare([9] * 21)
    (taken,) = spares(q)
    assert m.add_request("c", q) is None and spares(q) == [taken] and spares(q)[0] is taken
    assert taken == q.tokens
    m.free("a")
    m.free("b")
    assert m.add_request("c", q) is not None and m._requests["c"].tokens is taken
    m.check_invariants()


def test_a_long_prompts_copy_has_room_to_grow():
    m = KVCacheManager(4096, 16)
    p = m.prepare(list(range(5000)))
    assert sys.getsizeof(spares(p)[0]) >= sys.getsizeof(p.tokens[:]) + 4 * 64  # (grown: room kept)
    m.add_request("a", p)
    m.append_tokens("a", [1])
    assert p.token_ids == tuple(range(5000)) and m.num_tokens("a") == 5001


@pytest.mark.parametrize("kw", [
    {}, {"enable_events": True}, {"enable_events": True, "host_blocks": 3},
    {"host_blocks": 3}, {"enable_events": True, "hash_mode": lambda b: hashlib.sha256(b).digest()[:8]},
])
@pytest.mark.parametrize("extra", [None, SALT, IMAGE])
def test_prepared_and_plain_admissions_agree_step_by_step(kw, extra):
    """Two managers, one fed token ids and one Prompts, through hits, misses, chunked
    prefill, decode, evictions, offloads and loads: the same answers, plans and events."""
    kw = {"hash_mode": "sha256"} | kw
    plain, prepared = KVCacheManager(7, BS, **kw), KVCacheManager(7, BS, **kw)
    prompts = [P, P[:13] + [9] * 8, P, [5] * 10, P[:9], P + [1]]
    for i, ids in enumerate(prompts):
        e = extra if len(ids) >= 10 else None
        kw_i = {"num_new_tokens": 6} if i == 1 else {}
        a = plain.add_request(i, ids, extra=e, **kw_i)
        b = prepared.add_request(i, prepared.prepare(ids, extra=e), **kw_i)
        assert a == b and plain.lookup(ids, extra=e) == prepared.lookup(prepared.prepare(ids, extra=e))
        left = len(ids) - a.num_cached_tokens - a.num_new_tokens if a is not None else 0
        if left:  # the chunked prefill's rest
            assert plain.extend(i, left) == prepared.extend(i, left)
        assert plain.take_kv_ops() == prepared.take_kv_ops()
        assert plain.take_events() == prepared.take_events()
        if i % 2 and a is not None:
            plain.free(i)
            prepared.free(i)
        plain.check_invariants()
        prepared.check_invariants()


def test_admission_does_not_hash_a_prepared_prompt(monkeypatch):
    """With a tier below (eager hashes), the chain hashes come from the Prompt: admission
    calls the hash no more (a plain admission of the same prompt does)."""
    calls = []
    original = Hasher.chain
    monkeypatch.setattr(Hasher, "chain", lambda self, *a: calls.append(1) or original(self, *a))
    m = KVCacheManager(40, BS, hash_mode="sha256", host_blocks=2, enable_events=True)
    p = m.prepare(P)
    calls.clear()
    m.add_request("a", p)
    assert calls == []
    m.add_request("b", P[:9] + [7] * 8)
    assert calls == [1]
    assert [e.block_hashes for e in m.take_events()][0] == block_hashes(P, BS)
    long = P * 2  # a chunked prefill: its extend calls take the Prompt's hashes too
    q = m.prepare(long)
    calls.clear()
    assert m.add_request("c", q, num_new_tokens=9).num_cached_tokens == 20
    m.extend("c", 8)
    m.extend("c", len(long) - m.num_scheduled_tokens("c"))
    assert calls == []
    m.append_tokens("c", [1, 2, 3, 4])  # past the prompt: hashed as it fills, as ever
    assert calls == [1]
    stored = [h for e in m.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == block_hashes(long + [1, 2, 3, 4], BS)[5:]
    m.check_invariants()


# ---- any thread ------------------------------------------------------------------------------

def test_prepare_on_another_thread_while_the_scheduler_admits():
    """A thread prepares prompts in a loop (as an engine's input thread would) while this
    one admits, decodes and frees: every Prompt equals one prepared here, and the manager
    stays sound."""
    m = KVCacheManager(64, BS, hash_mode="sha256", host_blocks=8, enable_events=True)
    prompts = [[j % 7 + k for j in range(k, k + 9 + 3 * k)] for k in range(6)]
    want = [m.prepare(ids, extra=SALT if k % 2 else None) for k, ids in enumerate(prompts)]
    got, stop, errors = [], threading.Event(), []

    def hammer():
        try:
            while not stop.is_set():
                for k, ids in enumerate(prompts):
                    got.append((k, m.prepare(ids, extra=SALT if k % 2 else None)))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=hammer)
    t.start()
    try:
        for step in range(300):
            rid = f"r{step}"
            k = step % len(prompts)
            if m.add_request(rid, want[k]) is not None:
                m.append_tokens(rid, [step % 5])
                if step % 3:
                    m.free(rid)
            m.take_kv_ops()
            m.take_events()
            m.check_invariants()
    finally:
        stop.set()
        t.join()
    assert not errors and got
    for k, p in got:
        w = want[k]
        assert (p.token_ids, p.extra, p.block_hashes, p.chunks) == (
            w.token_ids, w.extra, w.block_hashes, w.chunks)
    for k, p in got[-len(prompts):]:  # and they find what their token ids find
        assert m.lookup(p) == m.lookup(prompts[k], extra=SALT if k % 2 else None)


# ---- the hybrid manager ------------------------------------------------------------------

def test_hybrid_manager_admits_prepared_prompts():
    groups = [GroupSpec("full_attention"), GroupSpec("sliding_window", 8)]
    plain = HybridKVCacheManager(groups, 32, BS, hash_mode="sha256", enable_events=True)
    prepared = HybridKVCacheManager(groups, 32, BS, hash_mode="sha256", enable_events=True)
    p = prepared.prepare(P, extra=SALT)
    assert p.block_hashes == tuple(block_hashes(P, BS, extra=SALT))
    for rid in ("a", "b"):
        assert plain.add_request(rid, P, extra=SALT) == prepared.add_request(rid, p)
        assert plain.take_events() == prepared.take_events()
    assert spares(p) == []  # "a" took the copy prepare made
    prepared.append_tokens("a", [50])
    assert prepared.num_tokens("b") == len(P) and p.token_ids == tuple(P)
    assert prepared.lookup(p) == plain.lookup(P, extra=SALT) == 20
    # a plain manager's Prompt of the same configuration is taken; another's is refused
    assert prepared.add_request("c", KVCacheManager(8, BS, hash_mode="sha256").prepare(P)) is not None
    with pytest.raises(PromptError):
        prepared.add_request("d", KVCacheManager(8, 8, hash_mode="sha256").prepare(P))
    prepared.check_invariants()


def test_prompt_repr():
    p = KVCacheManager(8, BS).prepare(P)
    assert repr(p) == "Prompt(22 tokens, 5 full blocks, hashed=False)"
    assert isinstance(p, Prompt)


def test_hybrid_chunked_prefill_takes_the_prompts_hashes(monkeypatch):
    """Events on: the hybrid manager hashes as it stores; with a Prompt, neither the
    admission nor the prefill's extend calls hash, and the events are the plain path's."""
    groups = [GroupSpec("full_attention"), GroupSpec("sliding_window", 8)]
    plain = HybridKVCacheManager(groups, 64, BS, hash_mode="sha256", enable_events=True)
    prepared = HybridKVCacheManager(groups, 64, BS, hash_mode="sha256", enable_events=True)
    long = P * 2
    p = prepared.prepare(long)
    calls = []
    original = Hasher.chain
    monkeypatch.setattr(Hasher, "chain", lambda self, *a: calls.append(1) or original(self, *a))
    for m, given in ((plain, long), (prepared, p)):
        calls.clear()
        m.add_request("c", given, num_new_tokens=9)
        m.extend("c", 8)
        m.extend("c", len(long) - m.num_scheduled_tokens("c"))
        assert calls == ([] if m is prepared else [1, 1, 1])
    assert plain.take_events() == prepared.take_events()
    plain.append_tokens("c", [1, 2, 3, 4])
    prepared.append_tokens("c", [1, 2, 3, 4])  # past the prompt: hashed as it fills
    assert plain.take_events() == prepared.take_events()
    prepared.check_invariants()


@pytest.mark.parametrize(("theirs", "named"), [
    ({"block_size": 2 * BS}, f"block_size {2 * BS} where this manager has {BS}"),
    ({"vocab_size": 5000}, "vocab_size 5000 where this manager has None"),
    ({"hash_mode": "sha256"}, "another hash_mode"),
    ({}, "another chain seed .*same seed="),
])
def test_a_foreign_prompt_is_refused_naming_what_differs(theirs, named):
    """The PromptError says which setting differs, with both values. Before, it printed
    (block_size, vocab_size) of both managers only: two managers that differ only in
    their random xxhash seeds (the default) showed ``(16, None) against (16, None)``."""
    m = KVCacheManager(8, BS)
    p = KVCacheManager(8, theirs.pop("block_size", BS), **theirs).prepare(P)
    m.add_request("a", P[:9])
    before = state(m)
    with pytest.raises(PromptError, match=named):
        m.add_request("r", p)
    assert state(m) == before
