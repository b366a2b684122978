"""Pending runs and late-cut prompts (``Chunks``) on the paths their own tests leave out:
``rewind``, ``preempt`` and a resumed re-admission, ``read_cache=False`` spares, a
manager whose ``pending_runs`` is switched while runs are pending, and prompts cut late
(``CUT_LATE`` patched low, so every prompt's chunks are a ``Chunks``).

Three managers take the same ops: ``a`` records runs (pending ones, while its switch is
on), ``b`` records none (every block alone), ``c`` records runs with events on (lazy
events: its runs are written as stored). After every op their answers, counts, free
order and tables must agree; every hit and every block ``lookup_block_ids`` names must
hold the KV it was really computed for (``test_pending_truth``'s reference); and ``c``'s
events must predict ``lookup``: a ``BlockStored`` for every findable block, a
``BlockRemoved`` for each that stops being findable (nothing removed that was not
stored), each run's parent announced before it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import AllBlocksCleared, BlockStored, KVCacheManager
from prefixkv.core import prompt as prompt_module
from prefixkv.core.prompt import encode_prompt
from prefixkv.hashing import chain, make_hash_fn, token_bytes
from test_pending_truth import BS, CHAINS, EXTRAS, UNITS, Req, compute, content, spread

MODE = "sha256"

chains = st.one_of(st.integers(0, len(CHAINS) - 1),
                   st.lists(st.integers(0, len(UNITS) - 1), min_size=3, max_size=14))
admits = st.tuples(st.just("admit"), chains, st.integers(1, 14),
                   st.lists(st.integers(1, 8), max_size=3), st.sampled_from([0, 0, 0, 1, 2, 3, 4]),
                   st.none() | st.integers(1, 14), st.none() | st.integers(0, 24),
                   st.booleans(), st.sampled_from([True, True, True, False]),
                   st.sampled_from([0, 0, 0, 1, 3]), st.booleans(), st.sampled_from([0, 0, 0, 2]),
                   st.booleans())
ops = st.one_of(
    admits, admits, admits, admits, admits, admits,
    st.tuples(st.just("free"), st.integers(0, 30), st.none() | st.integers(0, 24)),
    st.tuples(st.just("preempt"), st.integers(0, 30), st.none() | st.integers(0, 24),
              st.booleans()),
    st.tuples(st.just("rewind"), st.integers(0, 30), st.integers(0, 30)),
    st.tuples(st.just("fork"), st.integers(0, 30)),
    st.tuples(st.just("extend"), st.integers(0, 30), st.integers(1, 8)),
    st.tuples(st.just("decode"), st.integers(0, 30),
              st.lists(st.integers(1, 8), min_size=1, max_size=5)),
    st.tuples(st.just("uncache"), st.lists(st.integers(0, 23), max_size=3)),
    st.tuples(st.just("step"), st.lists(st.integers(1, 8), min_size=1, max_size=6)),
    st.tuples(st.just("reserve"), st.integers(0, 30), st.integers(0, 5)),
    st.tuples(st.just("switch"),),
    st.tuples(st.just("reset"), st.integers(0, 3)),
)


def alike(ms: list[KVCacheManager], call: str, *args, **kw):
    """The call on each manager: the same answer, or the same exception type."""
    out = []
    for m in ms:
        try:
            out.append(getattr(m, call)(*args, **kw))
        except Exception as e:  # noqa: BLE001 (compared below: all must raise alike)
            out.append(type(e))
    assert all(x == out[0] for x in out), (call, args, out)
    return out[0]


class Mirror:
    """A router's view of ``m``'s events: how many blocks hold each chain hash."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m, self.count = m, {}
        self.fn, self.root = make_hash_fn(MODE, 0)

    def drain(self) -> None:
        for ev in self.m.take_events():
            if isinstance(ev, AllBlocksCleared):
                self.count.clear()
            elif isinstance(ev, BlockStored):
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.count, (
                    "stored before its parent", ev)
                for h in ev.block_hashes:
                    self.count[h] = self.count.get(h, 0) + 1
            else:
                for h in ev.block_hashes:
                    assert self.count.get(h), ("removed, never stored", ev)
                    self.count[h] -= 1
                    if not self.count[h]:
                        del self.count[h]

    def predict(self, tokens: list[int], extra: int) -> int:
        """The tokens of ``tokens`` a lookup finds, as the events tell it."""
        enc, keys, _ = encode_prompt(tokens, EXTRAS[extra], BS, None)
        n = (len(tokens) - 1) // BS
        hashes, _ = chain(self.fn, self.root, token_bytes(enc)[:4 * n * BS],
                          keys.of_blocks(0, n))
        k = 0
        while k < n and hashes[k] in self.count:
            k += 1
        return k * BS


def run_steps(steps, num_blocks: int, every: int = 1) -> None:
    a = KVCacheManager(num_blocks, BS, seed=0, hash_mode=MODE)
    b = KVCacheManager(num_blocks, BS, seed=0, hash_mode=MODE)
    b._index.runs = False
    c = KVCacheManager(num_blocks, BS, seed=0, hash_mode=MODE, enable_events=True)
    ms = [a, b, c]
    mirror = Mirror(c)
    truth: dict[int, tuple | None] = {}
    live: dict[str, Req] = {}
    seen: list[tuple[list[int], int]] = []

    def admit(rid: str, tokens: list[int], extra: int, new, cap, keep: bool, read: bool,
              ahead: int = 0, prepared: bool = False, keep_free: int = 0,
              full_fit: bool = False, resumed: bool = False) -> None:
        kw: dict = {"extra": EXTRAS[extra], "max_hit_tokens": cap}
        given: object = tokens
        if prepared:  # (a Prompt prepared once, taken by each manager)
            try:
                given = a.prepare(tokens, extra=EXTRAS[extra])
            except ValueError:
                return
            del kw["extra"]
        ids = alike(ms, "lookup_block_ids", given, **kw)
        if isinstance(ids, type):  # (bad input: a multimodal input past the prompt)
            return
        seen.append((tokens, extra))
        found = alike(ms, "lookup", given, **kw)
        assert found == len(ids) * BS
        for i, x in enumerate(ids):
            assert truth.get(x) == content(tokens, extra, i), ("lookup", i, x)
        got = alike(ms, "add_request", rid, given, num_new_tokens=new, read_cache=read,
                    resumed=resumed, num_lookahead_tokens=ahead, keep_free=keep_free,
                    require_full_fit=full_fit, **kw)
        if got is None or isinstance(got, type):
            return
        hits = got.num_cached_tokens // BS
        assert got.block_ids[:hits] == (ids if read else ())
        for i in range(hits):
            assert truth.get(got.block_ids[i]) == content(tokens, extra, i), (
                "hit", i, got.block_ids[i])
        live[rid] = Req(tokens, extra, hits)
        if not keep:
            compute(a, live, truth)
            alike(ms, "free", rid)
            del live[rid]

    def done_of(rid: str, r: Req, done):
        """``num_computed_tokens`` for a free of ``rid``; its blocks past it are garbage."""
        if done is None:
            return None
        done = min(done, a.num_scheduled_tokens(rid))
        own = a.get_block_ids(rid)[max(r.cached, done // BS):a.num_scheduled_tokens(rid) // BS]
        if any(a._pool.blocks[x].ref_cnt > 1 for x in own):
            return None  # (another request computed on them this step: not modelled)
        for x in own:
            truth[x] = None
        return done

    for n, op in enumerate(steps):
        if op[0] == "admit":
            _, ch, k, tail, extra, new, cap, keep, read, ahead, prepared, free, fit = op
            tokens = [t for u in (CHAINS[ch] if isinstance(ch, int) else ch)[:k]
                      for t in UNITS[u]] + tail
            admit(f"r{n}", tokens, extra, new, cap, keep, read, ahead, prepared, free, fit)
        elif op[0] == "free" and live:
            rid = sorted(live)[op[1] % len(live)]
            r = live.pop(rid)
            alike(ms, "free", rid, num_computed_tokens=done_of(rid, r, op[2]))
        elif op[0] == "preempt" and live:
            rid = sorted(live)[op[1] % len(live)]
            r = live.pop(rid)
            tokens = alike(ms, "preempt", rid, num_computed_tokens=done_of(rid, r, op[2]))
            assert list(tokens) == r.tokens
            if op[3]:
                admit(f"p{n}", list(tokens), r.extra, None, None, True, True, resumed=True)
        elif op[0] == "rewind" and live:
            rid = sorted(live)[op[1] % len(live)]
            r = live[rid]
            back = min(op[2], a.num_scheduled_tokens(rid))
            tail = a.get_block_ids(rid)[back // BS:a.num_scheduled_tokens(rid) // BS]
            if not isinstance(alike(ms, "rewind", rid, back), type):
                full = back // BS
                for x in tail:
                    truth[x] = None
                r.hits, r.cached = min(r.hits, full), min(r.cached, full)
                if r.tainted >= full:  # (recomputed on valid KV from here on)
                    r.tainted = 1 << 30
        elif op[0] == "fork" and live:
            parent = sorted(live)[op[1] % len(live)]
            if a.num_scheduled_tokens(parent) == a.num_tokens(parent):
                if alike(ms, "fork", parent, f"f{n}") is not None:
                    live[f"f{n}"] = live[parent].forked(a.num_tokens(parent) // BS)
        elif op[0] == "extend" and live:
            rid = sorted(live)[op[1] % len(live)]
            left = a.num_tokens(rid) - a.num_scheduled_tokens(rid)
            if left:
                alike(ms, "extend", rid, min(op[2], left))
        elif op[0] == "decode" and live:
            rid = sorted(live)[op[1] % len(live)]
            if a.num_scheduled_tokens(rid) == a.num_tokens(rid):
                if alike(ms, "append_tokens", rid, op[2]) is not None:
                    live[rid].tokens += op[2]
        elif op[0] == "uncache":
            named = {x for x in op[1] if x < num_blocks and a._pool.blocks[x].ref_cnt}
            if isinstance(alike(ms, "uncache_blocks", op[1]), type):  # (refused: no change)
                named = set()
            for x in spread(a, live, named):
                truth[x] = None
        elif op[0] == "step":  # one decode step of every request fully scheduled
            rids = [rid for rid in sorted(live)
                    if a.num_scheduled_tokens(rid) == a.num_tokens(rid)]
            toks = [op[1][i % len(op[1])] for i in range(len(rids))]
            got = alike(ms, "append_step", rids, toks)
            if not isinstance(got, type):
                for rid, t in zip(rids, toks, strict=True):
                    if rid not in got.short:
                        live[rid].tokens.append(t)
        elif op[0] == "reserve" and live:
            alike(ms, "reserve", sorted(live)[op[1] % len(live)], op[2])
        elif op[0] == "switch":  # (runs recorded pending stay so; new ones follow it)
            a._index.pending_runs = not a._index.pending_runs
        elif op[0] == "reset" and not op[1]:  # (one in four: it empties everything)
            alike(ms, "reset_prefix_cache")
        compute(a, live, truth)
        alike(ms, "take_kv_ops")  # (the step runs: its copies with it)
        assert [x.ref_cnt for x in a._pool.blocks] == [x.ref_cnt for x in b._pool.blocks] \
            == [x.ref_cnt for x in c._pool.blocks]
        assert a.free_block_order() == b.free_block_order() == c.free_block_order()
        for rid in live:
            assert a.get_block_ids(rid) == b.get_block_ids(rid) == c.get_block_ids(rid)
        assert a.num_cached_blocks == b.num_cached_blocks == c.num_cached_blocks
        assert a.stats == b.stats == c.stats
        assert alike(ms, "shared_prefixes", sorted(live)) is not None
        for m in ms:
            m.check_invariants()
        if n % every:  # (events taken every ``every`` steps: built late, lazily)
            continue
        mirror.drain()
        for tokens, extra in seen[-8:] + [(r.tokens, r.extra) for r in live.values()]:
            assert mirror.predict(tokens, extra) == c.lookup(tokens, extra=EXTRAS[extra]), (
                "events", tokens, extra)


@settings(deadline=None, max_examples=60)
@given(st.lists(ops, min_size=10, max_size=60), st.sampled_from([8, 12, 16, 24]),
       st.sampled_from([1, 3, 512]), st.sampled_from([1, 1, 4]))
def test_pending_runs_and_late_cuts_hold_the_prompts_own_kv(steps, num_blocks, cut_late, every):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prompt_module, "CUT_LATE", cut_late)
        run_steps(steps, num_blocks, every)
