"""``lookup`` and the admission after it agree while runs are pending (``index/pending.py``).

``lookup`` walks pending runs with ``walk_pending``, which compares the chunks after a
run's head with the run's record; ``ContentIndex.claim`` compares the head's chunk too
(one memcmp from the head on). They agree because a head whose content id is the run's
``pcid`` holds the chunk the run recorded for it (one content, one id), which
``check_invariants`` verifies (``index/run_check.py``). Here the two are compared
directly: random ops (test_pending_events' admissions of chains sharing prefixes, frees,
preemptions, forks, chunks, decoded tokens, ``uncache_blocks``, rewinds, resets) on one
manager with pending runs, events on (built when the log is taken) or off, a small pool;
before each admission its ``lookup_block_ids`` and ``lookup`` (same prompt, extra keys and
cap) must be the blocks and tokens the admission then claims.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager
from prefixkv.errors import InvariantError, PrefixKVError
from test_pending_events import BS, CHAINS, EXTRAS, UNITS, draw


def run(steps: list[tuple], num_blocks: int, events: bool) -> int:
    """The ops on one manager, each admission checked against the lookups before it;
    returns how many admissions found blocks of a pending run (the walk's own path)."""
    m = KVCacheManager(num_blocks, BS, seed=0, enable_events=events)
    live: list[str] = []
    through_pending = 0
    for n, op in enumerate(steps):
        try:
            if op[0] == "admit":
                through_pending += admit(m, f"r{n}", op, live)
            else:
                other(m, n, op, live)
        except PrefixKVError:  # (refused before any change, as test_pending_events takes it)
            pass
        m.take_kv_ops()
        m.take_events()
        m.check_invariants()
    return through_pending


def admit(m: KVCacheManager, rid: str, op: tuple, live: list[str]) -> bool:
    """The admission ``op`` after its lookups, which must find what it claims; whether
    they found a block of a pending run."""
    _, c, k, tail, extra, _prepared, new, cap, keep, _recompute = op
    tokens = [t for u in CHAINS[c][:k] for t in UNITS[u]] + tail
    e = EXTRAS[extra]
    if e is not None and e.mm is not None and len(tokens) < 7:
        e = None
    pending = {id(b) for r in m._index.run_counts.pending  # type: ignore[union-attr]
               for b in r.blocks}
    want = m.lookup_block_ids(tokens, extra=e, max_hit_tokens=cap)
    want_tokens = m.lookup(tokens, extra=e, max_hit_tokens=cap)
    assert want_tokens == len(want) * BS, (rid, want, want_tokens)
    kw: dict[str, object] = {"extra": e, "max_hit_tokens": cap}
    if new is not None:
        kw["num_new_tokens"] = new
    got = m.add_request(rid, tokens, **kw)
    if got is not None:
        assert got.block_ids[:got.num_cached_tokens // BS] == want, (rid, got, want)
        assert got.num_cached_tokens == want_tokens, (rid, got, want_tokens)
        if keep:
            live.append(rid)
        else:
            m.free(rid)
    return any(id(m._pool.blocks[i]) in pending for i in want)


def other(m: KVCacheManager, n: int, op: tuple, live: list[str]) -> None:
    """Any op but an admission (test_pending_events' ``run`` on one manager)."""
    kind = op[0]
    if kind in ("free", "preempt") and live:
        rid = live.pop(op[1] % len(live))
        if kind == "preempt":
            m.preempt(rid)
        else:
            done = op[2] if op[2] is None else min(op[2], m.num_scheduled_tokens(rid))
            m.free(rid, num_computed_tokens=done)
    elif kind == "fork" and live:
        parent = live[op[1] % len(live)]
        if m.num_scheduled_tokens(parent) == m.num_tokens(parent) \
                and m.fork(parent, f"f{n}") is not None:
            live.append(f"f{n}")
    elif kind == "extend" and live:
        rid = live[op[1] % len(live)]
        left = m.num_tokens(rid) - m.num_scheduled_tokens(rid)
        if left:
            m.extend(rid, min(op[2], left))
    elif kind == "decode" and live:
        rid = live[op[1] % len(live)]
        if m.num_scheduled_tokens(rid) == m.num_tokens(rid):
            m.append_tokens(rid, op[2])
    elif kind == "uncache":
        m.uncache_blocks(op[1])
    elif kind == "rewind" and live:
        rid = live[op[1] % len(live)]
        back = min(op[2], m.num_scheduled_tokens(rid))
        if m.rewind(rid, back) is None and back < m.num_tokens(rid):
            m.extend(rid, m.num_tokens(rid) - back)  # (the recompute)
    elif kind == "reset":
        m.reset_prefix_cache()


@settings(deadline=None, max_examples=50)
@given(st.integers(0, 1 << 32), st.integers(20, 60), st.sampled_from([8, 12, 16, 24]),
       st.booleans())
def test_lookup_finds_what_the_next_admission_claims_with_runs_pending(seed, n, num_blocks, events):
    rng = random.Random(seed)  # (ops drawn evenly, as test_pending_events draws them)
    run([draw(rng) for _ in range(n)], num_blocks, events)


def test_the_random_ops_reach_pending_runs_through_lookup():
    """The ops above do exercise ``walk_pending``: over a few fixed seeds, admissions whose
    lookup found blocks of a pending run (else the comparison would test ``_walk`` alone)."""
    found = 0
    for s in range(8):
        rng = random.Random(s)
        found += run([draw(rng) for _ in range(60)], 16, s % 2 == 0)
    assert found >= 8, found


def test_check_invariants_catches_a_run_recording_other_tokens_than_its_head_holds():
    """The invariant ``walk_pending`` relies on instead of comparing the head's chunk:
    a block heading a pending run of this epoch under the run's ``pcid`` holds the
    chunk the run recorded for it. Broken by hand (the run's record of the head's
    tokens, nothing else), ``check_invariants`` names it."""
    m = KVCacheManager(16, BS, seed=0)
    m.add_request("a", list(range(1, 12)))
    m.free("a")
    (run_,) = m._index.run_counts.pending  # type: ignore[union-attr]
    width = len(run_.data) // (len(run_.blocks) + 1)
    m.check_invariants()
    run_.data = b"\xff" * width + run_.data[width:]  # (its record of the head's tokens)
    with pytest.raises(InvariantError, match="heads pending"):
        m.check_invariants()
