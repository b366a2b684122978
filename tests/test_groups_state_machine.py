"""Hypothesis drives the hybrid manager against a plain model and a simulated KV store.

The simulated store plays the engine: into each scheduled slot of each group it writes
what the real K/V there depends on (the group, the request's extra keys and every token
up to that position), applies fork copies, and after every step checks, per group, that
every position a query of the request may still read (from the window of the step's
first query on) is held and holds exactly that; released entries are the null block,
which is never written, and lie wholly below that window. A consumer mirrors the events
per ``(group, hash)``; brute force over every hit length on that mirror must equal
``lookup``.

A rewind past what a window released makes the recompute read lost KV (vLLM's null
block): the store then writes a "lost" value from there on (``taint``: per request, the
first such position; a request sharing a block the recompute rewrites gets it from the
first position rewritten there). Every hit ``lookup_block_ids`` finds must hold exactly
the sound KV of the prompt looked up: never a lost value.
"""

from collections import defaultdict

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from fork_chain import fork_chain_step
from machine_rules import LIVE, SharedRules, case, hit_hashes, prompts_over
from prefixkv import AllBlocksCleared, BlockRemoved, BlockStored, ExtraKeys, PrefixKVError, PromptTooLongError
from prefixkv.groups import HybridKVCacheManager, chunked_local, full_attention, sliding_window
from prefixkv.groups.fit import least_blocks
from prefixkv.hashing import make_hash_fn

BS = 4
BAD = "KV of a failed load, or computed on it"
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4], [1, 2, 3, 4, 9, 9, 9, 9],
            [9, 9, 9, 9, 5, 6, 7, 8, 5, 6, 7, 8]]

prompts = prompts_over(PREFIXES, 9, 14)
salts = st.sampled_from([None, ExtraKeys(cache_salt="a")])


class HybridMachine(SharedRules, RuleBasedStateMachine):
    groups = (full_attention(), sliding_window(6), chunked_local(8))
    num_blocks = 28
    live = LIVE

    @initialize()
    def setup(self):
        self.m = HybridKVCacheManager(self.groups, self.num_blocks, BS, hash_mode="sha256", seed=1,
                                      enable_events=True, max_events=40)
        self.hash_fn, self.root = make_hash_fn("sha256", 1)
        self.null = self.m.null_block_id
        self.kv = [[None] * BS for _ in range(self.num_blocks)]
        self.mirror: dict[tuple[int, bytes], int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.scheduled: dict[str, int] = {}
        self.reserved: dict[str, int] = {}  # slots the tables cover past the tokens
        self.start: dict[str, int] = {}  # first position of the request's last step
        self.furthest: dict[str, int] = {}  # the furthest of them: its windows released there
        self.hit: dict[str, int] = {}  # its admission's hit (tokens): the blocks below it unheld
        self.taint: dict[str, int | None] = defaultdict(lambda: None)  # first position written over lost KV
        self.extra: dict[str, ExtraKeys | None] = {}
        self.preempted: list[tuple[list[int], ExtraKeys | None]] = []
        self.failed: list[tuple[list[int], ExtraKeys | None]] = []  # decoded on a failed load
        self.last = None
        self.next_id = 0

    # ---- the engine's side -------------------------------------------------------

    def _run_copies(self):
        for op in self.m.take_kv_ops():
            assert self.null not in (op.src, op.dst)
            self.kv[op.dst] = list(self.kv[op.src])

    def _kv_of(self, g, rid, pos):
        sound = g, self.extra[rid], tuple(self.tokens[rid][:pos + 1])
        t = self.taint[rid]
        return sound if t is None or pos < t else ("lost", *sound)

    def _write(self, rid, start, stop):
        self._run_copies()
        self.last = (rid, start, stop)
        self._forward(rid, start, stop)

    def _forward(self, rid, start, stop):
        """The forward pass writes positions ``start..stop-1`` of ``rid`` in every group."""
        self.start[rid] = start
        self.furthest[rid] = max(start, self.furthest.get(rid, 0))
        t = self.taint[rid]
        for g, ids in enumerate(self.m.get_block_ids(rid)):
            # an admission's step first rebuilds an uncached window's part of the hit
            # (vLLM's SWA bounded replay: the positions below it its first query reads)
            hit = self.hit.get(rid, 0) if start == self.hit.get(rid) and not self.groups[g].cached else 0
            for pos in range(self.groups[g].first_needed(hit), hit):
                if ids[pos // BS] != self.null:
                    self.kv[ids[pos // BS]][pos % BS] = self._kv_of(g, rid, pos)
            for pos in range(start, stop):
                if ids[pos // BS] == self.null:  # (a recompute over a released window: vLLM
                    assert t is not None and pos >= t, (g, pos)  # writes its null block)
                    continue
                self.kv[ids[pos // BS]][pos % BS] = self._kv_of(g, rid, pos)

    def _resumable(self, rid, p):
        """Whether a recompute may start at ``p`` (a Mamba machine: where a state is)."""
        return True

    def _snapshot(self, rid=None):
        """What a refused call must leave as it was: the pool's order, stats, every live
        request's tables and counts, and the hit of each live request's tokens."""
        m = self.m
        return (m.free_block_order(), m.stats, m.num_cached_blocks, m.num_free_blocks, m.group_stats(),
                {r: (m.get_block_ids(r), m.num_tokens(r), m.num_scheduled_tokens(r),
                     m.lookup(self.tokens[r] + [0], extra=self.extra[r])) for r in self.tokens})

    def _add(self, rid, prompt, extra=None, num_new_tokens=None, num_lookahead_tokens=0,
             require_full_fit=False):
        """``add_request``; None also for a PromptTooLongError, which must need more
        blocks than the pool has whatever the cache holds (``least_blocks``)."""
        try:
            adm = self.m.add_request(rid, prompt, extra=extra, num_new_tokens=num_new_tokens,
                                     num_lookahead_tokens=num_lookahead_tokens,
                                     require_full_fit=require_full_fit)
            if adm is not None:
                self.hit[rid] = adm.num_cached_tokens
            return adm
        except PromptTooLongError:
            usable = self.num_blocks - (self.null is not None)
            assert least_blocks(self.groups, BS, len(prompt), num_new_tokens,
                                num_lookahead_tokens, require_full_fit, 0) > usable
            return None

    def _forget(self, rid):
        del self.tokens[rid], self.scheduled[rid], self.extra[rid], self.start[rid]
        self.taint.pop(rid, None)
        del self.reserved[rid]

    # ---- rules -------------------------------------------------------------------

    def _admit(self, prompt, extra, chunk, lookahead=0, full_fit=False, prepared=None):
        """Admit ``prompt``; through ``prepared`` (a Prompt of it) when given."""
        rid = self._new_id()
        before = self._snapshot()
        given, kw = (prompt, extra) if prepared is None else (prepared, None)
        hit = self.m.lookup_block_ids(given, extra=kw)
        assert self._snapshot() == before
        adm = self._add(rid, given, extra=kw, num_new_tokens=chunk,
                        num_lookahead_tokens=lookahead, require_full_fit=full_fit)
        if adm is None:
            assert self._snapshot() == before and self.m.take_kv_ops() == []
            return multiple()
        assert adm.num_cached_tokens % BS == 0 and adm.num_cached_tokens < len(prompt)
        assert adm.group_block_ids == self.m.get_block_ids(rid)
        k = adm.num_cached_tokens // BS  # the admission's hit is the one looked up
        for spec, h, ids in zip(self.groups, hit, adm.group_block_ids, strict=True):
            if spec.cached:
                assert h == ids[:k] and len(h) == k
            else:  # (an uncached window: its null entries, then fresh blocks for the hit)
                assert h == ids[:len(h)] == (self.null,) * len(h) and self.null not in ids[len(h):k]
        self.tokens[rid] = list(prompt)
        self.extra[rid] = extra
        self.scheduled[rid] = adm.num_cached_tokens + adm.num_new_tokens
        self.reserved[rid] = self.scheduled[rid] + lookahead
        self._write(rid, adm.num_cached_tokens, self.scheduled[rid])
        return rid

    @rule(target=live, prompt=prompts, extra=salts, chunk=st.none() | st.integers(1, 7),
          lookahead=st.integers(0, 5), full_fit=st.booleans())
    def add(self, prompt, extra, chunk, lookahead, full_fit):
        return self._admit(prompt, extra, chunk, lookahead, full_fit)

    @rule(target=live, pre=st.integers(0, len(PREFIXES) - 1), tail=st.integers(0, 9))
    def add_known_prefix(self, pre, tail):
        return self._admit(PREFIXES[pre] + [tail], None, None)

    @precondition(lambda self: self.preempted)
    @rule(target=live, prepare=st.booleans())
    def readmit(self, prepare):
        prompt, extra = self.preempted.pop(0)
        prepared = self.m.prepare(prompt, extra=extra) if prepare else None
        return self._admit(prompt, extra, None, prepared=prepared)

    @rule(target=live, prompt=prompts, extra=salts, chunk=st.none() | st.integers(1, 7),
          times=st.integers(1, 3))
    def add_prepared(self, prompt, extra, chunk, times):
        """One Prompt, prepared once, admitted ``times`` times (n > 1 sampling)."""
        prepared = self.m.prepare(prompt, extra=extra)
        rids = [self._admit(prompt, extra, chunk, prepared=prepared) for _ in range(times)]
        return multiple(*[r for r in rids if isinstance(r, str)])

    @rule(target=live, parent=live, toks=st.lists(st.integers(0, 9), min_size=1, max_size=6),
          twin_first=st.booleans())
    def decode_twin(self, parent, toks, twin_first):
        """A new request of ``parent``'s text so far, then both decode ``toks``: each
        fills its own blocks with the same prefixes, the second a spare (twin) of the
        first in its group (the free and preempt rules then release either first)."""
        if parent not in self.tokens or self.scheduled[parent] != len(self.tokens[parent]):
            return multiple()
        twin = self._admit(list(self.tokens[parent]), self.extra[parent], None)
        if not isinstance(twin, str):
            return multiple()
        for rid in (twin, parent) if twin_first else (parent, twin):
            self.append(rid, toks)
        return twin

    @rule(rid=live, n=st.integers(1, 7))
    def extend(self, rid, n):
        if rid not in self.tokens or self.scheduled[rid] == len(self.tokens[rid]):
            return
        n = min(n, len(self.tokens[rid]) - self.scheduled[rid])
        before = self._snapshot(rid)
        if self.m.extend(rid, n) is None:
            assert self._snapshot(rid) == before
            return
        self.scheduled[rid] += n
        self._write(rid, self.scheduled[rid] - n, self.scheduled[rid])

    @rule(rid=live, toks=st.lists(st.integers(0, 9), min_size=1, max_size=5))
    def append(self, rid, toks):
        if rid not in self.tokens or self.scheduled[rid] != len(self.tokens[rid]):
            return
        before = self._snapshot(rid)
        if self.m.append_tokens(rid, toks) is None:
            assert self._snapshot(rid) == before
            return
        self.tokens[rid] += toks
        self.scheduled[rid] += len(toks)
        self._write(rid, self.scheduled[rid] - len(toks), self.scheduled[rid])

    @rule(data=st.data())
    def step(self, data):
        running = sorted(r for r in self.tokens if self.scheduled[r] == len(self.tokens[r]))
        if not running:
            return
        rids = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True))
        toks = data.draw(st.lists(st.integers(0, 9), min_size=len(rids), max_size=len(rids)))
        before = {r: self.m.get_block_ids(r) for r in rids}
        got = self.m.append_step(rids, toks)
        self.last = None
        grown = dict(got.grown)
        assert set(grown) <= set(rids) and set(got.short) <= set(rids) - set(grown)
        for r, t in zip(rids, toks, strict=True):
            ids = self.m.get_block_ids(r)
            if r in got.short:
                assert ids == before[r]
                continue
            added = grown.get(r, ((),) * len(self.groups))
            for i, a, old in zip(ids, added, before[r], strict=True):  # (at the end, or a
                # Mamba entry the step ends on, empty before: test_groups_mamba's holes)
                new = [b for j, b in enumerate(i) if (j >= len(old) or b != old[j]) and b != self.null]
                assert new == list(a), (r, old, i, a)
            self.tokens[r].append(t)
            self.scheduled[r] += 1
            self._write(r, self.scheduled[r] - 1, self.scheduled[r])
        self.last = None

    @rule(rid=live, back=st.integers(0, 12))
    def rewind_and_recompute(self, rid, back):
        # the KV after a point turned out invalid (a failed load): back to it, then the
        # step recomputing the same tokens (blocks other requests share are rewritten in
        # place). The point lies where every group's window still holds what a query
        # there reads (below, the engine would read released blocks: vLLM's scheduler
        # does, prefixkv as it)
        if rid not in self.tokens:
            return
        s, cuts = self.scheduled[rid], [ids.count(self.null) for ids in self.m.get_block_ids(rid)]
        p = max(0, s - back)
        while p <= s and (any(g.num_unread(p, BS) < c for g, c in zip(self.groups, cuts, strict=True))
                          or not self._resumable(rid, p)):
            p += 1
        if p > s:
            return
        if self.taint[rid] is not None:  # (its recompute writes lost KV from there on:
            self._taint_sharers(rid, max(p, self.taint[rid]))  # into the blocks shared too)
        gone = self.tokens[rid][p:]
        self.m.rewind(rid, p)
        self.tokens[rid] = self.tokens[rid][:p]
        self.reserved[rid] = max(self.reserved[rid], s)
        self.scheduled[rid] = p
        self.m.check_invariants()
        n = s - p
        if n:  # (the tables cover them: never short)
            assert self.m.append_tokens(rid, gone[:n]) is not None
            self.tokens[rid] += gone[:n]
            self.scheduled[rid] += n
            self._write(rid, p, p + n)
            self.last = None  # (aborting it would leave the same KV in blocks it shares)

    def _taint_sharers(self, rid, p):
        """Every other live request holding a block of ``rid`` that a recompute writing
        lost KV from ``p`` on rewrites holds it too: tainted from the first position
        rewritten there."""
        mine = self.m.get_block_ids(rid)
        rewritten = {(g, b) for g, ids in enumerate(mine) for b in ids[p // BS:] if b != self.null}
        for other in self.tokens:
            if other != rid:
                js = [j for g, ids in enumerate(self.m.get_block_ids(other))
                      for j, b in enumerate(ids) if j >= p // BS and (g, b) in rewritten]
                if js:
                    first = max(p, min(js) * BS)
                    t = self.taint[other]
                    self.taint[other] = first if t is None else min(t, first)

    def _lost(self, rid, p):
        """Whether a recompute of ``rid`` from ``p`` reads KV a window released."""
        cuts = [ids.count(self.null) for ids in self.m.get_block_ids(rid)]
        rebuilt = self.hit.get(rid, 0)  # (an uncached window holds what the engine replayed)
        return any(g.num_unread(p, BS) < c or (not g.cached and g.first_needed(p) < g.first_needed(rebuilt))
                   for g, c in zip(self.groups, cuts, strict=True))

    @rule(rid=live, pick=st.integers(0, 40), tail=st.lists(st.integers(0, 9), max_size=5))
    def rewind_past_released(self, rid, pick, tail):
        # the same, from a point where a window already released what a query there
        # reads (vLLM's scheduler does it: the recompute reads its null block): from
        # there the store writes lost KV, also into the blocks shared with other
        # requests (the same tokens again: pins), which hold lost KV from there on
        if rid not in self.tokens:
            return
        s = self.scheduled[rid]
        points = [p for p in range(s) if self._lost(rid, p)]
        if not points:
            return
        p = points[pick % len(points)]
        self._taint_sharers(rid, p)
        gone = self.tokens[rid][p:]
        self.m.rewind(rid, p)
        t = self.taint[rid]
        self.taint[rid] = p if t is None else min(t, p)
        self.tokens[rid] = self.tokens[rid][:p]
        self.reserved[rid] = max(self.reserved[rid], s)
        self.scheduled[rid] = p
        self.m.check_invariants()
        first = gone[:s - p]  # (the tables cover them: never short)
        for toks in (first, gone[s - p:] + tail):
            n = self.scheduled[rid]
            if toks and self.m.append_tokens(rid, toks) is not None:
                self.tokens[rid] += toks
                self.scheduled[rid] += len(toks)
                self._write(rid, n, n + len(toks))
            else:
                assert toks is not first
            self.last = None

    @rule(rid=live, back=st.integers(1, 3), recompute=st.booleans(),
          toks=st.lists(st.integers(0, 9), min_size=1, max_size=6))
    def fail_load(self, rid, back, recompute, toks):
        """A load into ``rid``'s full block ``j`` (``back`` blocks before its last full
        one) failed: its KV there is garbage (``BAD``) and ``uncache_blocks`` names it.
        Then the request either recomputes from ``j`` (a rewind, where every window still
        holds what a query there reads) or decodes ``toks`` on top of it (their KV is
        garbage too) and goes. No later hit may hand out any of it: the next admissions'
        KV checks read what they hit, and the events must still predict ``lookup``.
        Only where no other live request holds a block of ``rid`` from ``j`` on."""
        if rid not in self.tokens or self.scheduled[rid] != len(self.tokens[rid]):
            return
        s = self.scheduled[rid]
        j = s // BS - back
        mine = self.m.get_block_ids(rid)
        failed = [ids[j] for ids in mine if j >= 0 and ids[j] != self.null]
        others = {b for r in self.tokens if r != rid for ids in self.m.get_block_ids(r) for b in ids}
        if not failed or others & {b for ids in mine for b in ids[j:]}:
            return
        self.last = None
        for b in failed:
            self.kv[b] = [BAD] * BS
        self.m.uncache_blocks(failed)
        self.m.check_invariants()
        p = j * BS
        cuts = [ids.count(self.null) for ids in mine]
        if recompute and self._resumable(rid, p) and all(
                g.num_unread(p, BS) >= c for g, c in zip(self.groups, cuts, strict=True)):
            gone = self.tokens[rid][p:]
            self.m.rewind(rid, p)
            self.tokens[rid] = self.tokens[rid][:p]
            self.reserved[rid] = max(self.reserved[rid], s)
            self.scheduled[rid] = p
            assert self.m.append_tokens(rid, gone) is not None
            self.tokens[rid] += gone
            self.scheduled[rid] = s
            self._write(rid, p, s)
            self.last = None
            return
        if self.m.append_tokens(rid, toks) is not None:
            for ids in self.m.get_block_ids(rid):
                for pos in range(s, s + len(toks)):
                    if ids[pos // BS] != self.null:
                        self.kv[ids[pos // BS]][pos % BS] = BAD
            self.failed = [*self.failed[-3:], (self.tokens[rid] + toks, self.extra[rid])]
        self.m.free(rid)
        self._forget(rid)

    @rule(target=live, rid=live, toks=st.lists(st.integers(0, 9), min_size=BS, max_size=BS + 3),
          tail=st.lists(st.integers(0, 9), min_size=BS + 1, max_size=2 * BS + 1),
          more=st.lists(st.integers(0, 9), max_size=5))
    def fail_load_under_hits(self, rid, toks, tail, more):
        """The chain through hits: ``b`` computes ``rid``'s last full block J again (a
        spare of it) and, on it, a block J+1 of ``toks``; ``c`` hits b's block J+1 and
        computes its ``tail`` on it; ``d`` computes block J+1 again on rid's sound block
        J (a spare of b's: the prefix stays found). Then b's load of block J is found to
        have failed: b's KV from J on is garbage, and so is c's from the first of those
        blocks it holds (what it computed read them). ``uncache_blocks`` names b's block
        J alone; c decodes ``more`` over garbage; b and c go, d stays. Only where no
        other live request holds a block made garbage."""
        if rid not in self.tokens or self.scheduled[rid] != len(self.tokens[rid]) \
                or len(self.tokens[rid]) < BS:
            return multiple()
        extra, full = self.extra[rid], len(self.tokens[rid]) // BS
        j = full - 1
        b = self._admit(self.tokens[rid][:full * BS], extra, None)
        if not isinstance(b, str):
            return multiple()
        self.append(b, toks)
        made = [b]
        if len(self.tokens[b]) >= (j + 2) * BS:
            made.append(self._admit(self.tokens[b][:(j + 2) * BS] + tail, extra, None))
            made.append(self._admit(self.tokens[b][:(j + 2) * BS], extra, None))
        made = [r for r in made if isinstance(r, str)]
        if len(made) < 3:
            return multiple(*made)
        b, c, d = made
        null = self.null
        rows = self.m.get_block_ids(b)
        bad = {ids[i] for ids in rows for i in range(j, len(ids)) if ids[i] != null}
        k = min((i for ids in self.m.get_block_ids(c) for i, x in enumerate(ids) if x in bad),
                default=None)
        if k is not None:  # (c read b's garbage from block k on)
            bad |= {ids[i] for ids in self.m.get_block_ids(c) for i in range(k, len(ids))
                    if ids[i] != null}
        held = {x for r in self.tokens if r not in (b, c) for ids in self.m.get_block_ids(r)
                for x in ids}
        if held & bad:
            return multiple(*made)
        self.last = None
        for x in bad:
            self.kv[x] = [BAD] * BS
        self.m.uncache_blocks([ids[j] for ids in rows if ids[j] != null])
        self.m.check_invariants()
        s = self.scheduled[c]
        if more and k is None:
            self.append(c, more)
        elif more and self.m.append_tokens(c, more) is not None:
            self.tokens[c] += more
            self.scheduled[c] += len(more)
            for ids in self.m.get_block_ids(c):
                for pos in range(s, s + len(more)):
                    if ids[pos // BS] != null:
                        self.kv[ids[pos // BS]][pos % BS] = BAD
        self.failed = [*self.failed[-2:], (self.tokens[b], extra), (self.tokens[c], extra)]
        for r in (b, c):
            self.m.free(r)
            self._forget(r)
        return d

    @rule(rid=live, n=st.integers(0, 9))
    def reserve(self, rid, n):
        if rid not in self.tokens:
            return
        before = self._snapshot(rid)
        got = self.m.reserve(rid, n)
        if got is None:
            assert self._snapshot(rid) == before
            return
        self.reserved[rid] = max(self.reserved[rid], self.scheduled[rid] + n)
        assert all(i[len(i) - len(a):] == a for i, a in zip(self.m.get_block_ids(rid), got, strict=True))

    @rule(target=live, parent=live)
    def fork(self, parent):
        if parent not in self.tokens or self.scheduled[parent] != len(self.tokens[parent]):
            return multiple()
        child = self._new_id()
        before = self._snapshot()
        got = self.m.fork(parent, child)
        if got is None:
            assert self._snapshot() == before and self.m.take_kv_ops() == []
            return multiple()
        self.last = None
        self._run_copies()
        assert got.group_block_ids == self.m.get_block_ids(child)
        self.tokens[child] = list(self.tokens[parent])
        self.extra[child] = self.extra[parent]
        self.scheduled[child] = self.scheduled[parent]
        self.reserved[child] = self.reserved[parent]
        self.start[child] = self.start[parent]
        self.furthest[child], self.hit[child] = self.furthest[parent], self.hit[parent]
        self.taint[child] = self.taint[parent]
        return child

    @rule(rid=live, call=st.sampled_from(["extend", "append", "reserve", "fork", "add", "free",
                                          "rewind", "step", "uncache"]))
    def refused(self, rid, call):
        """A call refused with a typed error (bad input) changes nothing."""
        if rid not in self.tokens:
            return
        m, n = self.m, self.scheduled[rid]
        calls = {
            "extend": lambda: m.extend(rid, len(self.tokens[rid]) - n + 1),
            "append": lambda: m.append_tokens(rid, [1, -1]),
            "reserve": lambda: m.reserve(rid, -1),
            "fork": lambda: m.fork(rid, rid),
            "add": lambda: m.add_request(rid, [1, 2, 3]),
            "free": lambda: m.free(rid, num_computed_tokens=n + 1),
            "rewind": lambda: m.rewind(rid, n + 1),
            "step": lambda: m.append_step([rid, rid], [1, 2]),
            "uncache": lambda: m.uncache_blocks([self.num_blocks]),
        }
        before = self._snapshot()
        try:
            calls[call]()
        except PrefixKVError:
            pass
        else:
            raise AssertionError(f"{call} was not refused")
        assert self._snapshot() == before, call

    @rule(target=live, parent=live, depth=st.integers(1, 3), gone=st.sets(st.integers(0, 3)),
          toks=st.lists(st.integers(0, 9), max_size=4), prompt=st.none() | prompts)
    def fork_chain(self, parent, depth, gone, toks, prompt):
        """One step, no copy run until its end: fork ``parent`` into a chain of ``depth``
        children, each forked from the one before (a fork of a fork); append ``toks[i]``
        to member i (the parent is member 0); free the members in ``gone`` (pruned before
        the step ran); admit ``prompt`` (it may take a freed block); then run the copies
        and the forward pass."""
        models = (self.tokens, self.extra, self.scheduled, self.reserved, self.start, self.taint,
                  self.furthest, self.hit)
        return fork_chain_step(self, parent, depth, gone, toks, prompt, models, self._run_copies)

    @precondition(lambda self: self.last is not None and self.last[0] in self.tokens)
    @rule()
    def abort_before_step_ran(self):
        rid, start, stop = self.last
        for ids in self.m.get_block_ids(rid):
            for pos in range(start, stop):
                self.kv[ids[pos // BS]][pos % BS] = "never computed"
        self.m.free(rid, num_computed_tokens=start)
        self._forget(rid)
        self.last = None

    @rule(rid=consumes(live))
    def preempt(self, rid):
        self.last = None
        if rid in self.tokens:
            assert list(self.m.preempt(rid)) == self.tokens[rid]
            if self.tokens[rid]:  # (none: rewound to 0)
                self.preempted.append((self.tokens[rid], self.extra[rid]))
            self._forget(rid)

    # ---- invariants --------------------------------------------------------------

    @invariant()
    def no_group_reads_kv_it_does_not_hold(self):
        for rid in self.tokens:
            for g, (spec, ids) in enumerate(zip(self.groups, self.m.get_block_ids(rid), strict=True)):
                assert len(ids) == -(-max(self.scheduled[rid], self.reserved[rid]) // BS) + spec.ahead
                reach = spec.first_needed(self.start[rid])
                # a window keeps its retained tokens' blocks: it released none past them at
                # its furthest step, and holds all its admission's hit reads
                kept = max(spec.first_needed(self.hit[rid]),
                           spec.first_needed(self.furthest[rid]) - spec.retained) // BS
                t = self.taint[rid]
                for j, b in enumerate(ids):
                    if b == self.null:
                        assert spec.releases and ((j + 1) * BS <= reach or t is not None), (rid, g, j)
                        assert j < kept or t is not None, (rid, g, j, "a retained block released")
                if not spec.cached:  # (below its replay at admission: never computed)
                    reach = max(reach, spec.first_needed(self.hit[rid]))
                for pos in range(reach, self.scheduled[rid] if t is None else min(t, self.scheduled[rid])):
                    b = ids[pos // BS]
                    if b != self.null:  # (below a lost recompute's start: released)
                        assert self.kv[b][pos % BS] == self._kv_of(g, rid, pos), (rid, g, pos)
        assert all(v is None for v in self.kv[self.null]) if self.null is not None else True
        if not self.tokens:
            reserved = 0 if self.null is None else 1
            assert self.m.num_free_blocks == self.num_blocks - reserved

    @invariant()
    def the_manager_never_caches_what_the_model_marks_lost(self):
        # its ``tainted_from`` (no block from there on cached) is at or before the model's
        for rid in self.tokens:
            t, got = self.taint[rid], self.m._requests[rid].tainted_from
            assert t is None or (got is not None and got <= t), (rid, got, t)

    @invariant()
    def reads_released_is_where_a_window_released_what_a_query_reads(self):
        if any(g.sparse for g in self.groups):
            return  # (a Mamba state: test_groups_rewind.py)
        for rid in self.tokens:
            for p in range(self.scheduled[rid] + 1):
                assert self.m.reads_released(rid, p) == self._lost(rid, p), (rid, p)

    def _candidates(self):
        """Prompts a later request may bring: the known prefixes, each live and
        preempted request's tokens and those decoded on a failed load, one more token
        each."""
        out = [(p + [0], None) for p in PREFIXES]
        out += [(t + [0], self.extra[r]) for r, t in self.tokens.items()]
        return out + [(t + [0], e) for t, e in self.preempted + self.failed]

    @invariant()
    def hits_hold_sound_kv(self):
        # what a later request would hit holds the KV of exactly its tokens, computed over
        # sound KV (never a lost recompute's, nor one of a block never computed)
        for prompt, extra in self._candidates():
            for g, ids in enumerate(self.m.lookup_block_ids(prompt, extra=extra)):
                if self.groups[g].sparse:
                    continue  # (states: MambaMachine checks the hits it takes)
                for j, b in enumerate(ids):
                    if b != self.null:
                        for pos in range(j * BS, (j + 1) * BS):
                            assert self.kv[b][pos % BS] == (g, extra, tuple(prompt[:pos + 1])), (g, j, b)

    @invariant()
    def events_predict_lookup(self):
        for ev in self.m.take_events():
            if isinstance(ev, AllBlocksCleared):
                self.mirror.clear()
            elif isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    key = (ev.group_idx, h)
                    self.mirror[key] = self.mirror.get(key, 0) + 1
                    assert self.mirror[key] == 1
            else:
                assert isinstance(ev, BlockRemoved)
                for h in ev.block_hashes:
                    del self.mirror[(ev.group_idx, h)]
        for prompt, extra in self._candidates():
            hashes = hit_hashes(self.hash_fn, self.root, prompt, extra, BS)
            cached = [[(g, h) in self.mirror for h in hashes] for g in range(len(self.groups))]
            assert self.m.lookup(prompt, extra=extra) == BS * brute_force(self.groups, len(hashes), cached)


def brute_force(groups, limit, cached):
    def accepts(g, k):
        if not groups[g].cached:  # (never looked up: any hit)
            return True
        lo = groups[g].first_needed(k * BS) // BS
        return all(cached[g][lo:k])
    return max(k for k in range(limit + 1) if all(accepts(g, k) for g in range(len(groups))))


class SlidingOnlyMachine(HybridMachine):
    """A model of sliding-window layers only (Mistral-like): no group holds block 0."""

    groups = (sliding_window(5),)
    num_blocks = 12


class TwoWindowsMachine(HybridMachine):
    """Two windows and a full group in a small pool: constant eviction."""

    groups = (sliding_window(4), full_attention(), sliding_window(9))
    num_blocks = 16


class RetainedMachine(HybridMachine):
    """Windows that retain tokens below them (vLLM's ``extra_retained_tokens``): released
    later than their queries leave them, never asked of a hit."""

    groups = (sliding_window(3, 5), full_attention(), sliding_window(6, 2))
    num_blocks = 20


class TwinWindowsMachine(HybridMachine):
    """Two copies of one window beside full attention (gemma3-like in small): a step that
    releases the same blocks in both takes its order in rounds
    (``release_order.in_rounds``), when every hit reading them is alive."""

    groups = (sliding_window(8), full_attention(), sliding_window(8))
    num_blocks = 16


class UncachedWindowMachine(HybridMachine):
    """A window never cached nor looked up (vLLM's SWA bounded replay) beside a full and
    a cached window: hits are the cached groups' alone."""

    groups = (sliding_window(6, cached=False), full_attention(), sliding_window(5))
    num_blocks = 20


class AheadMachine(HybridMachine):
    """Windows holding blocks past their tables' ends (``GroupSpec.ahead``: vLLM's
    speculative blocks of Mamba in none mode, a 2-token window), the first group's
    included (its table's length measures growth): every step keeps them that many
    ahead; the store checks the positions below them."""

    groups = (sliding_window(2, ahead=2), full_attention(), sliding_window(5, ahead=1))
    num_blocks = 24


TestHybridMachine = case(HybridMachine, max_examples=60, stateful_step_count=40)
TestSlidingOnlyMachine = case(SlidingOnlyMachine, max_examples=60, stateful_step_count=40)
TestTwoWindowsMachine = case(TwoWindowsMachine, max_examples=60, stateful_step_count=40)
TestTwinWindowsMachine = case(TwinWindowsMachine, max_examples=60, stateful_step_count=40)
TestRetainedMachine = case(RetainedMachine, max_examples=60, stateful_step_count=40)
TestUncachedWindowMachine = case(UncachedWindowMachine, max_examples=60, stateful_step_count=40)
TestAheadMachine = case(AheadMachine, max_examples=50, stateful_step_count=40)
