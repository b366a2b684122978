"""The manager's state machine with the plan taken late: a step is any number of scheduling
calls (admissions, growth, forks, frees), and ``take_kv_ops`` is a rule of its own.

``test_state_machine`` takes the plan after every scheduling call. An engine takes it
once a step, after all of them (vLLM's scheduler admits, grows, preempts and frees many
requests before it), so a fork's copy waits while the child fills the copied block, is
freed, and the step's admissions evict (``core/copies.py``). Here the simulated store
owes each step's writes until ``take_plan``: it runs the plan, then the forward pass of
the tokens the step scheduled. A request freed in the step with tokens owed is freed as
an engine drops it before its step ran (``num_computed_tokens``: what was computed
before), unless another request holds a block it filled in the step; or with its tokens
counted as computed (the default), when the store writes them at the step's end into
the blocks that still hold their content (``lookup_block_ids``: a hit, a spare, the block
the plan holds for its content; a block handed out again is not written)."""

from hypothesis import strategies as st
from hypothesis.stateful import consumes, initialize, invariant, multiple, rule

from machine_rules import case
from prefixkv import BlockLoads, BlockOffloads
from test_state_machine import PREFIXES, ManagerMachine, prompts


class LatePlanManagerMachine(ManagerMachine):
    """The plan is taken only by ``take_plan`` (and by the rules that end a step: a failed
    load, a fork chain, a reset)."""

    late_plan = True

    @initialize()
    def setup(self):
        ManagerMachine.setup(self)
        self.owed: list[tuple[str, int, int]] = []  # (rid, start, stop) the step schedules
        self.counted: list[tuple[list[int], object, list[tuple[int, int]]]] = []
        self.dirty = False  # a plan or writes are owed: the store's KV lags

    def _write(self, rid, start, stop):
        self.last = (rid, start, stop)
        if start < stop:
            self.owed.append((rid, start, stop))
        self.dirty = True

    @rule()
    def take_plan(self):
        """The step ends: its plan runs, then its forward pass."""
        self._run_plan()
        for rid, start, stop in self.owed:
            if rid in self.tokens:
                self._forward(rid, start, stop)
        for tokens, extra, ranges in self.counted:  # freed, counted as computed
            end = max(stop for _, stop in ranges) // self.bs * self.bs
            found = self.m.lookup_block_ids(tokens[:end] + [0], extra=extra) if end else ()
            for start, stop in ranges:
                for pos in range(start, min(stop, len(found) * self.bs)):
                    self.kv[found[pos // self.bs]][pos % self.bs] = (extra, tuple(tokens[:pos + 1]))
        self.owed, self.counted, self.dirty = [], [], False
        self.last = None

    def _check_load_into(self, rid, k, src, dst):
        """Also: no tokens the step owes fill the block (a load into a block the step
        computes is dead: before deadload-r16, a rewound hit's)."""
        ManagerMachine._check_load_into(self, rid, k, src, dst)
        lo, hi = k * self.bs, (k + 1) * self.bs
        assert not any(r == rid and s < hi and e > lo for r, s, e in self.owed), \
            (rid, k, src, dst, self.owed)

    @rule(target=ManagerMachine.live, parent=ManagerMachine.live)
    def fork(self, parent):
        """A fork in the step, after the parent's tokens were computed (an engine forks
        after sampling): its copy waits for the plan."""
        if parent not in self.tokens or self.scheduled[parent] != len(self.tokens[parent]) \
                or any(w[0] == parent for w in self.owed):
            return multiple()
        child = self._new_id()
        if self.m.fork(parent, child) is None:
            return multiple()
        self.last = None
        self.dirty = True
        self.tokens[child] = list(self.tokens[parent])
        self.extra[child] = self.extra[parent]
        self.scheduled[child] = self.scheduled[parent]
        self.reserved[child] = self.reserved[parent]
        return child

    @rule(data=st.data())
    def step(self, data):
        """One decode token for every request whose prefill is scheduled, in one call."""
        rids = [r for r in self.tokens if self.scheduled[r] == len(self.tokens[r])]
        toks = [data.draw(st.integers(0, 12)) for _ in rids]
        got = self.m.append_step(rids, toks)
        for rid, tok in zip(rids, toks, strict=True):
            if rid not in got.short:
                self.tokens[rid].append(tok)
                n = self.scheduled[rid] = self.scheduled[rid] + 1
                self.reserved[rid] = max(self.reserved[rid], n)
                self.owed.append((rid, n - 1, n))
        self.dirty = True
        self.last = None

    @rule(rid=ManagerMachine.live, n=st.integers(0, 6))
    def reserve(self, rid, n):
        if rid not in self.tokens:
            return
        before = self._snapshot()
        if self.m.reserve(rid, n) is None:
            assert self._snapshot() == before
            return
        self.reserved[rid] = max(self.reserved[rid], self.scheduled[rid] + n)

    def _leave(self, rid, counted, preempt):
        """Free (or preempt) ``rid`` in the step: with the tokens it owes counted as
        computed, or not (``counted``; not possible while another request holds a block
        those tokens fill: it read them, so it would go too)."""
        ranges = [(s, e) for r, s, e in self.owed if r == rid]
        kw = {}
        if ranges and not counted:
            first = min(s for s, _ in ranges)
            blocks = self.m.get_block_ids(rid)
            others = {b for r in self.tokens if r != rid for b in self.m.get_block_ids(r)}
            if others & set(blocks[first // self.bs:]):
                counted = True
            else:  # (its blocks keep what they held: a pending offload may still read it)
                kw["num_computed_tokens"] = first
        if ranges and counted:
            self.counted.append((list(self.tokens[rid]), self.extra[rid], ranges))
        self.owed = [w for w in self.owed if w[0] != rid]
        if preempt:
            assert list(self.m.preempt(rid, **kw)) == self.tokens[rid]
            self.seen[tuple(self.tokens[rid]), self.extra[rid]] = None
            self.preempted.append((self.tokens.pop(rid), self.extra.pop(rid)))
            del self.scheduled[rid], self.reserved[rid]
        else:
            self.m.free(rid, **kw)
            self._forget(rid)

    @rule(rid=consumes(ManagerMachine.live), counted=st.booleans())
    def free(self, rid, counted):
        self.last = None
        if rid in self.tokens:
            self._leave(rid, counted, False)

    @rule(rid=consumes(ManagerMachine.live), counted=st.booleans())
    def preempt(self, rid, counted):
        self.last = None
        if rid in self.tokens:
            self._leave(rid, counted, True)

    @rule()
    def abort_before_step_ran(self):
        """The step's last scheduled request is dropped before the step ran."""
        if self.last is not None and self.last[0] in self.tokens:
            self._leave(self.last[0], False, False)
        self.last = None

    @rule(target=ManagerMachine.live, parent=ManagerMachine.live, fill_child=st.booleans(),
          tok=st.integers(0, 12), gone=st.sampled_from(["", "c", "p", "cp", "pc"]),
          counted=st.booleans(), prompt=st.none() | prompts, preempt=st.booleans())
    def fork_fill_free(self, parent, fill_child, tok, gone, counted, prompt, preempt=False):
        """In one step: fork ``parent``, fill the copied block (the child's, or the
        parent's own: the copy's source), free (``preempt``: preempt) the child (``c``)
        and the parent (``p``) in the order ``gone`` gives, then admit ``prompt``, which
        may evict what they released. (The rules alone reach this rarely: a block the
        plan holds for its content, or a filled source unpinned, whose prefix the step
        may evict.)"""
        child = self.fork(parent)
        if not isinstance(child, str):
            return multiple()
        rid = child if fill_child else parent
        self.append(rid, [tok] * (-self.scheduled[rid] % self.bs or self.bs))
        for who in gone:
            r = child if who == "c" else parent
            if r in self.tokens:
                self._leave(r, counted, preempt)
        new = self._admit(prompt, None, None) if prompt is not None else None
        return multiple(*[r for r in (child, new) if r is not None and r in self.tokens])

    @rule(target=ManagerMachine.live, pre=st.integers(0, len(PREFIXES) - 1),
          tail=st.integers(0, 12), how=st.sampled_from(["free", "abort", "preempt", "uncache",
                                                        "rewind"]), prompt=prompts)
    def a_hit_goes_in_its_step(self, pre, tail, how, prompt):
        """In one step: admit a prompt whose two full blocks were likely seen before (a
        host tier loads its host hits into fresh blocks), then, before the step ran, free
        it (its tokens counted), abort it, preempt it, declare its blocks invalid and
        drop it, or rewind it to its start and recompute it; then admit ``prompt``, which
        may evict what it released. (Before deadload-r16 a load into a block released so
        stayed in the plan: into a miss's block, a decode's, a recomputed one.)"""
        rid = self._admit(PREFIXES[pre] + [tail], None, None)
        if rid is None:
            return multiple()
        self.last = None
        blocks = self.m.get_block_ids(rid)
        others = {b for r in self.tokens if r != rid for b in self.m.get_block_ids(r)}
        if how in ("free", "abort", "preempt"):
            self._leave(rid, how == "free", how == "preempt")
        elif others & set(blocks):  # (they would have to go too)
            pass
        elif how == "uncache":
            self.m.uncache_blocks(blocks)  # (their KV is left as it was: an offload of the
            self.m.free(rid, num_computed_tokens=0)  # step may read it, and nothing finds them)
            self.owed = [w for w in self.owed if w[0] != rid]
            self._forget(rid)
        else:
            n = self.scheduled[rid]
            self.m.rewind(rid, 0)
            assert self.m.extend(rid, n) == ()
            self.owed = [w for w in self.owed if w[0] != rid] + [(rid, 0, n)]
        new = self._admit(prompt, None, None)
        return multiple(*[r for r in (rid, new) if r is not None and r in self.tokens])

    @rule()
    def reset_in_step(self):
        """``reset_prefix_cache`` in the step, its plan not taken (``reset`` ends the step
        first): the plan may hold the offloads of what the step's admissions evicted and
        the loads of a hit freed in the step; a reset drops them with the content (the
        next plan has none). It succeeds exactly when no request is live and the plan
        pins no fork copy's source: a fork's child filled the copied block and both
        left in the step (seed 103, SmallLatePlanManagerMachine: a_hit_goes_in_its_step,
        reset, fork_fill_free(gone='cp', fill_child=True), reset_in_step), so the copy
        must still run and its source is a block in use: refusing is right, the caller
        resets after the step (as ``reset`` does)."""
        self.last = None
        ok = not self.tokens and not self.m._copies.pins
        assert self.m.reset_prefix_cache() == ok
        if ok:
            assert self.m.num_cached_blocks == 0
            assert self.m.take_kv_ops() == []  # (the step's plan went with the content)
            self.owed, self.counted, self.dirty = [], [], False

    def _write_loaded(self, rid, start, redo, stop):
        """``a_load_fails_and_is_recomputed`` took its step's plan (its loads ran, some
        failed): that step's forward pass runs now, before any later plan, and writes the
        admission's tokens before the first failed block (the manager counts them computed
        from the next step on, whose plan may offload them); the recompute from ``redo``,
        scheduled after the plan was taken, is owed to the step under way."""
        self._forward(rid, start, min(redo, stop))
        if redo < stop:
            self._write(rid, redo, stop)

    # (``test_state_machine``'s rule aborts the request its own step scheduled: not here)
    abort_with_a_request_that_hit_it = None

    def _own_step(self):
        if self.dirty:
            self.take_plan()

    @invariant()
    def blocks_hold_each_requests_tokens(self):
        """Checked once the step ran (its plan and forward pass)."""
        if not self.dirty:
            ManagerMachine.blocks_hold_each_requests_tokens(self)


class SmallLatePlanManagerMachine(LatePlanManagerMachine):
    """Late plans in a pool of 8 blocks of 2 tokens: a step's admissions evict what its
    frees released (the parent of a block the plan holds, before the fix)."""

    bs = 2
    num_blocks = 8


class HostLatePlanManagerMachine(LatePlanManagerMachine):
    """Late plans with a host tier of 6 slots: a step's frees and admissions evict and
    offload, its admissions load host hits, and a request dropped in the step gives back
    the block a load of the plan writes (the load leaves the plan when the block loses
    its content: ``tiers/host_loads.py``)."""

    host_blocks = 6


class TightHostLatePlanManagerMachine(HostLatePlanManagerMachine):
    """The host tier under a pool of 7 blocks (as ``HostTierManagerMachine``): a step's
    admissions evict what earlier steps computed, and later ones load it back (host hits
    are rare in the pool of 14)."""

    num_blocks = 7


class SmallHostLatePlanManagerMachine(SmallLatePlanManagerMachine):
    """The small pool with a host tier of 6 slots: nearly every admission evicts, so the
    step's offloads read blocks that earlier steps' forward passes wrote."""

    host_blocks = 6


def test_a_recomputed_admissions_forward_pass_runs_before_the_next_plan():
    """(Found by HostLatePlanManagerMachine, seed 4, shrunk by hand to 8 blocks of 2.)
    ``a_load_fails_and_is_recomputed`` takes its step's plan itself. The model owed that
    step's forward pass to the next ``take_plan``, after the next step's plan, whose
    offload of the admission's block read it unwritten: the host slot held None, and the
    request readmitted later loaded None into its first block. The manager was right:
    the plan it offloads that block in is the one after the block's step's plan (an
    engine runs a step's forward pass before the next plan), so the slot holds the KV."""
    st = SmallHostLatePlanManagerMachine()
    st.setup()
    plans = []
    take = st.m.take_kv_ops
    st.m.take_kv_ops = lambda: plans.append(take()) or plans[-1]

    def checked(rid=None):
        st.consistent()
        st.blocks_hold_each_requests_tokens()
        st.events_predict_lookup()
        st.every_live_full_block_is_findable()
        return rid

    kv_01 = [(None, (0,)), (None, (0, 1))]  # the KV of the block of tokens [0, 1]
    r1 = checked(st.a_load_fails_and_is_recomputed(prompt=[0, 1, 0], extra=None, ok=0, bad=1))
    assert plans == [[]] and st.m.get_block_ids(r1) == (0, 1)  # no load, nothing failed
    st.preempt(rid=r1, counted=True)  # the next step: r1 goes, its blocks cached
    checked()
    r2 = checked(st._admit(PREFIXES[0] + [0] * 8, None, None))  # the whole pool
    assert st.m.get_block_ids(r2) == (1, 2, 3, 4, 5, 6, 7, 0)  # block 0 evicted
    st.take_plan()
    assert plans[-1] == [BlockOffloads(src=(0,), dst=(0,))]
    assert st.host_kv[0] == kv_01  # (r1's step's forward pass wrote block 0 before)
    checked()
    st.free(rid=r2, counted=True)
    r3 = checked(st.readmit(prepare=False))  # r1's [0, 1, 0] again: a host hit on slot 0
    assert st.m.get_block_ids(r3) == (0, 7) and st.owed == [(r3, 2, 3)]
    st.take_plan()
    # (r2's tail goes down first: the offload reads block 0 before the load writes it)
    assert plans[-1] == [BlockOffloads(src=(0, 7), dst=(1, 2)), BlockLoads(src=(0,), dst=(0,))]
    assert st.kv[0] == kv_01
    checked()


TestLatePlanManagerMachine = case(LatePlanManagerMachine, max_examples=200, stateful_step_count=50)
TestSmallLatePlanManagerMachine = case(SmallLatePlanManagerMachine, max_examples=200,
                                       stateful_step_count=50)
TestHostLatePlanManagerMachine = case(HostLatePlanManagerMachine, max_examples=100,
                                      stateful_step_count=50)
TestTightHostLatePlanManagerMachine = case(TightHostLatePlanManagerMachine, max_examples=100,
                                           stateful_step_count=50)
TestSmallHostLatePlanManagerMachine = case(SmallHostLatePlanManagerMachine, max_examples=100,
                                           stateful_step_count=50)
