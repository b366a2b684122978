"""The tiers reference machine (``test_tiers_reference``: two managers with host tiers
on one real Redis, fetches that land late, never, twice or after their request left,
failed loads named to ``uncache_blocks``) with what it lacked, combined with all of it:

- plans taken with ``pending=True`` (their copies run while the next step is
  scheduled) and reported done later: meanwhile, a host slot such a plan reads or
  writes keeps its bytes (a store fetch's thread writes attached memory at once), and
  ``reset_prefix_cache`` is refused;
- ``fork`` of a live request (one whose blocks a failed load cut included), and
  preemption of a running request, re-admitted at once or not;
- ``rewind`` of a live request (a recompute from an earlier point, its blocks then
  found again once recomputed), refused only for a block another live request (or a
  plan's pending copy) holds too;
- a block a store fetch holds (its device hits in flight, its run once landed, maybe hit
  by another request) found invalid (``uncache_blocks``) or rewound: the fetch gives it
  up (``core/store_giveup.py``), the rewind is never refused for it
  (``fetch_over_live`` builds the case, ``rewind_a_fetch_hit`` takes it anywhere);
- the events: every chain ``lookup`` finds is announced, and nothing more (a router
  following the events predicts ``lookup`` for every prompt seen and every live one).

After every step every live request's blocks hold exactly its KV, and ``check_invariants``
holds (the base machines' invariants)."""

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from prefixkv import BlockLoads, BlockOffloads, KVCacheManager
from prefixkv.errors import RequestError
from test_index import Mirror

from . import test_store_machine as base
from . import test_tiers_reference as tiers

BS = base.BS


@pytest.fixture(autouse=True)
def _server(redis_url):
    base.URL[:] = [redis_url]


class TrustMachine(tiers.TiersReferenceMachine):

    @initialize()
    def setup(self):
        super().setup()
        for e in self.engines:  # the same managers, with events on
            n, hb = len(e.kv), len(e.host)
            e.m = KVCacheManager(n, BS, hash_mode="sha256", host_blocks=hb, store=self.shared,
                                 enable_events=True)
            if e.memory is not None:
                e.m.attach_host_memory([[memoryview(e.memory)[16 * i:16 * (i + 1)]] for i in range(hb)])
            e.mirror = Mirror(e.m, "sha256", None)
            e.flight = None  # a pending plan's host slots -> their bytes when it was taken
            e.overlap = False  # every plan taken pending (an engine with async scheduling)
        self.gave_up: set[int] = set()  # fetches a rewind made give up blocks (their ids)

    # ---- plans whose copies still run --------------------------------------------------

    def _run_plan(self, e, pending=False):
        if e.flight is not None:  # (the engine waits for the last plan's copies first)
            self._done(e)
        pending = pending or e.overlap
        ops = e.m.take_kv_ops(pending=pending)
        e.m.take_kv_ops = lambda: ops
        try:
            super()._run_plan(e)
        finally:
            e.m.__dict__.pop("take_kv_ops", None)
        if pending:
            slots = {s for op in ops if isinstance(op, BlockLoads) for s in op.src}
            slots |= {s for op in ops if isinstance(op, BlockOffloads) for s in op.dst}
            e.flight = {s: self._slot_bytes(e, s) for s in slots}
            event(f"a pending plan: {'with' if slots else 'no'} host slots")

    def _slot_bytes(self, e, s):
        return bytes(e.memory[16 * s:16 * (s + 1)]) if e.memory is not None else tuple(e.host[s] or ())

    def _done(self, e):
        for s, was in e.flight.items():
            assert self._slot_bytes(e, s) == was, f"host slot {s} rewritten while a plan read it"
        e.m.kv_ops_done()
        e.flight = None

    @rule(i=base.side)
    def take_plan_pending(self, i):
        """The engine takes the step's plan and schedules the next step meanwhile."""
        self._run_plan(self.engines[i], pending=True)
        self.last = None

    @rule(i=base.side, on=st.booleans())
    def overlap(self, i, on):
        """The engine schedules each step while the last one's copies run, or stops."""
        self.engines[i].overlap = on

    @precondition(lambda self: any(e.flight is not None for e in self.engines))
    @rule(i=base.side)
    def copies_done(self, i):
        e = self.engines[i]
        if e.flight is not None:
            self._done(e)

    @rule(i=base.side)
    def poll(self, i):
        done = list(self.engines[i].m._store.done)
        super().poll(i)
        for f in done:
            event(f"a fetch landed {'on the device' if f.on_device else 'in host slots, or nothing'}")

    @rule(i=base.side, weights=st.booleans())
    def reset(self, i, weights):
        """As the base machine's, refused too while a plan's copies run."""
        e = self.engines[i]
        self.last = None
        expect = not e.tokens and not e.m._waits.in_flight and e.flight is None
        assert e.m.reset_prefix_cache(keep_store=not weights) == expect
        e.weights += expect and weights

    @precondition(lambda self: bool(self.seen) and not self.executor.refusing)
    @rule(data=st.data())
    def probe_store(self, data):
        overlaps = [e.overlap for e in self.engines]
        for e in self.engines:  # (it resets: the engine waits for its copies first)
            if e.flight is not None:
                self._done(e)
            e.overlap = False
        try:
            super().probe_store(data)
        finally:
            for e, on in zip(self.engines, overlaps, strict=True):
                e.overlap = on

    # ---- fork, preemption, rewind ------------------------------------------------------

    @precondition(lambda self: any(e.tokens for e in self.engines))
    @rule(i=base.side, data=st.data())
    def fork(self, i, data):
        """Parallel sampling: a child of a request whose prefill ran (its partial
        block copied by the plan, which runs before the next forward pass)."""
        e = self.engines[i]
        rids = [r for r in sorted(e.tokens) if e.scheduled[r] == len(e.tokens[r]) and r not in e.cut]
        self.last = None
        if not rids:
            return
        rid = data.draw(st.sampled_from(rids))
        self.next_id += 1
        child = f"r{self.next_id}"
        if e.m.fork(rid, child) is None:
            return
        e.tokens[child], e.extra[child] = list(e.tokens[rid]), e.extra[rid]
        e.scheduled[child] = e.scheduled[rid]
        if rid in e.floor:
            e.floor[child] = e.floor[rid]
        event(f"fork: {'cut' if rid in e.floor else 'sound'}")
        self._run_plan(e)  # (the copy of the partial block)

    @precondition(lambda self: any(e.tokens for e in self.engines))
    @rule(i=base.side, data=st.data(), again=st.booleans())
    def preempt_running(self, i, data, again):
        """vLLM preempts a running request (all it scheduled was computed, or only up
        to a failed load's block) and may admit it again at once, resumed."""
        e = self.engines[i]
        self.last = None
        if not e.tokens:
            return
        rid = data.draw(st.sampled_from(sorted(e.tokens)))
        tokens = e.m.preempt(rid, num_computed_tokens=e.scheduled[rid] if rid in e.cut else None)
        assert list(tokens) == e.tokens[rid]
        extra = e.extra[rid]
        del e.tokens[rid], e.scheduled[rid], e.extra[rid]
        e.cut.pop(rid, None)
        e.floor.pop(rid, None)
        event(f"preempt_running: {'again' if again else 'left'}")
        if again:
            self._admit(i, rid, list(tokens), extra, None)

    @precondition(lambda self: any(e.tokens for e in self.engines))
    @rule(i=base.side, data=st.data())
    def rewind(self, i, data):
        """The engine takes a request back (its KV from there invalid) and recomputes."""
        e = self.engines[i]
        self.last = None
        rids = [r for r in sorted(e.tokens) if r not in e.cut]
        if not rids:
            return
        rid = data.draw(st.sampled_from(rids))
        n = data.draw(st.integers(0, e.scheduled[rid]))
        try:
            e.m.rewind(rid, n)
        except RequestError:  # a block of it that another live request holds too, or a
            # plan's pending copy (never a store fetch's hold: it gives the block up)
            tail = set(e.m.get_block_ids(rid)[n // BS:e.scheduled[rid] // BS])
            others = {x for r in e.tokens if r != rid for x in e.m.get_block_ids(r)}
            assert tail & (others | {b.block_id for b in e.m._copies.pins}), (rid, n)
            return
        event(f"rewind: {'cut' if rid in e.floor else 'sound'}")
        blocks = e.m.get_block_ids(rid)
        for pos in range(n, e.scheduled[rid]):
            e.kv[blocks[pos // BS]][pos % BS] = "rewound"
        stop, e.scheduled[rid] = e.scheduled[rid], n
        if n < stop and data.draw(st.booleans()):  # recomputed in the next step
            assert e.m.extend(rid, stop - n) is not None  # (its blocks are held)
            e.scheduled[rid] = stop
            self._write(e, rid, n, stop)
            if rid in e.floor and n <= e.floor[rid]:  # (recomputed from at or below its
                # floor: cached anew; a rewind above it leaves the blocks below as they were)
                e.floor[rid] = max(e.floor[rid], stop // BS * BS)

    # ---- a store fetch's device holds, found invalid -------------------------------------

    def _fetch_hits(self, e):
        """(request, block position, lowest position, fetch) for each block a store fetch
        holds (its device hits; its run once landed) that a live request holds too,
        scheduled past it, when no other live request holds that block or a later one
        of the request; from the lowest position on, no other live request holds any."""
        out = []
        tables = {r: e.m.get_block_ids(r) for r in e.tokens}
        for f in sorted(e.m._waits.held.holders, key=lambda f: str(f.request_id)):
            chain = f.held + (f.devices[:f.on_device] if f.ended and f.devices else [])
            for b in chain:
                for rid in sorted(e.tokens):
                    table = tables[rid]
                    if rid in e.cut or b.block_id not in table[:e.scheduled[rid] // BS]:
                        continue
                    j = lo = table.index(b.block_id)
                    others = {x for r, t in tables.items() if r != rid for x in t}
                    if others & set(table[j:e.scheduled[rid] // BS]):
                        continue
                    while lo and table[lo - 1] not in others:
                        lo -= 1
                    out.append((rid, j, lo, f))
        return out

    @rule(i=base.side, data=st.data(), pre=st.integers(0, len(base.PREFIXES) - 1),
          k=st.integers(1, 2), extra=base.salts,
          when=st.sampled_from(["in flight", "landed", "landed, hit"]),
          failed=st.booleans(), every=st.booleans(), again=st.booleans(),
          clear=st.booleans(), twice=st.booleans())
    def fetch_over_live(self, i, data, pre, k, extra, when, failed, every, again, clear, twice):
        """The other engine computes a prompt (its blocks written to the store); here a
        request ``r`` computes its first ``k`` blocks, and a new one ``q`` asks for the
        whole prompt: its fetch continues ``r``'s blocks into the store, holding them as
        its device hits. ``when``: the fetch is still in flight, or it landed on the
        device (the engine admits ``q`` a step later), and maybe another new request hit
        the landed run. Then one of the held blocks is found invalid
        (``rewind_a_fetch_hit``; ``twice``: then another, maybe of the same fetch).
        ``clear``: the engine lets its running requests go first (the pools are small).
        Each step is one of the machine's own (checked)."""
        e, other = self.engines[i], 1 - i
        if clear:
            for rid in sorted(e.tokens):
                e.m.free(rid)
                for held in (e.tokens, e.scheduled, e.extra, e.cut, e.floor):
                    held.pop(rid, None)
        prompt = base.PREFIXES[pre] + [0]
        self.add(other, prompt, extra, None, at_once=True)
        for _ in range(2):  # (the step that computed it, the one that writes it)
            self._run_plan(self.engines[other])
        self.add(i, prompt[:k * BS] + [5], extra, None, at_once=True)
        self.next_id += 1
        q = f"r{self.next_id}"
        self._admit(i, q, prompt, extra, None)
        f = e.m._waits.waiting.get(q)
        if f is None or not f.held:
            event("fetch_over_live: no fetch holding device hits")
            return
        if when == "in flight":
            for _ in range(1 + twice):
                self.rewind_a_fetch_hit(i, data, failed, every, again)
            return
        while self.executor.jobs:  # the fetches end; the engine lands them, and admits
            self.executor.run()  # the requests listed a step later
        done = list(e.m._store.done)
        listed = e.m.poll_store()
        self.delivered += [(i, f) for f in done]
        if when == "landed, hit" and f.on_device:
            self.next_id += 1
            self._admit(i, f"r{self.next_id}", prompt, extra, None)
        for _ in range(1 + twice):
            self.rewind_a_fetch_hit(i, data, failed, every, again)
        for rid in listed:  # (as ``poll``)
            if rid in e.waiting:
                self._admit(i, rid, *e.waiting[rid])
                assert rid not in e.waiting, "a request listed by poll_store waits again"

    @precondition(lambda self: any(e.m._waits.held.holders for e in self.engines))
    @rule(i=base.side, data=st.data(), failed=st.booleans(), every=st.booleans(),
          again=st.booleans())
    def rewind_a_fetch_hit(self, i, data, failed, every, again):
        """A block that a store fetch holds (in flight: a device hit; landed: a hit or its
        run) and a live request computed or hit turns out invalid (``failed``: its load
        failed, the engine names it, or with ``every`` it and the request's blocks after
        it) or the engine takes the request back to recompute from it or earlier: the
        rewind is never refused for the fetch's hold, the fetch holds none of the
        rewound blocks after it, and the KV it serves its request later is the base
        machine's check (``again``: the request recomputes at once)."""
        e = self.engines[i]
        self.last = None
        hits = self._fetch_hits(e)
        if not hits:
            event("rewind_a_fetch_hit: no block a live request holds too")
            return
        rid, j, lo, f = data.draw(st.sampled_from(hits))
        table = e.m.get_block_ids(rid)
        stop = e.scheduled[rid]
        if failed:
            e.m.uncache_blocks(table[j:stop // BS] if every else [table[j]])
            for pos in range(j * BS, stop):
                e.kv[table[pos // BS]][pos % BS] = "invalid"
        n = data.draw(st.integers(lo * BS, j * BS))
        state = "landed" if f.ended else "in flight"
        e.m.rewind(rid, n)  # (no other live request holds these blocks: never refused)
        rewound = set(table[n // BS:stop // BS])
        for g in e.m._waits.held.holders:
            chain = g.held + (g.devices[:g.on_device] if g.ended and g.devices else [])
            assert not rewound & {b.block_id for b in chain}, (rid, n, g.request_id)
        kept = f in e.m._waits.held.holders and (f.held or f.on_device)
        left = "a prefix kept" if kept else "nothing left"
        again_ = "gave up before, " if id(f) in self.gave_up else ""
        self.gave_up.add(id(f))  # (for the event's label only)
        event(f"rewind_a_fetch_hit: {again_}{state}, {'failed' if failed else 'taken back'}, {left}")
        for pos in range(n, stop):
            if e.kv[table[pos // BS]][pos % BS] != "invalid":
                e.kv[table[pos // BS]][pos % BS] = "rewound"
        e.scheduled[rid] = n
        if n < stop and again:
            assert e.m.extend(rid, stop - n) is not None  # (its blocks are held)
            e.scheduled[rid] = stop
            self._write(e, rid, n, stop)
            if rid in e.floor and n <= e.floor[rid]:
                e.floor[rid] = max(e.floor[rid], stop // BS * BS)

    # ---- the events against lookup -------------------------------------------------------

    @invariant()
    def events_predict_lookup(self):
        for i, e in enumerate(getattr(self, "engines", ())):
            e.mirror.drain()
            prompts = [(p, x) for j, p, x in self.seen if j == i]
            prompts += [(t, e.extra[r]) for r, t in e.tokens.items()]
            for prompt, extra in prompts:
                got = e.m.lookup(prompt + [0], extra=extra)
                assert e.mirror.predict(prompt + [0], extra) == got, (prompt, extra, got)


TestTrustMachine = TrustMachine.TestCase
TestTrustMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
