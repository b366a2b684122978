"""Two managers, each with its own simulated engine (device and host KV), share one real
Redis store. Hypothesis drives admissions, prefill chunks, decode steps, frees, aborts
before a step ran, preemptions of waiting requests, resets, and corruption of stored
values; and the store's fetches, which run when the machine says: late (after other
steps), never (the clock passes their deadline), twice (delivered again), or after their
request left; the executor may be shut down (it refuses starts and parts) and a stored
value may become a list (WRONGTYPE). Once no job is queued, every fetch handed over has
ended (none stays in flight with its slots reserved). After every step every live
request's blocks must hold exactly that request's KV, so a store hit that served wrong
KV (another prefix, another salt, a block never computed, a corrupted value, a fetch
that lost a race) is caught at the step it happens, and ``check_invariants`` accounts
for every host slot a fetch reserved. A block's KV bytes are a 16-byte digest of what it
holds. Engine 0 takes fetched payloads as ``StoreFetched`` ops; engine 1 attached its
host memory, into which fetches read directly."""

import hashlib
import time
import uuid

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixkv import (
    BlockCopy,
    BlockLoads,
    BlockOffloads,
    ExtraKeys,
    KVCacheManager,
    Prompt,
    StoreFetched,
    StorePut,
    StoreWait,
)
from prefixkv.core.block import blocks_for
from prefixkv.errors import PromptTooLongError
from prefixkv.store import RedisStore, SharedStore, StoreLayout, encode_value
from prefixkv.tiers import HostSlot
from waiting import LIVE

from .conftest import always

BS = 4
ORDER = [BlockOffloads, StorePut, StoreFetched, BlockLoads, BlockCopy]
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9],
            [9, 9, 9, 9, 5, 6, 7, 8]]
prompts = st.builds(
    lambda pre, cut, tail: PREFIXES[pre][:cut] + tail,
    st.integers(0, len(PREFIXES) - 1), st.integers(0, 12), st.lists(st.integers(0, 5), max_size=6),
).filter(bool)
salts = st.sampled_from([None, ExtraKeys(cache_salt="a"), ExtraKeys(lora="a")])
side = st.integers(0, 1)

URL = []  # the session's server (conftest), set for the machine by the fixture below


@pytest.fixture(autouse=True)
def _server(redis_url):
    URL[:] = [redis_url]


class Manual:
    """An executor that runs what it is given when the machine says; ``refusing``: it
    was shut down (``submit`` raises, as ``ThreadPoolExecutor``'s does then)."""

    def __init__(self):
        self.jobs = []
        self.refusing = False

    def submit(self, fn, *args):
        if self.refusing:
            raise RuntimeError("cannot schedule new futures after shutdown")
        self.jobs.append((fn, args))

    def run(self, index=0):
        """Run job ``index``; what it raises is dropped, as an executor's thread does."""
        fn, args = self.jobs.pop(index)
        try:
            fn(*args)
        except Exception:  # noqa: S110 (a fetch that never ends is what the machine checks)
            pass


class Engine:
    """One process: a manager and the KV it would hold (device blocks, host slots)."""

    def __init__(self, shared, num_blocks, host_blocks, attach):
        self.m = KVCacheManager(num_blocks, BS, hash_mode="sha256", host_blocks=host_blocks,
                                store=shared)
        self.kv = [[None] * BS for _ in range(num_blocks)]
        self.host = [None] * host_blocks
        self.memory = bytearray(16 * host_blocks) if attach else None
        if attach:
            self.m.attach_host_memory([[memoryview(self.memory)[16 * i:16 * (i + 1)]]
                                       for i in range(host_blocks)])
        self.tokens, self.scheduled, self.extra = {}, {}, {}
        self.waiting = {}  # request id -> (prompt, extra, chunk) of a StoreWait
        self.weights = 0  # resets that changed the weights: the KV computed now is of these


class SharedStoreMachine(RuleBasedStateMachine):

    @initialize()
    def setup(self):
        self.backend = RedisStore(URL[0], timeout=LIVE)
        self.executor = Manual()
        self.shared = SharedStore(self.backend, StoreLayout(uuid.uuid4().hex, "sim", 16),
                                  cost=always(), timeout=30.0, executor=self.executor)
        self.offset = 0.0
        self.shared.clock = lambda: time.monotonic() + self.offset
        self.engines = [Engine(self.shared, 6, 4, False), Engine(self.shared, 5, 3, True)]
        self.meaning: dict[bytes, tuple] = {}          # KV bytes -> what they stand for
        self.keys: list[bytes] = []
        self.seen: list[tuple] = []                    # (engine, prompt, extra) admitted
        self.delivered = []                            # (engine, fetch) that ended
        self.expiries = 0
        self.faults = 0                                # refusals and values of another type
        self.next_id = 0
        self.last = None

    def _bytes(self, kv):
        digest = hashlib.blake2b(repr(kv).encode(), digest_size=16).digest()
        self.meaning[digest] = tuple(kv)
        return digest

    def _host_kv(self, e, slot):
        if e.memory is None:
            return list(e.host[slot])
        return list(self.meaning[bytes(e.memory[16 * slot:16 * (slot + 1)])])

    def _set_host(self, e, slot, kv):
        e.host[slot] = list(kv)
        if e.memory is not None:
            e.memory[16 * slot:16 * (slot + 1)] = self._bytes(kv)

    def _run_plan(self, e):
        ops = e.m.take_kv_ops()
        kinds = [type(op) for op in ops]
        assert kinds == sorted(kinds, key=ORDER.index), kinds
        assert kinds.count(BlockOffloads) <= 1, kinds  # a step's offloads are one op
        assert kinds.count(BlockLoads) <= 1, kinds  # a step's loads are one op
        assert e.memory is None or StoreFetched not in kinds, kinds  # read in place
        for op in ops:
            if isinstance(op, BlockOffloads):
                assert len(op.src) == len(op.dst) > 0, op
                for src, dst in zip(op.src, op.dst, strict=True):
                    self._set_host(e, dst, e.kv[src])
            elif isinstance(op, StorePut):
                self.backend.put([(op.key, encode_value(op.head, self._bytes(e.kv[op.src])))])
                self.keys.append(op.key)
            elif isinstance(op, StoreFetched):
                e.host[op.dst] = list(self.meaning[bytes(op.payload)])
            elif isinstance(op, BlockLoads):
                assert len(op.src) == len(op.dst) > 0, op
                assert len(set(op.dst)) == len(op.dst), f"a block loaded twice: {op}"
                for src, dst in zip(op.src, op.dst, strict=True):
                    e.kv[dst] = self._host_kv(e, src)
            else:
                e.kv[op.dst] = list(e.kv[op.src])

    def _kv_of(self, e, rid, pos):
        """What the KV at ``pos`` of ``rid`` stands for: its prefix, salt and the
        weights that computed it (a store hit of other weights' KV is wrong KV)."""
        return e.extra[rid], tuple(e.tokens[rid][:pos + 1]), e.weights

    def _write(self, e, rid, start, stop):
        self._run_plan(e)
        blocks = e.m.get_block_ids(rid)
        for pos in range(start, stop):
            e.kv[blocks[pos // BS]][pos % BS] = self._kv_of(e, rid, pos)

    @rule(i=side, prompt=prompts, extra=salts, chunk=st.none() | st.integers(1, 6),
          at_once=st.booleans(), prepare=st.booleans())
    def add(self, i, prompt, extra, chunk, at_once=False, prepare=False):
        """A new request; ``at_once``: its fetch, if it starts one, ends before the next
        call (the engine polls and admits it again at once); ``prepare``: admitted
        through a Prompt (``prepare``), and re-admitted after a StoreWait with the same
        Prompt object (no comparison) unless ``readmit_early`` draws another form."""
        self.next_id += 1
        rid = f"r{self.next_id}"
        self._admit(i, rid, self.engines[i].m.prepare(prompt, extra=extra) if prepare else prompt,
                    extra, chunk)
        if at_once and rid in self.engines[i].waiting:
            self.settle(i)

    def _admit(self, i, rid, prompt, extra, chunk):
        """Admit ``prompt`` (token ids, or a Prompt of them prepared with ``extra``)."""
        e = self.engines[i]
        given, kw = (prompt, None) if isinstance(prompt, Prompt) else (prompt, extra)
        # a re-admission may skip the walk (``StoreWaits.reuse``): it must find what the
        # walk finds now (a lookup, which changes nothing), the same slots loaded
        walk = e.m._find(None, given, kw, True, None)[1] if rid in e.waiting else None
        loads = len(e.m._host.load_src)
        if isinstance(prompt, Prompt):
            prompt = list(prompt.token_ids)
        try:
            adm = e.m.add_request(rid, given, extra=kw, num_new_tokens=chunk)
        except PromptTooLongError:
            # Only a prompt whose blocks outnumber the pool is refused, and nothing changes.
            assert blocks_for(len(prompt), BS) > e.m.num_blocks, (len(prompt), e.m.num_blocks)
            e.waiting.pop(rid, None)
            self.last = None
            return
        self.last = None
        if isinstance(adm, StoreWait):
            assert adm.request_id == rid and adm.num_blocks > 0
            e.waiting[rid] = (given, extra, chunk)
            return
        e.waiting.pop(rid, None)
        if adm is None:
            return
        if walk is not None:
            assert adm.num_cached_tokens == len(walk) * BS, (adm, walk)
            assert list(e.m._host.load_src[loads:]) == [h.block_id for h in walk
                                                        if type(h) is HostSlot]
        e.tokens[rid], e.extra[rid] = list(prompt), extra
        self.seen.append((i, list(prompt), extra))
        e.scheduled[rid] = adm.num_cached_tokens + adm.num_new_tokens
        self._write(e, rid, adm.num_cached_tokens, e.scheduled[rid])
        self.last = (i, rid, adm.num_cached_tokens, e.scheduled[rid])

    @precondition(lambda self: bool(self.executor.jobs))
    @rule(data=st.data())
    def fetch_runs(self, data):
        """A fetch (or a part of one) runs now, however late."""
        self.executor.run(data.draw(st.integers(0, len(self.executor.jobs) - 1)))

    @rule(i=side)
    def settle(self, i):
        """Every fetch under way runs to its end, then engine ``i`` polls (the common
        case: fetches end within a step or two)."""
        while self.executor.jobs:
            self.executor.run()
        self.poll(i)

    @rule(i=side)
    def poll(self, i):
        """The engine's step start: land what ended, re-admit the requests listed."""
        e = self.engines[i]
        done = list(e.m._store.done)
        ended = e.m.poll_store()
        self.delivered += [(i, f) for f in done]
        assert len(set(ended)) == len(ended), ended
        for rid in ended:
            if rid in e.waiting:
                prompt, extra, chunk = e.waiting[rid]
                self._admit(i, rid, prompt, extra, chunk)
                assert rid not in e.waiting, "a request listed by poll_store waits again"

    @precondition(lambda self: any(e.waiting for e in self.engines))
    @rule(i=side, data=st.data())
    def readmit_early(self, i, data):
        """The engine asks again before poll_store listed the request."""
        e = self.engines[i]
        if e.waiting:
            rid = data.draw(st.sampled_from(sorted(e.waiting)))
            prompt, extra, chunk = e.waiting[rid]
            if isinstance(prompt, Prompt):  # the same Prompt, an equal one, or token ids
                prompt = data.draw(st.sampled_from([prompt, e.m.prepare(prompt.token_ids, extra=extra),
                                                    list(prompt.token_ids)]))
            self._admit(i, rid, prompt, extra, chunk)

    @precondition(lambda self: any(e.waiting for e in self.engines))
    @rule(i=side, data=st.data())
    def leave_while_waiting(self, i, data):
        e = self.engines[i]
        if e.waiting:
            rid = data.draw(st.sampled_from(sorted(e.waiting)))
            e.m.free(rid)
            del e.waiting[rid]

    @precondition(lambda self: any(e.waiting for e in self.engines))
    @rule(i=side, data=st.data())
    def preempt_while_waiting(self, i, data):
        """The engine preempts a request that waits on the store: its prompt comes back,
        it holds nothing and waits no more (its fetch still lands); maybe re-admitted at
        once under the same id (a wait of its own, or what landed)."""
        e = self.engines[i]
        if e.waiting:
            rid = data.draw(st.sampled_from(sorted(e.waiting)))
            prompt, extra, chunk = e.waiting.pop(rid)
            free = e.m.num_free_blocks
            tokens = e.m.preempt(rid, num_computed_tokens=data.draw(st.sampled_from([None, 0])))
            ids = list(prompt.token_ids) if isinstance(prompt, Prompt) else list(prompt)
            assert list(tokens) == ids and e.m.num_free_blocks == free
            if data.draw(st.booleans()):
                self._admit(i, rid, list(tokens), extra, chunk)

    @precondition(lambda self: bool(self.delivered))
    @rule(data=st.data())
    def delivered_twice(self, data):
        i, f = data.draw(st.sampled_from(self.delivered))
        self.engines[i].m._store.done.append(f)

    @rule()
    def deadline_passes(self):
        """The clock passes every fetch's deadline: the next poll releases the waiting
        requests (they compute), whatever the fetches do later."""
        self.offset += 60.0
        self.expiries += 1

    @precondition(lambda self: bool(self.seen))
    @rule(data=st.data(), tail=st.lists(st.integers(0, 5), max_size=3))
    def elsewhere(self, data, tail):
        """The other engine admits a prompt one engine saw (and maybe computed)."""
        i, prompt, extra = data.draw(st.sampled_from(self.seen))
        self.add(1 - i, prompt + tail, extra, None, data.draw(st.booleans()))

    @rule(i=side, data=st.data())
    def extend(self, i, data):
        e = self.engines[i]
        todo = [r for r in e.tokens if e.scheduled[r] < len(e.tokens[r])]
        self.last = None
        if not todo:
            return
        rid = data.draw(st.sampled_from(todo))
        n = data.draw(st.integers(1, len(e.tokens[rid]) - e.scheduled[rid]))
        if e.m.extend(rid, n) is None:
            return
        start = e.scheduled[rid]
        e.scheduled[rid] += n
        self._write(e, rid, start, e.scheduled[rid])
        self.last = (i, rid, start, e.scheduled[rid])

    @rule(i=side, data=st.data())
    def step(self, i, data):
        e = self.engines[i]
        rids = [r for r in e.tokens if e.scheduled[r] == len(e.tokens[r])]
        toks = [data.draw(st.integers(0, 5)) for _ in rids]
        got = e.m.append_step(rids, toks)
        self._run_plan(e)
        self.last = None
        for rid, tok in zip(rids, toks, strict=True):
            if rid in got.short:
                continue
            e.tokens[rid].append(tok)
            pos = e.scheduled[rid]
            e.scheduled[rid] += 1
            e.kv[e.m.get_block_ids(rid)[pos // BS]][pos % BS] = self._kv_of(e, rid, pos)

    @rule(i=side, data=st.data())
    def free(self, i, data):
        e = self.engines[i]
        self.last = None
        if e.tokens:
            rid = data.draw(st.sampled_from(sorted(e.tokens)))
            e.m.free(rid)
            del e.tokens[rid], e.scheduled[rid], e.extra[rid]

    @precondition(lambda self: self.last is not None)
    @rule()
    def abort_before_step_ran(self):
        """What the last call scheduled was never computed: it must never be written to
        the store, nor served from it."""
        i, rid, start, stop = self.last
        e = self.engines[i]
        blocks = e.m.get_block_ids(rid)
        for pos in range(start, stop):
            e.kv[blocks[pos // BS]][pos % BS] = "never computed"
        e.m.free(rid, num_computed_tokens=start)
        del e.tokens[rid], e.scheduled[rid], e.extra[rid]
        self.last = None

    @rule(i=side, weights=st.booleans())
    def reset(self, i, weights):
        """``reset_prefix_cache``: done only when engine ``i`` holds no block and no
        fetch of its is under way (requests waiting on landed fetches compute).
        ``weights``: the engine's weights change with it (a store hit of KV computed
        before is then wrong KV: the invariant catches it); else ``keep_store``: only
        its local caches go. Engines that changed weights as often hold the same ones."""
        e = self.engines[i]
        self.last = None
        done = e.m.reset_prefix_cache(keep_store=not weights)
        assert done == (not e.tokens and not e.m._waits.in_flight)
        e.weights += done and weights

    @precondition(lambda self: bool(self.keys))
    @rule(data=st.data())
    def corrupt(self, data):
        """Flip a byte of a stored value's payload (its checksum no longer matches)."""
        key = data.draw(st.sampled_from(self.keys))
        value = self.backend.client.get(key) if self.backend.client.type(key) == b"string" else None
        if value is not None:
            self.backend.put([(key, value[:-1] + bytes([value[-1] ^ 1]))])

    @rule(refuse=st.booleans())
    def executor_shut_down(self, refuse):
        """The executor refuses what is handed over from now on, or takes it again: a
        start it refuses computes (an error), a fetch whose later parts it refuses reads
        them on its own call (it must still land, once)."""
        self.executor.refusing = refuse
        self.faults += refuse

    @precondition(lambda self: bool(self.keys))
    @rule(data=st.data())
    def wrong_type(self, data):
        """A stored value becomes a list (GET answers WRONGTYPE): that key fails, the
        blocks from it on are computed, and their writes make it a value again."""
        key = data.draw(st.sampled_from(self.keys))
        self.backend.client.delete(key)
        self.backend.client.rpush(key, b"not a value")
        self.faults += 1

    @invariant()
    def blocks_hold_each_requests_kv(self):
        for e in self.engines:
            e.m.check_invariants()
            for rid in e.tokens:
                blocks = e.m.get_block_ids(rid)
                for pos in range(e.scheduled[rid]):
                    assert e.kv[blocks[pos // BS]][pos % BS] == self._kv_of(e, rid, pos), (rid, pos)
            if not self.expiries and not self.faults:  # (else a fetch may fail)
                assert e.m.stats.store_errors == 0
            if not self.executor.jobs:  # every fetch handed over has ended
                ended = {id(f) for f in e.m._store.done if not f.ended}
                assert e.m._waits.in_flight == len(ended), (e.m._waits.in_flight, len(ended))

    def teardown(self):
        if hasattr(self, "backend"):
            self.backend.close()


TestSharedStoreMachine = SharedStoreMachine.TestCase
TestSharedStoreMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class FirstJob:
    def draw(self, strategy):
        return 0


def test_stores_serve_hits_in_the_machine():
    """The machine is not vacuous: a prompt computed by one engine is served to the
    other from the store."""
    m = SharedStoreMachine()
    m.setup()
    m.add(0, PREFIXES[0] + [1], None, None)             # waits: the store is asked
    while m.executor.jobs:
        m.fetch_runs(FirstJob())
    m.poll(0)                                           # nothing found: admitted, computed
    m._run_plan(m.engines[0])                       # two steps: computed, then written
    m._run_plan(m.engines[0])
    m.add(1, PREFIXES[0] + [2], None, None)
    while m.executor.jobs:
        m.fetch_runs(FirstJob())
    m.poll(1)
    assert m.engines[1].m.stats.store_hits == 12           # three blocks, three host slots
    m.blocks_hold_each_requests_kv()
    m.teardown()



def _computed_and_written(m, i, prompt):
    """Engine ``i`` admits ``prompt`` (asking the store), computes it, writes it; the
    machine's invariant holds (the request's blocks hold its KV, of the engine's
    weights); then it is freed."""
    m.add(i, prompt, None, None)
    while m.executor.jobs:
        m.fetch_runs(FirstJob())
    m.poll(i)
    e = m.engines[i]
    m._run_plan(e)
    m._run_plan(e)
    m.blocks_hold_each_requests_kv()
    for rid in sorted(e.tokens):
        e.m.free(rid)
    e.tokens.clear(), e.scheduled.clear(), e.extra.clear()


def test_the_machine_serves_no_kv_of_other_weights():
    """The reset rule with the weights changed: the engine that computed a prefix
    finds none of it after its reset (on main the store served it: the invariant failed
    on KV of the old weights), the other engine still finds it, and once that one has
    reset as often, both share the blocks computed after."""
    m = SharedStoreMachine()
    m.setup()
    _computed_and_written(m, 0, PREFIXES[0] + [1])
    m.reset(0, True)
    _computed_and_written(m, 0, PREFIXES[0] + [2])
    assert m.engines[0].m.stats.store_hits == 0
    _computed_and_written(m, 1, PREFIXES[0] + [3])
    assert m.engines[1].m.stats.store_hits == 12          # the old weights', to the old
    m.reset(1, True)
    _computed_and_written(m, 1, PREFIXES[0] + [4])
    assert m.engines[1].m.stats.store_hits == 24          # the new weights', to the new
    m.teardown()
