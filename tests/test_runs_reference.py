"""Runs of blocks (``core.run.Run``: one span verified at once, one count, one free
segment) against the plain per-block pool, on adversarial op sequences.

Two managers take the same ops: one records runs (the default), the other does not
(``runs`` off: every block is claimed, counted and queued alone, as before runs). After
every op both must agree exactly: the admission's answer (block ids, cached tokens), every
block's reference count, the free queue's order block by block, each live request's
blocks; and both pass ``check_invariants`` (which checks the runs: one count for a shared
run's blocks, a free one consecutive in the cached tier, an ``ok`` one holding what it
recorded). The prompts are long chains that share prefixes of every length (claims of
part of a run split it), re-sent while held (spares) or after a reset; requests are
freed in any order, some dropped before their KV was computed, forked (one block's count
alone), grown by decoded tokens and chunked prefills; ``uncache_blocks`` and evictions
(a small pool, so a free run is evicted from the middle of its segment) come between.
"""

from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager, PromptTooLongError

BS = 2
# token blocks; chains of them share prefixes of every length and part at every block
UNITS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
CHAINS = [[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 1, 1], [0, 1, 2, 4], [0, 1, 3, 3, 3, 3],
          [2, 2, 2, 2, 2], [0, 1, 2, 3, 4, 0, 1, 2, 3], [4, 1, 2, 3, 0]]

admits = st.tuples(st.just("admit"), st.integers(0, len(CHAINS) - 1), st.integers(1, 9),
                   st.lists(st.integers(1, 10), max_size=3), st.none() | st.integers(1, 12),
                   st.booleans())
ops = st.one_of(
    admits, admits, admits,
    st.tuples(st.just("free"), st.integers(0, 30), st.none() | st.integers(0, 20)),
    st.tuples(st.just("fork"), st.integers(0, 30)),
    st.tuples(st.just("extend"), st.integers(0, 30), st.integers(1, 8)),
    st.tuples(st.just("decode"), st.integers(0, 30), st.lists(st.integers(1, 10), min_size=1,
                                                              max_size=3)),
    st.tuples(st.just("uncache"), st.lists(st.integers(0, 15), max_size=3)),
    st.tuples(st.just("reset"),),
)


def same(a: KVCacheManager, b: KVCacheManager, live: list[str]) -> None:
    assert [x.ref_cnt for x in a._pool.blocks] == [x.ref_cnt for x in b._pool.blocks]
    assert a.free_block_order() == b.free_block_order()
    for rid in live:
        assert a.get_block_ids(rid) == b.get_block_ids(rid)
    a.check_invariants()
    b.check_invariants()


def both(a: KVCacheManager, b: KVCacheManager, call: str, *args, **kw):
    """The call on each; the same answer, or the same exception type."""
    out = []
    for m in (a, b):
        try:
            out.append(getattr(m, call)(*args, **kw))
        except Exception as e:  # noqa: BLE001 (compared below: both must raise alike)
            out.append(type(e))
    assert out[0] == out[1], (call, args, out)
    return out[0]


@settings(deadline=None, max_examples=50)
@example([("admit", 0, 7, [], None, False), ("admit", 0, 7, [], None, False),
          ("admit", 2, 4, [], None, False), ("admit", 0, 7, [], None, False)], 16, False, True)
@example([("admit", 5, 9, [], None, True), ("admit", 0, 5, [1], None, True), ("free", 0, None),
          ("free", 0, None), ("admit", 5, 9, [], None, False), ("admit", 3, 6, [], None, False),
          ("admit", 0, 5, [], None, False)], 12, True, True)
@example([("admit", 0, 4, [], None, True), ("uncache", [0]), ("free", 0, None),
          ("admit", 6, 1, [7], None, True), ("admit", 6, 4, [], None, True)], 8, False, True)
# (a run's head made unfindable while held, then refilled with other content: the run
# after it must not be claimed after that content)
@example([("admit", 0, 1, [], None, False)] * 4 + [
    ("admit", 4, 5, [], None, False), ("admit", 0, 4, [], None, True), ("uncache", [7]),
    ("admit", 0, 4, [], None, False)], 10, False, True)
# (a block of a run that is not shared loses its content: the claim that takes the run
# whole must check each block)
# (a run claimed whole while held, each block as many times: one count from then on;
# split while held, freed in another order, claimed again while one part is free)
@example([("admit", 0, 7, [], None, True), ("admit", 0, 7, [], None, True),
          ("admit", 0, 7, [], None, True), ("admit", 2, 4, [], None, True), ("free", 0, None),
          ("admit", 0, 7, [], None, True), ("free", 2, None), ("free", 0, None),
          ("admit", 0, 6, [], None, True), ("fork", 0), ("admit", 0, 7, [], None, False)],
         24, True, True)
# (held as many times but not by the same requests: one holds a prefix of another's)
@example([("admit", 0, 4, [], None, True), ("admit", 5, 9, [], None, True),
          ("admit", 0, 9, [], None, True), ("free", 1, None), ("admit", 5, 9, [], None, True),
          ("free", 0, None), ("free", 0, None), ("admit", 5, 9, [], None, False)], 16, False, True)
@given(st.lists(ops, min_size=5, max_size=40), st.sampled_from([10, 12, 16, 24]), st.booleans(),
       st.booleans())
def test_runs_match_the_per_block_pool(steps, num_blocks, events, pending):
    """``pending``: a miss's run is recorded pending (``index/pending.py``; without
    events), or written as it is stored."""
    a = KVCacheManager(num_blocks, BS, seed=0, enable_events=events)
    a._index.pending_runs = pending
    b = KVCacheManager(num_blocks, BS, seed=0, enable_events=events)
    b._index.runs = False
    live: list[str] = []
    for n, op in enumerate(steps):
        if op[0] == "admit":
            _, c, k, tail, new, keep = op
            tokens = [t for u in CHAINS[c][:k] for t in UNITS[u]] + tail
            try:
                got = both(a, b, "add_request", f"r{n}", tokens, num_new_tokens=new)
            except AssertionError:
                raise
            if got is not None and got is not PromptTooLongError:
                live.append(f"r{n}")
                if not keep:
                    both(a, b, "free", live.pop())
        elif op[0] == "free" and live:
            rid = live.pop(op[1] % len(live))
            computed = op[2]
            if computed is not None:
                computed = min(computed, a.num_scheduled_tokens(rid))
            both(a, b, "free", rid, num_computed_tokens=computed)
        elif op[0] == "fork" and live:
            parent = live[op[1] % len(live)]
            if a.num_scheduled_tokens(parent) == a.num_tokens(parent):
                if both(a, b, "fork", parent, f"f{n}") is not None:
                    live.append(f"f{n}")
        elif op[0] == "extend" and live:
            rid = live[op[1] % len(live)]
            left = a.num_tokens(rid) - a.num_scheduled_tokens(rid)
            if left:
                both(a, b, "extend", rid, min(op[2], left))
        elif op[0] == "decode" and live:
            rid = live[op[1] % len(live)]
            if a.num_scheduled_tokens(rid) == a.num_tokens(rid):
                both(a, b, "append_tokens", rid, op[2])
        elif op[0] == "uncache":
            both(a, b, "uncache_blocks", op[1])
        elif op[0] == "reset":
            both(a, b, "reset_prefix_cache")
        if events:
            a.take_pending_events()
            b.take_pending_events()
        same(a, b, live)


def test_a_run_held_when_claimed_whole_keeps_one_count():
    """A run that is held when a claim takes it whole (a system prompt under steady
    traffic: never free) gets one count when each block is held as many times; its
    release by each holder changes that count, and the last joins the cached tier as
    one segment."""
    m = KVCacheManager(32, BS, seed=0)
    tokens = [t for u in CHAINS[0] for t in UNITS[u]]
    m.add_request("a", tokens)
    m.add_request("b", tokens)  # (the run of a's store, less the block of b's last token)
    run = [m._pool.blocks[i] for i in m.get_block_ids("b")[1:6]]
    shared = run[0].counted
    assert shared is not None and shared.n == 2 and all(x.counted is shared for x in run)
    m.add_request("c", tokens)
    assert shared.n == 3 and all(x.ref_cnt == 3 for x in run)
    m.free("a")
    m.free("c")
    assert shared.n == 1 and run[0].counted is shared
    m.free("b")
    assert shared.n == 0 and shared.linked
    m.check_invariants()
