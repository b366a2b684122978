"""``add_request``'s common case (a prepared prompt, default arguments: its lean path)
and ``store``'s (a miss's new run: ``_store_run``) against the general paths they stand
for: two managers fed the same calls, one of them forced through the general paths,
must give the same admissions, events, stats, free order and lookups at every step."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ExtraKeys, KVCacheManager, PrefixKVError, Prompt

BS = 4


def general(m: KVCacheManager) -> KVCacheManager:
    """``m`` with both lean paths refused: every admission takes ``_admit``, every store
    its loop."""
    m._lean = False
    m._index._store_run = lambda *args: False  # type: ignore[union-attr]
    return m


def make(events: bool, num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, seed=1, enable_events=events)


def same(a: KVCacheManager, b: KVCacheManager, rid: str) -> None:
    assert a.get_block_ids(rid) == b.get_block_ids(rid)
    assert a.free_block_order() == b.free_block_order()
    assert a._stats.total == b._stats.total
    a.check_invariants()
    b.check_invariants()


def admit(m: KVCacheManager, rid: str, p: Prompt, kw: dict[str, object]) -> object:
    """``m.add_request``'s answer, or the error it raised."""
    try:
        return m.add_request(rid, p, **kw)  # type: ignore[arg-type]
    except PrefixKVError as e:
        return e


def plugin_arguments(rng: random.Random, n: int) -> dict[str, object]:
    """``add_request``'s other arguments as vLLM's plug-in passes them (slots.admit: a
    chunk, a capped hit or none read, lookahead, ``keep_free``, ``require_full_fit``, a
    resumed request), each drawn or left at its default."""
    kw: dict[str, object] = {}
    if rng.random() < 0.6:
        kw["num_new_tokens"] = rng.randint(1, n + 2)
    if rng.random() < 0.4:
        kw["max_hit_tokens"] = rng.randint(0, n + 4)
    if rng.random() < 0.2:
        kw["read_cache"] = False
    if rng.random() < 0.5:
        kw["num_lookahead_tokens"] = rng.randint(0, 9)
    if rng.random() < 0.4:
        kw["keep_free"] = rng.randint(0, 12)
    if rng.random() < 0.4:
        kw["require_full_fit"] = True
    if rng.random() < 0.2:
        kw["resumed"] = True
    return kw


@settings(deadline=None, max_examples=40)
@given(seed=st.integers(0, 2**32 - 1), events=st.booleans(), pending=st.booleans(),
       num_blocks=st.integers(12, 60))
def test_the_lean_paths_do_what_the_general_ones_do(seed: int, events: bool, pending: bool,
                                                    num_blocks: int) -> None:
    rng = random.Random(seed)
    lean, slow = make(events, num_blocks), general(make(events, num_blocks))
    for m in (lean, slow):
        m._index.pending_runs = pending  # type: ignore[union-attr]
    heads = [[rng.randrange(50) for _ in range(rng.randint(0, 14))] for _ in range(3)]
    live: list[str] = []
    for step in range(40):
        if live and rng.random() < 0.4:
            rid = live.pop(rng.randrange(len(live)))
            lean.free(rid)
            slow.free(rid)
            continue
        tokens = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randint(1, 30))]
        rid = f"r{step}"
        extra = None if rng.random() < 0.7 else ExtraKeys(cache_salt=rng.choice("ab"))
        p = lean.prepare(tokens, extra=extra)
        kw = {} if rng.random() < 0.5 else plugin_arguments(rng, len(tokens))
        got = [admit(m, rid, p if rng.random() < 0.5 else m.prepare(tokens, extra=extra), kw)
               for m in (lean, slow)]
        assert isinstance(got[0], PrefixKVError) == isinstance(got[1], PrefixKVError)
        if isinstance(got[0], PrefixKVError):  # (refused before any change: both the same)
            assert type(got[0]) is type(got[1]) and str(got[0]) == str(got[1])
            got = [None, None]
        assert (got[0] is None) == (got[1] is None)
        if got[0] is not None:
            assert got[0].block_ids == got[1].block_ids  # type: ignore[union-attr]
            assert got[0].num_cached_tokens == got[1].num_cached_tokens  # type: ignore[union-attr]
            assert got[0].num_new_tokens == got[1].num_new_tokens  # type: ignore[union-attr]
            live.append(rid)
            same(lean, slow, rid)
            assert lean._num_prefilling == slow._num_prefilling
            assert lean.num_scheduled_tokens(rid) == slow.num_scheduled_tokens(rid)
            if rng.random() < 0.5 and lean.num_scheduled_tokens(rid) < len(tokens):
                k = rng.randint(1, len(tokens) - lean.num_scheduled_tokens(rid))  # more of a chunk
                assert lean.extend(rid, k) == slow.extend(rid, k)
                same(lean, slow, rid)
        if events:
            assert lean.take_events() == slow.take_events()
        probe = rng.choice(heads) + tokens[:rng.randint(0, len(tokens))]
        if probe:
            assert lean.lookup(probe, extra=extra) == slow.lookup(probe, extra=extra)


def test_a_prepared_prompt_with_default_arguments_takes_the_lean_path() -> None:
    """The lean path is the one a plain prepared admission takes (``_admit`` is not
    called), and a prompt of another manager's preparing is not."""
    m = make(True, 32)
    calls: list[str] = []
    general_path = m._admit

    def spy(*args: object) -> object:
        calls.append("general")
        return general_path(*args)  # type: ignore[arg-type]

    m._admit = spy  # type: ignore[method-assign]
    m.add_request("a", m.prepare(list(range(20))))
    assert calls == []
    # vLLM's plug-in's arguments (slots.admit): a chunk, a capped hit, lookahead, a reserve
    got = m.add_request("p", m.prepare(list(range(40))), num_new_tokens=9, max_hit_tokens=12,
                        num_lookahead_tokens=3, keep_free=2, require_full_fit=True, resumed=True)
    m.add_request("q", m.prepare(list(range(9))), read_cache=False)
    assert calls == []
    assert got is not None and got.num_cached_tokens == 12 and got.num_new_tokens == 9  # type: ignore[union-attr]
    assert m.num_scheduled_tokens("p") == 12 + 9
    m.add_request("b", make(True, 32).prepare(list(range(20))))
    m.add_request("c", list(range(20)))
    assert calls == ["general", "general"]


BAD = [  # (an argument out of range or of another type: the general path's checks)
    {"num_new_tokens": 0}, {"num_new_tokens": -1}, {"num_new_tokens": "3"},
    {"num_new_tokens": 2.0}, {"max_hit_tokens": -1}, {"max_hit_tokens": "4"},
    {"max_hit_tokens": 4.0}, {"resumed": 1}, {"resumed": None}, {"read_cache": 0},
    {"read_cache": None}, {"require_full_fit": 1}, {"require_full_fit": None},
    {"num_lookahead_tokens": -1}, {"num_lookahead_tokens": "1"}, {"num_lookahead_tokens": 1.0},
    {"keep_free": -1}, {"keep_free": "2"}, {"keep_free": 2.0},
    {"num_lookahead_tokens": 32 * BS - 19},  # (the prompt's 20 and this: past the pool)
    {"num_lookahead_tokens": 32 * BS - 20, "num_new_tokens": 1},  # (the pool's slots: fits)
]


@pytest.mark.parametrize("kw", BAD)
def test_a_prepared_prompt_with_a_bad_argument_raises_as_the_general_path(kw) -> None:
    """Each argument the lean path tests before it runs: out of range (or of another
    type) with a prepared prompt, the same typed error as a list of ids gets, raised
    before any change; within range at the pool's edge, the same admission."""
    lean, slow = make(True, 32), general(make(True, 32))
    for m in (lean, slow):  # (two cached blocks: the prompt's first two)
        m.add_request("h", list(range(8)))
        m.free("h")
        m.take_events()
    got = [admit(m, "a", m.prepare(list(range(20))), kw) for m in (lean, slow)]
    got.append(admit(lean, "b", list(range(20)), kw))
    if isinstance(got[0], PrefixKVError):
        assert [(type(e), str(e)) for e in got] == [(type(got[2]), str(got[2]))] * 3
        assert lean.free_block_order() == slow.free_block_order() == list(range(2, 32)) + [1, 0]
        assert lean.take_events() == [] and lean.stats == slow.stats
    else:
        assert [(a.block_ids, a.num_cached_tokens, a.num_new_tokens) for a in got[:2]] == [
            (tuple(range(30)), 8, 1)] * 2  # (the hit's 2, then 28 for the 1 + 107 slots)
        same(lean, slow, "a")


EDGES = [  # (each count at the lowest value it may take, the lookahead at the pool's edge)
    {"num_new_tokens": 1}, {"max_hit_tokens": 0}, {"num_lookahead_tokens": 0},
    {"keep_free": 0}, {"num_lookahead_tokens": 32 * BS - 20},
    {"resumed": False, "read_cache": True, "require_full_fit": False},
    {"resumed": True, "read_cache": False, "require_full_fit": True},
]


@pytest.mark.parametrize("kw", EDGES)
def test_a_prepared_prompt_with_arguments_at_their_edges_takes_the_lean_path(kw) -> None:
    """Valid values at their edges are the common case too: no call of ``_admit``."""
    m = make(True, 32)
    m._admit = lambda *args: pytest.fail("the general path")  # type: ignore[method-assign]
    got = m.add_request("a", m.prepare(list(range(20))), **kw)
    assert got is not None
