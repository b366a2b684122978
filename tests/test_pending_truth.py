"""Pending runs (``index/pending.py``) and ``Run.data`` against the KV each block really
holds, on adversarial op sequences.

A reference records, for every physical block, the content its KV was computed for: the
extra keys and the whole token prefix up to its end (``None`` once it is garbage: never
computed, or computed on KV that ``uncache_blocks`` named invalid). Every hit an
admission hands out, and every block ``lookup_block_ids`` names, must hold the prompt's
own prefix there. A second manager without runs (every block claimed and counted alone)
takes the same ops: the answers, the reference counts and the free order must agree
exactly. The prompts are long chains (misses record runs of 2..11 blocks) that part at
every block; claims are capped by ``max_hit_tokens``; requests fork, decode, grow by
chunks and are freed with fewer computed tokens; tenants (salts) and a multimodal input
share token bytes; a small pool evicts whole runs and cuts their tails.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ExtraKeys, KVCacheManager
from prefixkv.extra_keys import MultiModalInput
from test_runs_reference import both

BS = 2
UNITS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
CHAINS = [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 0, 1, 2, 2, 2], [0, 1, 3, 3, 3],
          [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 0, 1, 2, 3, 0, 3, 3, 3],
          [2, 3, 0, 1, 2, 3, 0, 1]]
EXTRAS: list[ExtraKeys | None] = [None, None, ExtraKeys(cache_salt="t"),
                                  ExtraKeys(mm=(MultiModalInput("img", 3, 4),)),
                                  ExtraKeys(mm=(MultiModalInput("pic", 3, 4),))]


def content(tokens: list[int], extra: int, i: int) -> tuple:
    """What block ``i`` of a prompt holds: its extra keys (a multimodal input only once
    it starts within the prefix) and every token up to the block's end."""
    e = EXTRAS[extra]
    end = (i + 1) * BS
    if e is not None and e.mm is not None:
        key: object = tuple((x.hash, x.offset, x.length) for x in e.mm if x.offset < end) or None
    else:
        key = e
    return (key, tuple(tokens[:end]))


chains = st.one_of(st.integers(0, len(CHAINS) - 1),
                   st.lists(st.integers(0, len(UNITS) - 1), min_size=3, max_size=14))
admits = st.tuples(st.just("admit"), chains, st.integers(1, 12),
                   st.lists(st.integers(1, 8), max_size=3), st.sampled_from([0, 0, 0, 1, 2, 3, 4]),
                   st.none() | st.integers(1, 14), st.none() | st.integers(0, 24),
                   st.booleans())
ops = st.one_of(
    admits, admits, admits,
    st.tuples(st.just("free"), st.integers(0, 30), st.none() | st.integers(0, 24)),
    st.tuples(st.just("fork"), st.integers(0, 30)),
    st.tuples(st.just("extend"), st.integers(0, 30), st.integers(1, 8)),
    st.tuples(st.just("decode"), st.integers(0, 30),
              st.lists(st.integers(1, 8), min_size=1, max_size=5)),
    st.tuples(st.just("uncache"), st.lists(st.integers(0, 23), max_size=3)),
    st.tuples(st.just("reset"),),
)


class Req:
    def __init__(self, tokens: list[int], extra: int, hits: int) -> None:
        self.tokens = tokens
        self.extra = extra
        self.cached = hits  # blocks it was handed as hits (computed by others)
        self.hits = hits  # blocks whose KV the reference holds (hits, or computed)
        self.tainted = 1 << 30  # its blocks from here on were computed on invalid KV

    def forked(self, hits: int) -> Req:
        """A fork's child: the same tokens, its first ``hits`` blocks shared."""
        child = Req(list(self.tokens), self.extra, hits)
        child.tainted = self.tainted
        return child


def run_steps(steps, num_blocks: int, events: bool) -> None:
    a = KVCacheManager(num_blocks, BS, seed=0, enable_events=events)
    b = KVCacheManager(num_blocks, BS, seed=0, enable_events=events)
    b._index.runs = False
    truth: dict[int, tuple | None] = {}
    live: dict[str, Req] = {}
    for n, op in enumerate(steps):
        if op[0] == "admit":
            _, c, k, tail, extra, new, cap, keep = op
            tokens = [t for u in (CHAINS[c] if isinstance(c, int) else c)[:k]
                      for t in UNITS[u]] + tail
            kw = {"extra": EXTRAS[extra], "max_hit_tokens": cap}
            ids = both(a, b, "lookup_block_ids", tokens, **kw)
            if isinstance(ids, type):  # (bad input: a multimodal input past the prompt)
                continue
            found = both(a, b, "lookup", tokens, **kw)
            assert found == len(ids) * BS
            for i, x in enumerate(ids):
                assert truth.get(x) == content(tokens, extra, i), ("lookup", i, x)
            got = both(a, b, "add_request", f"r{n}", tokens, num_new_tokens=new, **kw)
            if got is not None and not isinstance(got, type):
                hits = got.num_cached_tokens // BS
                assert got.num_cached_tokens == found and got.block_ids[:hits] == ids
                for i in range(hits):
                    assert truth.get(got.block_ids[i]) == content(tokens, extra, i), (
                        "hit", i, got.block_ids[i])
                live[f"r{n}"] = Req(tokens, extra, hits)
                if not keep:
                    compute(a, live, truth)
                    both(a, b, "free", f"r{n}")
                    del live[f"r{n}"]
        elif op[0] == "free" and live:
            rid = sorted(live)[op[1] % len(live)]
            r = live.pop(rid)
            done = op[2]
            if done is not None:
                done = min(done, a.num_scheduled_tokens(rid))
                own = a.get_block_ids(rid)[max(r.cached, done // BS):
                                          a.num_scheduled_tokens(rid) // BS]
                if any(a._pool.blocks[x].ref_cnt > 1 for x in own):
                    done = None  # (another request computed on them this step: not modelled)
                else:
                    for x in own:
                        truth[x] = None
            both(a, b, "free", rid, num_computed_tokens=done)
        elif op[0] == "fork" and live:
            parent = sorted(live)[op[1] % len(live)]
            if a.num_scheduled_tokens(parent) == a.num_tokens(parent):
                got = both(a, b, "fork", parent, f"f{n}")
                if got is not None:
                    live[f"f{n}"] = live[parent].forked(a.num_tokens(parent) // BS)
        elif op[0] == "extend" and live:
            rid = sorted(live)[op[1] % len(live)]
            left = a.num_tokens(rid) - a.num_scheduled_tokens(rid)
            if left:
                both(a, b, "extend", rid, min(op[2], left))
        elif op[0] == "decode" and live:
            rid = sorted(live)[op[1] % len(live)]
            if a.num_scheduled_tokens(rid) == a.num_tokens(rid):
                if both(a, b, "append_tokens", rid, op[2]) is not None:
                    live[rid].tokens += op[2]
        elif op[0] == "uncache":
            named = {x for x in op[1] if x < num_blocks and a._pool.blocks[x].ref_cnt}
            if isinstance(both(a, b, "uncache_blocks", op[1]), type):  # (refused: no change)
                named = set()
            for x in spread(a, live, named):
                truth[x] = None
        elif op[0] == "reset":
            both(a, b, "reset_prefix_cache")
        compute(a, live, truth)
        both(a, b, "take_kv_ops")  # (the step runs: its copies with it)
        if events:
            a.take_pending_events()
            b.take_pending_events()
        assert [x.ref_cnt for x in a._pool.blocks] == [x.ref_cnt for x in b._pool.blocks]
        assert a.free_block_order() == b.free_block_order()
        for rid in live:
            assert a.get_block_ids(rid) == b.get_block_ids(rid)
        a.check_invariants()
        b.check_invariants()


def spread(a: KVCacheManager, live: dict[str, Req], named: set[int]) -> set[int]:
    """``named`` (blocks ``uncache_blocks`` found invalid) and every block computed on top
    of one by its holders, from the first such block of each on; marks them tainted."""
    grew = True
    while grew:
        grew = False
        for rid, r in live.items():
            bids = a.get_block_ids(rid)[:a.num_scheduled_tokens(rid) // BS]
            at = next((i for i, x in enumerate(bids) if x in named), None)
            if at is not None and at < r.tainted:
                r.tainted = at
            if r.tainted < len(bids):
                more = set(bids[r.tainted:]) - named
                if more:
                    named |= more
                    grew = True
    return named


def compute(a: KVCacheManager, live: dict[str, Req], truth: dict[int, tuple | None]) -> None:
    """The step runs: each live request's own full scheduled blocks hold its prefix (or
    garbage, computed on invalid KV)."""
    for rid, r in live.items():
        bids = a.get_block_ids(rid)
        for i in range(r.hits, a.num_scheduled_tokens(rid) // BS):
            truth[bids[i]] = None if i >= r.tainted else content(r.tokens, r.extra, i)
        r.hits = max(r.hits, a.num_scheduled_tokens(rid) // BS)  # (computed: not again)


@settings(deadline=None, max_examples=60)
@given(st.lists(ops, min_size=10, max_size=60), st.sampled_from([8, 12, 16, 24]),
       st.booleans())
def test_every_hit_holds_the_prompts_own_kv(steps, num_blocks, events):
    run_steps(steps, num_blocks, events)
