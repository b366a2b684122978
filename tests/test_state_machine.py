"""Hypothesis drives the manager against a plain model and a simulated KV store.

The simulated store plays the engine: into each scheduled slot it writes what the real
K/V there depends on (the request's extra keys and every token up to that position),
applies fork copies, and after every step checks that every live request's blocks hold
exactly that request's tokens, so a hit that served wrong KV, or a block reused while
still held, is caught at the step it happens.
"""

import hashlib

import pytest
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
from prefixkv import (
    AllBlocksCleared,
    BlockCopy,
    BlockLoads,
    BlockOffloads,
    BlockStored,
    ExtraKeys,
    KVCacheManager,
    PromptTooLongError,
    RequestError,
)
from prefixkv.hashing import make_hash_fn

BS = 4
NUM_BLOCKS = 14
# Prefixes that share a first block, and one whose second block repeats another's second
# block after a different first block (only the parent tells them apart).
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [9, 9, 9, 9, 5, 6, 7, 8]]

prompts = prompts_over(PREFIXES, 12, 9)
salts = st.sampled_from([None, ExtraKeys(cache_salt="a"), ExtraKeys(lora="a")])


class ManagerMachine(SharedRules, RuleBasedStateMachine):
    hash_mode: object = "xxhash"
    live = LIVE

    exact_hash = True  # False: a colliding hash, events can only over-predict
    bs = BS  # block size
    host_blocks = 0
    num_blocks = NUM_BLOCKS
    events = True  # False: no events, so the index takes its fast paths (evictions in batches)
    drain_every = 1  # events are taken after every n-th step (deferred events pile up)
    late_plan = False  # True: the plan is taken by a rule of its own (test_state_machine_late_plan)

    @initialize()
    def setup(self):
        self.m = KVCacheManager(self.num_blocks, self.bs, hash_mode=self.hash_mode, seed=1,
                                enable_events=self.events, max_events=25, host_blocks=self.host_blocks)
        self.host_kv = [[None] * self.bs for _ in range(self.host_blocks)]
        self.hash_fn, self.root = make_hash_fn(self.hash_mode, 1)
        self.mirror: dict[bytes, int] = {}   # a router's view: stores - removals per hash
        self.reserved: dict[str, int] = {}
        self.kv = [[None] * self.bs for _ in range(self.num_blocks)]
        self.tokens: dict[str, list[int]] = {}     # model: known tokens per live request
        self.scheduled: dict[str, int] = {}
        self.extra: dict[str, ExtraKeys | None] = {}
        self.preempted: list[tuple[list[int], ExtraKeys | None]] = []
        # every prompt admitted (and the tokens a request held when it went): the
        # prompts ``events_predict_lookup`` asks of, cached or long gone
        self.seen: dict[tuple[tuple[int, ...], ExtraKeys | None], None] = {}
        self.last = None
        self.next_id = 0
        self.steps = 0
        # the contents whose host slots were withdrawn as unreachable since the last check
        self.withdrawn: set[int] = set()
        host = self.m._host
        if host is not None:
            withdraw = host.withdraw_under
            host.withdraw_under = lambda gone: (self.withdrawn.update(gone), withdraw(gone))[1]

    def _run_plan(self):
        """The engine's part of a step, before its forward pass: the manager's plan, in
        order (offloads, loads, copies)."""
        ops = self.m.take_kv_ops()
        kinds = [type(op) for op in ops]
        assert kinds == sorted(kinds, key=[BlockOffloads, BlockLoads, BlockCopy].index), kinds
        assert kinds.count(BlockOffloads) <= 1, kinds  # a step's offloads are one op
        assert kinds.count(BlockLoads) <= 1, kinds  # a step's loads are one op
        for op in ops:
            if isinstance(op, BlockOffloads):
                assert len(op.src) == len(op.dst) > 0, op
                for src, dst in zip(op.src, op.dst, strict=True):
                    self.host_kv[dst] = list(self.kv[src])
            elif isinstance(op, BlockLoads):
                assert len(op.src) == len(op.dst) > 0, op
                self._check_loads(op)
                for src, dst in zip(op.src, op.dst, strict=True):
                    self.kv[dst] = list(self.host_kv[src])
            else:
                self.kv[op.dst] = list(self.kv[op.src])

    def _check_loads(self, op):
        """The plan's loads write only blocks that hold what they bring (deadload-r16):
        each a block live requests hold, full within their scheduled tokens, whose KV
        each of them expects is the slot's (as the plan's offloads left it; so it is a
        hit, no miss's block, decode's block or fork's copy), or a block no live request
        holds whose content is findable (a request may hit it, in this step or later)."""
        assert len(set(op.dst)) == len(op.dst), op
        holders: dict[int, list[tuple[str, int]]] = {}
        for rid in self.tokens:
            for k, b in enumerate(self.m.get_block_ids(rid)):
                holders.setdefault(b, []).append((rid, k))
        for src, dst in zip(op.src, op.dst, strict=True):
            for rid, k in holders.get(dst, ()):
                self._check_load_into(rid, k, src, dst)
            if dst not in holders:
                blk = self.m._pool.blocks[dst]
                assert blk.key is not None and not blk.twin, (src, dst, blk)

    def _check_load_into(self, rid, k, src, dst):
        """Load ``src`` -> ``dst``, block ``k`` of live ``rid``: a hit it expects."""
        bs = self.bs
        assert (k + 1) * bs <= self.scheduled[rid], (rid, k, src, dst)
        expected = [self._kv_of(rid, pos) for pos in range(k * bs, (k + 1) * bs)]
        assert self.host_kv[src] == expected, (rid, k, src, dst, self.host_kv[src])

    def _write(self, rid, start, stop):
        self._run_plan()
        self.last = (rid, start, stop)  # what the step just scheduled
        self._forward(rid, start, stop)

    def _forward(self, rid, start, stop):
        """The forward pass writes positions ``start..stop-1`` of ``rid``."""
        blocks = self.m.get_block_ids(rid)
        for pos in range(start, stop):
            self.kv[blocks[pos // self.bs]][pos % self.bs] = self._kv_of(rid, pos)

    def _kv_of(self, rid, pos):
        return self.extra[rid], tuple(self.tokens[rid][:pos + 1])

    def _snapshot(self):
        return (self.m.free_block_order(), self.m.stats, self.m.num_cached_blocks)

    def _admit(self, prompt, extra, chunk, prepared=None):
        """Admit ``prompt``; through ``prepared`` (a Prompt of it) when given."""
        rid = self._new_id()
        before = self._snapshot()
        if prepared is None:
            predicted = self.m.lookup(prompt, extra=extra)  # match; admission claims in one pass
            adm = self._add(rid, prompt, extra=extra, num_new_tokens=chunk)
        else:
            predicted = self.m.lookup(prepared)
            adm = self._add(rid, prepared, num_new_tokens=chunk)
        if adm is None:
            assert self._snapshot() == before and (self.late_plan or self.m.take_kv_ops() == [])
            return None
        assert adm.num_cached_tokens == predicted, (adm.num_cached_tokens, predicted)
        assert adm.num_cached_tokens % self.bs == 0 and adm.num_cached_tokens < len(prompt)
        assert len(adm.block_ids) == -(-(adm.num_cached_tokens + adm.num_new_tokens) // self.bs)
        self.tokens[rid] = list(prompt)
        self.extra[rid] = extra
        self.scheduled[rid] = adm.num_cached_tokens + adm.num_new_tokens
        self.reserved[rid] = self.scheduled[rid]
        self._write(rid, adm.num_cached_tokens, self.scheduled[rid])
        return rid

    @rule(target=live, prompt=prompts, extra=salts, chunk=st.none() | st.integers(1, 6))
    def add(self, prompt, extra, chunk):
        return self._admit(prompt, extra, chunk) or self._dead()

    @rule(target=live, pre=st.integers(0, len(PREFIXES) - 1), tail=st.integers(0, 12))
    def add_known_prefix(self, pre, tail):
        """A prompt whose two full blocks were likely seen before (cached, or evicted)."""
        return self._admit(PREFIXES[pre] + [tail], None, None) or self._dead()

    @precondition(lambda self: self.preempted)
    @rule(target=live, prepare=st.booleans())
    def readmit(self, prepare):
        prompt, extra = self.preempted.pop(0)
        prepared = self.m.prepare(prompt, extra=extra) if prepare else None
        return self._admit(prompt, extra, None, prepared) or self._dead()

    @rule(target=live, prompt=prompts, extra=salts, chunk=st.none() | st.integers(1, 6),
          times=st.integers(1, 3))
    def add_prepared(self, prompt, extra, chunk, times):
        """One Prompt, prepared once, admitted ``times`` times (n > 1 sampling): each
        request decodes into its own tokens (``blocks_hold_each_requests_tokens``)."""
        prepared = self.m.prepare(prompt, extra=extra)
        rids = [self._admit(prompt, extra, chunk, prepared) for _ in range(times)]
        assert prepared.token_ids == tuple(prompt) and prepared.extra == extra
        return multiple(*[r for r in rids if r is not None])

    def _dead(self):
        return multiple()

    def _add(self, rid, prompt, **kw):
        """``add_request``; None also for a PromptTooLongError (a re-admission grown past
        the pool), which must need more blocks than the pool has."""
        if not isinstance(prompt, list):  # (a Prompt)
            self.seen[tuple(prompt.token_ids), prompt.extra] = None
        else:
            self.seen[tuple(prompt), kw.get("extra")] = None
        try:
            return self.m.add_request(rid, prompt, **kw)
        except PromptTooLongError:
            assert -(-len(prompt) // self.bs) > self.num_blocks
            return None

    def _forget(self, rid):
        self.seen[tuple(self.tokens[rid]), self.extra[rid]] = None
        del self.tokens[rid], self.scheduled[rid], self.extra[rid], self.reserved[rid]

    @rule(rid=live, n=st.integers(1, 6))
    def extend(self, rid, n):
        if rid not in self.tokens or self.scheduled[rid] == len(self.tokens[rid]):
            return
        n = min(n, len(self.tokens[rid]) - self.scheduled[rid])
        before = self._snapshot()
        got = self.m.extend(rid, n)
        if got is None:
            assert self._snapshot() == before
            return
        start = self.scheduled[rid]
        self.scheduled[rid] += n
        self.reserved[rid] = max(self.reserved[rid], self.scheduled[rid])
        self._write(rid, start, start + n)

    @rule(rid=live, toks=st.lists(st.integers(0, 12), min_size=1, max_size=5))
    def append(self, rid, toks):
        if rid not in self.tokens or self.scheduled[rid] != len(self.tokens[rid]):
            return
        before = self._snapshot()
        if self.m.append_tokens(rid, toks) is None:
            assert self._snapshot() == before
            return
        start = self.scheduled[rid]
        self.tokens[rid] += toks
        self.scheduled[rid] += len(toks)
        self.reserved[rid] = max(self.reserved[rid], self.scheduled[rid])
        self._write(rid, start, self.scheduled[rid])

    @rule(target=live, parent=live)
    def fork(self, parent):
        if parent not in self.tokens or self.scheduled[parent] != len(self.tokens[parent]):
            return self._dead()
        child = self._new_id()
        got = self.m.fork(parent, child)
        if got is None:
            return self._dead()
        self.last = None
        self._run_plan()
        self.tokens[child] = list(self.tokens[parent])
        self.extra[child] = self.extra[parent]
        self.scheduled[child] = self.scheduled[parent]
        self.reserved[child] = self.reserved[parent]
        return child

    @rule(target=live, parent=live, depth=st.integers(1, 3), gone=st.sets(st.integers(0, 3)),
          toks=st.lists(st.integers(0, 12), max_size=4), prompt=st.none() | prompts)
    def fork_chain(self, parent, depth, gone, toks, prompt):
        """One step, no plan run until its end: fork ``parent`` into a chain of ``depth``
        children, each forked from the one before (a fork of a fork; the plan owes the
        copies in order); append ``toks[i]`` to member i of the chain (the parent is
        member 0); free the members in ``gone`` (beams pruned before the step ran: freed
        with the tokens computed before it); admit ``prompt`` (it may take a freed block,
        evict and offload, or load a host hit); then run the plan and the forward pass."""
        self._own_step()
        return fork_chain_step(self, parent, depth, gone, toks, prompt,
                               (self.tokens, self.extra, self.scheduled, self.reserved), self._run_plan)

    @rule(data=st.data())
    def step(self, data):
        """One decode step for every live request whose prefill is done, in one call."""
        rids = [r for r in self.tokens if self.scheduled[r] == len(self.tokens[r])]
        toks = [data.draw(st.integers(0, 12)) for _ in rids]
        before = {r: self.m.get_block_ids(r) for r in rids}
        got = self.m.append_step(rids, toks)
        self._run_plan()
        assert {r for r, _ in got.grown} | set(got.short) <= set(rids)
        for rid, tok in zip(rids, toks, strict=True):
            if rid in got.short:
                assert self.m.get_block_ids(rid) == before[rid]
                continue
            assert self.m.get_block_ids(rid)[:len(before[rid])] == before[rid]
            self.tokens[rid].append(tok)
            self.scheduled[rid] += 1
            self.reserved[rid] = max(self.reserved[rid], self.scheduled[rid])
            self.kv[self.m.get_block_ids(rid)[(self.scheduled[rid] - 1) // self.bs]][
                (self.scheduled[rid] - 1) % self.bs] = self._kv_of(rid, self.scheduled[rid] - 1)
        self.last = None

    @rule(rid=live, n=st.integers(0, 6))
    def reserve(self, rid, n):
        if rid not in self.tokens:
            return
        before = self._snapshot()
        got = self.m.reserve(rid, n)
        self._run_plan()
        if got is None:
            assert self._snapshot() == before
            return
        self.reserved[rid] = max(self.reserved[rid], self.scheduled[rid] + n)

    @precondition(lambda self: self.last is not None and self.last[0] in self.tokens)
    @rule()
    def abort_before_step_ran(self):
        """The request just scheduled is dropped before its step ran: what it scheduled
        was never computed, so no later request may hit it."""
        rid, start, stop = self.last
        blocks = self.m.get_block_ids(rid)
        for pos in range(start, stop):
            self.kv[blocks[pos // self.bs]][pos % self.bs] = "never computed"
        self.m.free(rid, num_computed_tokens=start)
        self._forget(rid)
        self.last = None

    @precondition(lambda self: self.last is not None and self.last[0] in self.tokens)
    @rule(tail=st.integers(0, 12))
    def abort_with_a_request_that_hit_it(self, tail):
        """Another request hits the blocks just scheduled before their step ran; then both
        are dropped (the first one's blocks are never computed, so the second one must not
        run either), the first while the second still holds its blocks: those keep their
        content id as spares while the second one's own blocks go too."""
        rid, start, stop = self.last
        full = stop // self.bs * self.bs
        if full <= start or rid not in self.tokens:
            return
        other = self._new_id()
        adm = self._add(other, self.tokens[rid][:full] + [tail], extra=self.extra[rid])
        blocks = self.m.get_block_ids(rid)
        for pos in range(start, stop):
            self.kv[blocks[pos // self.bs]][pos % self.bs] = "never computed"
        self.m.free(rid, num_computed_tokens=start)
        if adm is not None:
            assert adm.num_cached_tokens == full, adm
            self.m.free(other, num_computed_tokens=0)
        self._run_plan()  # what the second admission evicted is still offloaded
        self._forget(rid)
        self.last = None

    def _plan_with_failed_loads(self, ok):
        """Run the step's plan with its loads after the first ``ok`` failed; the device
        blocks they were loading into, their KV marked failed."""
        failed: list[int] = []
        for op in self.m.take_kv_ops():
            if isinstance(op, BlockOffloads):
                for src, dst in zip(op.src, op.dst, strict=True):
                    self.host_kv[dst] = list(self.kv[src])
            elif isinstance(op, BlockLoads):
                failed = []
                for i, (src, dst) in enumerate(zip(op.src, op.dst, strict=True)):
                    self.kv[dst] = list(self.host_kv[src]) if i < ok else ["failed"] * self.bs
                    failed += [dst] if i >= ok else []
            else:
                self.kv[op.dst] = list(self.kv[op.src])
        for b in failed:
            self.kv[b] = ["failed"] * self.bs
        return failed

    @rule(target=live, prompt=prompts, extra=salts, ok=st.integers(0, 3), bad=st.integers(0, 3))
    def a_load_fails_and_is_recomputed(self, prompt, extra, ok, bad):
        """As ``a_load_fails``, but the engine keeps the request: it uncaches its blocks
        from the first failed one on, rewinds it there and recomputes the rest in the
        same blocks, which are then findable again (before ``rewind``, they stayed
        unfindable while the request lived). With no host load failed, a connector's
        load into block ``bad`` did (a device hit too: its cached children, and theirs,
        go with its content), when no other request holds it or a block after."""
        self._own_step()
        self.last = None
        rid = self._new_id()
        adm = self._add(rid, prompt, extra=extra)
        if adm is None:
            return None
        blocks = self.m.get_block_ids(rid)
        failed = self._plan_with_failed_loads(ok)
        start = adm.num_cached_tokens
        stop = start + adm.num_new_tokens
        others = {b for r in self.tokens for b in self.m.get_block_ids(r)}
        if not failed and bad < stop // self.bs and not others & set(blocks[bad:stop // self.bs]):
            failed = [blocks[bad]]
            for b in blocks[bad:]:
                self.kv[b] = ["failed"] * self.bs
        redo = stop  # where the recompute starts (none: stop)
        if failed:
            first = min(blocks.index(b) for b in failed)
            self.m.uncache_blocks(blocks[first:])
            self.m.check_invariants()
            self.m.rewind(rid, first * self.bs)
            self.m.check_invariants()
            assert self.m.extend(rid, stop - first * self.bs) == ()
            redo = first * self.bs
        self.tokens[rid] = list(prompt)
        self.extra[rid] = extra
        self.scheduled[rid] = self.reserved[rid] = stop
        self._write_loaded(rid, start, redo, stop)
        return rid

    def _write_loaded(self, rid, start, redo, stop):
        """The writes of ``a_load_fails_and_is_recomputed``, once its plan ran: its
        admission scheduled ``start..stop``; the recompute, ``redo..stop`` (``redo ==
        stop``: nothing failed). Here the step computes all of it from the first."""
        self._write(rid, min(start, redo), stop)

    @rule(prompt=prompts, extra=salts, ok=st.integers(0, 3))
    def a_load_fails(self, prompt, extra, ok):
        """An admission's plan runs but its loads from the host tier after the first
        ``ok`` fail: the engine uncaches the request's blocks from the first failed one
        on and drops the request, before its forward pass (with no load failed: as if
        its step never ran). No later hit may serve them."""
        self._own_step()
        self.last = None
        rid = self._new_id()
        adm = self._add(rid, prompt, extra=extra)
        if adm is None:
            return
        blocks = self.m.get_block_ids(rid)
        failed = self._plan_with_failed_loads(ok)
        first = min((blocks.index(b) for b in failed), default=adm.num_cached_tokens // self.bs)
        self.m.uncache_blocks(blocks[first:])
        self.m.check_invariants()
        for b in blocks[first:]:  # (whatever the step would have written there: never)
            self.kv[b] = ["failed"] * self.bs
        self.m.free(rid, num_computed_tokens=min(first * self.bs, adm.num_cached_tokens))

    @rule(rid=live, back=st.integers(1, 9))
    def rewind_and_recompute(self, rid, back):
        """Once its step ran, the KV of the last ``back`` scheduled tokens of ``rid``
        turns out invalid (a load that failed late, a hit past a host load): the engine
        rewinds it there and recomputes them in the same blocks, in the next step. A
        full block among them held by another request too refuses the rewind (a
        RequestError, nothing changed)."""
        self._own_step()
        self.last = None
        if rid not in self.tokens:
            return
        n = self.scheduled[rid]
        p = max(0, n - back)
        blocks = self.m.get_block_ids(rid)
        others = {b for r in self.tokens if r != rid for b in self.m.get_block_ids(r)}
        if others & set(blocks[p // self.bs:n // self.bs]):
            before = self._snapshot()
            with pytest.raises(RequestError):
                self.m.rewind(rid, p)
            assert self._snapshot() == before
            return
        for pos in range(p, n):
            self.kv[blocks[pos // self.bs]][pos % self.bs] = "invalid"
        self.m.rewind(rid, p)
        self.m.check_invariants()
        assert self.m.extend(rid, n - p) == ()
        self._write(rid, p, n)

    @rule(rid=consumes(live))
    def preempt(self, rid):
        self.last = None
        if rid in self.tokens:
            assert list(self.m.preempt(rid)) == self.tokens[rid]
            self.seen[tuple(self.tokens[rid]), self.extra[rid]] = None
            self.preempted.append((self.tokens.pop(rid), self.extra.pop(rid)))
            del self.scheduled[rid], self.reserved[rid]

    @invariant()
    def blocks_hold_each_requests_tokens(self):
        for rid in self.tokens:
            blocks = self.m.get_block_ids(rid)
            assert len(blocks) == -(-max(self.scheduled[rid], self.reserved[rid]) // self.bs)
            for pos in range(self.scheduled[rid]):
                assert self.kv[blocks[pos // self.bs]][pos % self.bs] == self._kv_of(rid, pos), (rid, pos)
        in_use = self.num_blocks - self.m.num_free_blocks
        assert (in_use == 0) == (not self.tokens)


    @invariant()
    def slots_withdrawn_were_unreachable(self):
        """A host slot is withdrawn under a content only when that content left every
        tier (hostlru-r18): no device block (the one found for it, or a pending run's)
        nor slot holds it after the call that withdrew it (a content id never comes back)."""
        if not self.withdrawn:
            return
        gone, self.withdrawn = self.withdrawn, set()
        for b in self.m._pool.blocks:
            r = b.counted
            if r is not None and r.pending:
                assert not gone.intersection(range(r.cid0, r.cid0 + len(r.blocks))), (b, gone)
            assert b.key is None or b.twin or b.content_id not in gone, (b, gone)
        for s in self.m._host.slots:
            assert s.key is None or s.content_id not in gone, (s, gone)

    @invariant()
    def every_live_full_block_is_findable(self):
        """Content that some block holds is findable, even when its first holder went."""
        for rid, tokens in self.tokens.items():
            full = self.scheduled[rid] // self.bs * self.bs
            assert self.m.lookup(tokens[:full] + [0], extra=self.extra[rid]) == full, rid

    def _drain(self):
        """Take the step's events into the mirror; True when the mirror is complete."""
        self._apply(self.m.take_events())
        return True

    def _apply(self, events):
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.mirror.clear()
            elif isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self.mirror[h] = self.mirror.get(h, 0) + 1
            else:
                for h in ev.block_hashes:
                    self.mirror[h] -= 1
                    assert self.mirror[h] >= 0
                    if not self.mirror[h]:
                        del self.mirror[h]

    @invariant()
    def events_predict_lookup(self):
        """A consumer that mirrors the event stream knows what ``lookup`` finds."""
        if not self.events:
            assert self.m.take_events() == []
            return
        self.steps += 1
        if self.steps % self.drain_every or not self._drain():
            return
        candidates = [(p + [0], None) for p in PREFIXES]
        candidates += [(t + [0], self.extra[r]) for r, t in self.tokens.items()]
        candidates += [(t + [0], e) for t, e in self.preempted]
        candidates += [(list(t) + [0], e) for t, e in self.seen]
        for prompt, extra in candidates:
            hashes = hit_hashes(self.hash_fn, self.root, prompt, extra, self.bs)
            k = 0
            while k < len(hashes) and hashes[k] in self.mirror:
                k += 1
            found = self.m.lookup(prompt, extra=extra)
            assert (k * self.bs == found) if self.exact_hash else (k * self.bs >= found), (prompt, k, found)


class DeferredEventsManagerMachine(ManagerMachine):
    """Events taken only every 5th step: runs stored, evicted and stored again into the
    same blocks before their (deferred) events are built, which must still name the
    hashes each block held at each point."""

    drain_every = 5


class HandedOffEventsManagerMachine(ManagerMachine):
    """Events taken with ``take_pending_events()`` and built later, out of order (the
    newest first, which must build the older ones first) or by a later
    ``take_events()``, which must build them first too; the stream, applied in taking
    order, must still predict ``lookup``."""

    drain_every = 2

    def _drain(self):
        self.drains = getattr(self, "drains", 0) + 1
        self.held = getattr(self, "held", [])
        phase = self.drains % 4
        if phase == 3:  # a plain take builds the held batches first, then its own
            events = self.m.take_events()
        else:
            self.held.append(self.m.take_pending_events())
            if phase != 1:
                return False  # held: the mirror lags until they are built
            events = []
            self.held[-1].build()  # the newest first
        for pending in self.held:
            self._apply(pending.build())
        self.held = []
        self._apply(events)
        return True


class CollidingManagerMachine(ManagerMachine):
    """Every hash falls into one of four buckets: the index is full of collisions."""

    hash_mode = staticmethod(lambda data: bytes([hashlib.sha256(data).digest()[0] % 4]))
    exact_hash = False


class ParentBlindManagerMachine(ManagerMachine):
    """The hash ignores the parent digest (its first 16 bytes): equal blocks after
    different prefixes collide, the crafted collision that only the parent check stops."""

    hash_mode = staticmethod(lambda data: hashlib.sha256(data[16:]).digest()[:16])
    exact_hash = False


class FastPathManagerMachine(ManagerMachine):
    """No events and no tier: the index's fast paths (chained blocks stored and evicted
    without dict writes, decode blocks recorded by ``store_filled``, evictions in batches)."""

    events = False


class HostTierManagerMachine(ManagerMachine):
    """With a host tier of 6 slots: evictions offload, admissions load; the simulated
    store runs each step's plan before the step's writes."""

    host_blocks = 6
    num_blocks = 7


class HostTierFastPathManagerMachine(HostTierManagerMachine):
    """The host tier without events: evictions demote in batches, admissions adopt and
    load their slots in batches (the paths events turn off)."""

    events = False


class HostTierChainManagerMachine(HostTierFastPathManagerMachine):
    """A tier twice the pool and longer runs: runs of offloads chained in the tier are
    loaded, recomputed and dropped again (``check_invariants``: no slot stays chained
    once its parent's content is back on the device)."""

    host_blocks = 12


class BlockSizeOneManagerMachine(ManagerMachine):
    """Blocks of one token: every token fills a block, prompts repeat whole blocks (a
    chained block's token bytes are another content's key), every prompt is k*bs+1."""

    bs = 1
    num_blocks = 20


class FastPathBlockSizeOneManagerMachine(BlockSizeOneManagerMachine):
    """Blocks of one token without events: each miss records a long pending run
    (``index/pending.py``), which the small pool evicts whole or cuts at its tail, and
    hits, forks, decodes and uncaches write."""

    events = False


class BlockSizeThreeHostTierManagerMachine(HostTierManagerMachine):
    """Blocks of three tokens (not a power of two) and a host tier."""

    bs = 3


TestManagerMachine = case(ManagerMachine, max_examples=60, stateful_step_count=40)
TestDeferredEventsManagerMachine = case(DeferredEventsManagerMachine, max_examples=100,
                                        stateful_step_count=60)
TestHandedOffEventsManagerMachine = case(HandedOffEventsManagerMachine, max_examples=100,
                                         stateful_step_count=60)
TestCollidingManagerMachine = case(CollidingManagerMachine, max_examples=60, stateful_step_count=40)
TestParentBlindManagerMachine = case(ParentBlindManagerMachine, max_examples=60,
                                     stateful_step_count=40)
TestFastPathManagerMachine = case(FastPathManagerMachine, max_examples=60, stateful_step_count=40)
TestHostTierManagerMachine = case(HostTierManagerMachine, max_examples=60, stateful_step_count=40)
TestHostTierFastPathManagerMachine = case(HostTierFastPathManagerMachine, max_examples=60,
                                          stateful_step_count=40)
TestHostTierChainManagerMachine = case(HostTierChainManagerMachine, max_examples=100,
                                       stateful_step_count=100)
TestBlockSizeOneManagerMachine = case(BlockSizeOneManagerMachine, max_examples=60,
                                      stateful_step_count=40)
TestFastPathBlockSizeOneManagerMachine = case(FastPathBlockSizeOneManagerMachine, max_examples=60,
                                              stateful_step_count=40)
TestBlockSizeThreeHostTierManagerMachine = case(BlockSizeThreeHostTierManagerMachine,
                                                max_examples=60, stateful_step_count=40)
