"""The manager's real plans (``take_kv_ops()``) run by ``run_kv_ops`` on real caches, with
the forward pass written by ``write_kv_cache``: after every step, every device block and
host slot holds exactly the KV a plain-Python model says it must.

The model is the engine's view, one entry per token slot: the KV of position p of a
request is a function of its extra keys and its tokens 0..p (what a model computes), here
a registry id, written into K as ``id + 1000 * layer + 0.25 * d`` and into V as its
negation (exact in fp32; distinct per layer, so a copy that swaps layers is caught).
Every cache starts as NaN, so a slot read before anything wrote it compares unequal.

Checked after each step's plan and forward pass:
- the tensors equal the model in every slot the model knows (device and host);
- every live request's computed positions hold its own tokens' KV;
- every block ``lookup_block_ids`` finds for a prompt seen so far (cached blocks in use
  or free) holds the KV of that prompt's tokens (the content its hash chain names).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

torch = pytest.importorskip("torch")

from prefixkv import BlockCopy, BlockLoads, BlockOffloads, ExtraKeys, KVCacheManager  # noqa: E402
from prefixkv.kernels import alloc_host_cache, run_kv_ops, write_kv_cache  # noqa: E402

LAYERS, HEADS, DIM = 2, 1, 8
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [9, 9, 9, 9, 5, 6, 7, 8]]
prompts = st.builds(lambda pre, cut, tail: PREFIXES[pre][:cut] + tail, st.integers(0, 2),
                    st.integers(0, 8), st.lists(st.integers(0, 12), max_size=7)).filter(bool)
extras = st.sampled_from([None, ExtraKeys(cache_salt="a"), ExtraKeys(lora="a")])


class KVOpsMachine(RuleBasedStateMachine):
    bs = 4
    num_blocks = 7
    host_blocks = 6
    events = True
    per_layer = False  # True: one [num_blocks, bs, H, D] cache per layer and kind (block_dim 0)
    churn = False  # True: admissions finish the oldest requests to make room (more host traffic)
    live = Bundle("live")

    @initialize()
    def setup(self):
        self.m = KVCacheManager(self.num_blocks, self.bs, seed=3, enable_events=self.events,
                                host_blocks=self.host_blocks)
        shape = (LAYERS, self.num_blocks, self.bs, HEADS, DIM)
        self.k, self.v = (torch.full(shape, float("nan")) for _ in range(2))
        self.hk, self.hv = (alloc_host_cache(c, self.host_blocks, block_dim=1).fill_(float("nan"))
                            for c in (self.k, self.v))
        self.dev: list[list[int | None]] = [[None] * self.bs for _ in range(self.num_blocks)]
        self.host: list[list[int | None]] = [[None] * self.bs for _ in range(self.host_blocks)]
        self.ids: dict[tuple, int] = {}  # (extra, tokens 0..p) -> the KV's id
        self.tokens: dict[str, list[int]] = {}
        self.extra: dict[str, ExtraKeys | None] = {}
        self.computed: dict[str, int] = {}
        self.seen: list[tuple[list[int], ExtraKeys | None]] = []
        self.preempted: list[tuple[list[int], ExtraKeys | None]] = []
        self.next_id = 0

    # ---- the engine's step: the plan, then the forward pass -----------------------------

    def _kv_id(self, rid: str, pos: int) -> int:
        key = (self.extra[rid], tuple(self.tokens[rid][:pos + 1]))
        return self.ids.setdefault(key, len(self.ids) + 1)

    def _run_plan(self):
        ops = self.m.take_kv_ops()
        for op in ops:  # the model: one copy at a time, in the documented order
            assert type(op) in (BlockOffloads, BlockLoads, BlockCopy), op
        for kind in (BlockOffloads, BlockLoads, BlockCopy):
            for op in (o for o in ops if type(o) is kind):
                pairs = [(op.src, op.dst)] if kind is BlockCopy else zip(op.src, op.dst, strict=True)
                for s, d in pairs:
                    if kind is BlockOffloads:
                        self.host[d] = list(self.dev[s])
                    elif kind is BlockLoads:
                        self.dev[d] = list(self.host[s])
                    else:
                        self.dev[d] = list(self.dev[s])
        if self.per_layer:
            devs = [c[layer] for layer in range(LAYERS) for c in (self.k, self.v)]
            hosts = [c[:, layer].contiguous() for layer in range(LAYERS) for c in (self.hk, self.hv)]
            run_kv_ops(ops, devs, hosts)
            for i, (layer, c) in enumerate((layer, c) for layer in range(LAYERS) for c in (self.hk, self.hv)):
                c[:, layer] = hosts[i]
        else:
            run_kv_ops(ops, [self.k, self.v], [self.hk, self.hv], block_dim=1)

    def _step(self, writes):
        """The plan, then the forward pass of ``writes``: ``(rid, start, stop)``."""
        self._run_plan()
        for rid, start, stop in writes:
            if rid not in self.tokens:
                continue
            blocks = self.m.get_block_ids(rid)
            slots = torch.tensor([blocks[p // self.bs] * self.bs + p % self.bs for p in range(start, stop)])
            ids = torch.tensor([float(self._kv_id(rid, p)) for p in range(start, stop)])
            for layer in range(LAYERS):
                key = self._values(ids, layer)
                write_kv_cache(key, -key, self.k[layer], self.v[layer], slots)
            for p in range(start, stop):
                self.dev[blocks[p // self.bs]][p % self.bs] = self._kv_id(rid, p)
            self.computed[rid] = stop

    @staticmethod
    def _values(ids: torch.Tensor, layer: int) -> torch.Tensor:
        """K of these KV ids in ``layer``: ``[n, HEADS, DIM]``."""
        d = torch.arange(DIM, dtype=torch.float32) * 0.25
        return (ids[:, None, None] + 1000.0 * layer + d).expand(-1, HEADS, DIM).contiguous()

    def _new(self, tokens, extra):
        self.next_id += 1
        rid = f"r{self.next_id}"
        self.tokens[rid], self.extra[rid], self.computed[rid] = list(tokens), extra, 0
        return rid

    def _forget(self, rid):
        del self.tokens[rid], self.extra[rid], self.computed[rid]

    def _admit(self, prompt, extra, chunk):
        """Admit and schedule ``chunk`` tokens (all when None); None when it does not fit.
        With ``churn``, the oldest requests finish first while the pool is short of the
        prompt's blocks (evictions offload, later prompts load)."""
        while self.churn and self.tokens and self.m.num_free_blocks < -(-len(prompt) // self.bs):
            oldest = next(iter(self.tokens))
            self.m.free(oldest, num_computed_tokens=self.computed[oldest])
            self._forget(oldest)
        rid = self._new(prompt, extra)
        adm = self.m.add_request(rid, prompt, extra=extra, num_new_tokens=chunk)
        if adm is None:
            self._forget(rid)
            return None
        self.seen.append((list(prompt), extra))
        self.computed[rid] = adm.num_cached_tokens
        return rid, (rid, adm.num_cached_tokens, adm.num_cached_tokens + adm.num_new_tokens)

    def _done(self, rid):
        return rid in self.tokens and self.computed[rid] == len(self.tokens[rid])

    # ---- rules --------------------------------------------------------------------------

    @rule(target=live, prompt=prompts, extra=extras, chunk=st.none() | st.integers(1, 5))
    def add(self, prompt, extra, chunk):
        got = self._admit(prompt, extra, chunk)
        self._step([got[1]] if got else [])
        return got[0] if got else multiple()

    @rule(target=live, pre=st.integers(0, 2), tail=st.integers(0, 12))
    def add_known_prefix(self, pre, tail):
        """A prompt whose two full blocks were likely seen before: cached, offloaded to the
        host (then loaded back) or dropped."""
        return self.add(PREFIXES[pre] + [tail], None, None)

    @rule(prompt=prompts, extra=extras)
    def add_then_abort(self, prompt, extra):
        """Admitted, then aborted before its step ran: its new blocks were never computed
        (no later request may find them), but what its admission evicted is still offloaded
        by the plan."""
        got = self._admit(prompt, extra, None)
        if got is not None:
            rid, (_, cached, _) = got
            self.m.free(rid, num_computed_tokens=cached)
            self._forget(rid)  # its prompt stays in seen: what lookup finds of it must hold its KV
        self._step([])

    @rule(target=live)
    def readmit(self):
        if not self.preempted:
            return multiple()
        got = self._admit(*self.preempted.pop(0), None)
        self._step([got[1]] if got else [])
        return got[0] if got else multiple()

    @rule(rid=live, n=st.integers(1, 5))
    def extend(self, rid, n):
        if rid not in self.tokens or self._done(rid):
            return
        start = self.computed[rid]
        n = min(n, len(self.tokens[rid]) - start)
        self._step([(rid, start, start + n)] if self.m.extend(rid, n) is not None else [])

    @rule(rid=live, n=st.integers(1, 6))
    def reserve(self, rid, n):
        """Blocks for tokens not known yet (lookahead): a later fork copies them too."""
        if self._done(rid):
            self.m.reserve(rid, n)
            self._step([])

    @rule(data=st.data())
    def decode(self, data):
        """One decode step of every request whose prefill is done."""
        rids = [r for r in self.tokens if self._done(r)]
        toks = [data.draw(st.integers(0, 12)) for _ in rids]
        got = self.m.append_step(rids, toks)
        writes = []
        for rid, tok in zip(rids, toks, strict=True):
            if rid not in got.short:
                self.tokens[rid].append(tok)
                writes.append((rid, len(self.tokens[rid]) - 1, len(self.tokens[rid])))
        self._step(writes)

    @rule(target=live, parent=live, depth=st.integers(1, 3), gone=st.sets(st.integers(0, 3)),
          toks=st.lists(st.integers(0, 12), max_size=4), prompt=st.none() | prompts)
    def fork_chain(self, parent, depth, gone, toks, prompt):
        """One step: a chain of forks (each of the one before), a token appended to each
        member, members freed before the step ran, an admission (eviction, offloads,
        host loads); then the plan and the forward pass."""
        if not self._done(parent):
            return multiple()
        chain = [parent]
        for _ in range(depth):
            child = self._new(self.tokens[chain[-1]], self.extra[chain[-1]])
            if self.m.fork(chain[-1], child) is None:
                self._forget(child)
                break
            self.computed[child] = self.computed[chain[-1]]
            chain.append(child)
        writes = []
        for rid, tok in zip(chain, toks, strict=False):
            if self.m.append_tokens(rid, [tok]) is not None:
                self.tokens[rid].append(tok)
                writes.append((rid, len(self.tokens[rid]) - 1, len(self.tokens[rid])))
        for i in sorted(gone):
            if i < len(chain):
                self.m.free(chain[i], num_computed_tokens=self.computed[chain[i]])
                self._forget(chain[i])
        got = self._admit(prompt, None, None) if prompt is not None else None
        self._step(writes + ([got[1]] if got else []))
        new = [r for r in chain[1:] if r in self.tokens] + ([got[0]] if got else [])
        return multiple(*new)

    @rule(rid=consumes(live), preempt=st.booleans())
    def free(self, rid, preempt):
        if rid not in self.tokens:
            return
        computed = self.computed[rid]
        if preempt:
            self.m.preempt(rid, num_computed_tokens=computed)
            self.preempted.append((self.tokens[rid], self.extra[rid]))
        else:
            self.m.free(rid, num_computed_tokens=computed)
        self._forget(rid)

    @rule()
    def reset(self):
        assert self.m.reset_prefix_cache() == (not self.tokens)
        self._step([])

    # ---- what every block must hold -----------------------------------------------------

    def _expected(self, model, layer, count):
        want = torch.full((count, self.bs, HEADS, DIM), float("nan"))
        known = torch.zeros(count, self.bs, dtype=torch.bool)
        for b, row in enumerate(model):
            for o, kv in enumerate(row):
                if kv is not None:
                    want[b, o] = self._values(torch.tensor([float(kv)]), layer)[0]
                    known[b, o] = True
        return want, known

    @invariant()
    def caches_hold_the_model(self):
        host_k, host_v = self.hk.movedim(0, 1), self.hv.movedim(0, 1)  # [LAYERS, slots, ...]
        for model, k, v, count in ((self.dev, self.k, self.v, self.num_blocks),
                                   (self.host, host_k, host_v, self.host_blocks)):
            for layer in range(LAYERS):
                want, known = self._expected(model, layer, count)
                assert torch.equal(k[layer][known], want[known]), ("K", layer, model)
                assert torch.equal(v[layer][known], -want[known]), ("V", layer, model)

    @invariant()
    def requests_read_their_own_kv(self):
        for rid in self.tokens:
            blocks = self.m.get_block_ids(rid)
            for p in range(self.computed[rid]):
                assert self.dev[blocks[p // self.bs]][p % self.bs] == self._kv_id(rid, p), (rid, p)

    @invariant()
    def cached_blocks_hold_their_chains_kv(self):
        for tokens, extra in self.seen + [(t, self.extra[r]) for r, t in self.tokens.items()]:
            for j, b in enumerate(self.m.lookup_block_ids(tokens + [0], extra=extra)):
                for o in range(self.bs):
                    key = (extra, tuple(tokens[:j * self.bs + o + 1]))
                    assert key in self.ids and self.dev[b][o] == self.ids[key], (tokens, j, b, o)

    @invariant()
    def consistent(self):
        self.m.check_invariants()


class PerLayerNoEventsMachine(KVOpsMachine):
    """Block size 3, one cache per layer and kind (block_dim 0), no events (the index's
    fast paths: evictions demote in batches, admissions load in batches), churn."""

    bs = 3
    churn = True
    events = False
    per_layer = True


class BigHostMachine(KVOpsMachine):
    """A host tier twice the pool: long runs offloaded, loaded and offloaded again."""

    host_blocks = 14
    churn = True
    events = False


SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestKVOpsMachine = KVOpsMachine.TestCase
TestKVOpsMachine.settings = SETTINGS
TestPerLayerNoEventsMachine = PerLayerNoEventsMachine.TestCase
TestPerLayerNoEventsMachine.settings = SETTINGS
TestBigHostMachine = BigHostMachine.TestCase
TestBigHostMachine.settings = SETTINGS
