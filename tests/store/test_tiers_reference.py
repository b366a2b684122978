"""The shared-store machine (``test_store_machine``: two managers with host tiers, one
real Redis, fetches that land late, never, twice or after their request left, was
preempted or reset) against a plain reference of what each tier may serve, with
``uncache_blocks`` (vLLM's ``evict_blocks`` after a failed load) added:

- the store: the reference knows each value written (the content its KV stands for,
  checked valid at the write: never a block with KV that was never computed or is
  invalid); a fault (a flipped byte, a list) may alter it since, which it tells by
  comparing the server's bytes with those written. After a reset of an
  engine (device and host empty), an admission is served from the store exactly the run
  of leading blocks the reference holds, up to the host slots a fetch can reserve.
- the device: a live request's full blocks are findable (``lookup``) up to its first
  block made unfindable by ``uncache_blocks``; after that the engine recomputes from
  there (the blocks keep junk KV until it does, which no hit may serve).
- every hit, from any tier, is the KV a no-cache run computes (the base machine's check
  after every step), and ``check_invariants`` holds after every step."""

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from prefixkv import StorePut
from prefixkv.store import encode_value

from . import test_store_machine as base

BS = base.BS


@pytest.fixture(autouse=True)
def _server(redis_url):
    base.URL[:] = [redis_url]


class TiersReferenceMachine(base.SharedStoreMachine):

    @initialize()
    def setup(self):
        super().setup()
        self.shared.retry_after = 0.0  # (a failed fetch must not keep the probe off the store)
        self.store_ref: dict[tuple, tuple[bytes, bytes]] = {}  # content -> (key, value) written
        for e in self.engines:
            e.cut = {}  # request id -> tokens it had computed before its blocks were uncached
            e.floor = {}  # request id -> tokens findable at least (the plain manager does not
            #               cache again what it computes again after ``uncache_blocks``)

    # ---- the engine, checked against the reference ------------------------------------

    def _run_plan(self, e):
        ops = e.m.take_kv_ops()
        for op in ops:
            if isinstance(op, StorePut):
                content = self._valid_block(e.kv[op.src])
                self.store_ref[content] = (op.key, encode_value(op.head, self._bytes(e.kv[op.src])))
        e.m.take_kv_ops = lambda: ops  # (the base machine runs them)
        try:
            super()._run_plan(e)
        finally:
            del e.m.take_kv_ops

    def _valid_block(self, kv):
        """The content a block's KV stands for; AssertionError unless every position holds
        the KV a no-cache run computes for it (a write of invalid KV)."""
        last = kv[BS - 1]
        assert isinstance(last, tuple), ("a store write of KV never computed", kv)
        extra, tokens, weights = last
        for k in range(BS):
            assert kv[k] == (extra, tokens[:len(tokens) - BS + 1 + k], weights), ("an invalid write", kv)
        return last

    # ---- uncache_blocks and the recomputation ------------------------------------------

    @precondition(lambda self: any(e.tokens for e in self.engines))
    @rule(i=base.side, data=st.data())
    def load_failed(self, i, data):
        """A block of a live request turns out to hold invalid KV: the engine (vLLM)
        names it and every later block of each request holding it; each such request
        computes again from its first one. Until it does, those blocks hold junk."""
        e = self.engines[i]
        rids = [r for r in sorted(e.tokens) if e.scheduled[r] >= BS]
        if not rids:
            return
        rid = data.draw(st.sampled_from(rids))
        blocks = e.m.get_block_ids(rid)
        j = data.draw(st.integers(0, e.scheduled[rid] // BS - 1))
        bad = blocks[j]
        named = set()
        for r in sorted(e.tokens):
            table = e.m.get_block_ids(r)
            if bad not in table or e.scheduled[r] <= table.index(bad) * BS:
                continue
            k = table.index(bad)
            named.update(table[k:])
            e.cut.setdefault(r, e.scheduled[r])
            e.floor[r] = min(e.floor.get(r, k * BS), k * BS)
            for pos in range(k * BS, e.scheduled[r]):
                e.kv[table[pos // BS]][pos % BS] = "invalid"
            e.scheduled[r] = k * BS
        every = data.draw(st.booleans())  # (as vLLM: the block and every block after it)
        event(f"load_failed: {'the tails' if every else 'one block'} named")
        e.m.uncache_blocks(sorted(named) if every else [bad])
        self.last = None

    @precondition(lambda self: any(e.cut for e in self.engines))
    @rule(i=base.side, data=st.data())
    def recompute(self, i, data):
        e = self.engines[i]
        if e.cut:
            rid = data.draw(st.sampled_from(sorted(e.cut)))
            start, stop = e.scheduled[rid], e.cut.pop(rid)
            e.scheduled[rid] = stop
            self._write(e, rid, start, stop)
            self.last = None

    # (the base rules that move a request on skip one that must compute again first)
    @rule(i=base.side, data=st.data())
    def extend(self, i, data):
        e = self.engines[i]
        held = {r: e.tokens.pop(r) for r in e.cut}
        try:
            super().extend(i, data)
        finally:
            e.tokens.update(held)

    @rule(i=base.side, data=st.data())
    def step(self, i, data):
        e = self.engines[i]
        held = {r: e.tokens.pop(r) for r in e.cut}
        try:
            super().step(i, data)
        finally:
            e.tokens.update(held)

    @rule(i=base.side, data=st.data())
    def free(self, i, data):
        e = self.engines[i]
        super().free(i, data)
        for held in (e.cut, e.floor):
            for r in list(held):
                if r not in e.tokens:
                    del held[r]

    @rule(i=base.side, weights=st.booleans())
    def reset(self, i, weights):
        super().reset(i, weights)

    # ---- the store's reference ---------------------------------------------------------

    @precondition(lambda self: bool(self.seen) and not self.executor.refusing)
    @rule(data=st.data())
    def probe_store(self, data):
        """An engine lets every request go, resets (device and host empty) and admits a
        prompt seen before: the store serves exactly the run the reference holds."""
        i, prompt, extra = data.draw(st.sampled_from(self.seen))
        e = self.engines[i]
        self._run_plan(e)  # (the step that computed the last blocks ran: their writes)
        for rid in sorted(e.waiting):  # the engine lets everything go
            e.m.free(rid)
        e.waiting.clear()
        for rid in sorted(e.tokens):
            e.m.free(rid)
        e.tokens.clear(), e.scheduled.clear(), e.extra.clear(), e.cut.clear(), e.floor.clear()
        self.last = None
        self.settle(i)
        assert e.m.reset_prefix_cache(keep_store=True)
        run = 0
        while run < (len(prompt) - 1) // BS and self._stored(
                (extra, tuple(prompt[:BS * (run + 1)]), e.weights)):
            run += 1
        run = min(run, len(e.host))
        event(f"probe_store: a run of {run} blocks")
        hits, store_hits = e.m.stats.hits, e.m.stats.store_hits
        self.add(i, prompt, extra, None, True)
        assert not e.waiting
        assert (e.m.stats.hits - hits, e.m.stats.store_hits - store_hits) == (BS * run, BS * run), \
            (prompt, extra, run)

    def _stored(self, content):
        """Whether the store holds the value written for ``content``, as written (no
        fault since: a flipped byte, a list, a value another content's write replaced)."""
        key, value = self.store_ref.get(content, (None, None))
        client = self.backend.client
        return key is not None and client.type(key) == b"string" and client.get(key) == value

    @invariant()
    def live_blocks_are_findable_up_to_a_cut(self):
        for e in self.engines:
            for rid, tokens in e.tokens.items():
                full = min(e.scheduled[rid] // BS * BS, e.floor.get(rid, len(tokens)))
                assert e.m.lookup(tokens[:full] + [0], extra=e.extra[rid]) >= full, (rid, full)


TestTiersReferenceMachine = TiersReferenceMachine.TestCase
TestTiersReferenceMachine.settings = settings(max_examples=120, stateful_step_count=40,
                                              deadline=None)
