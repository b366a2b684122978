"""Adversarial scenarios across last session's features: a store run landed in device
blocks (its host slots in transit) whose load then fails, an abort or preemption while
its slots are in transit, ``reset_prefix_cache`` with fetches in flight. What must
never happen: a block served before its content check or after its content was
declared invalid, or the events announcing what ``lookup`` does not find."""


import pytest

from prefixkv import BlockLoads, StoreWait
from prefixkv.errors import RequestError

from .test_shared_store import A, payload
from .test_store_fetch import setup


def landed(backend, layout):
    """A manager whose fetch of A (three blocks) landed in device blocks and whose plan
    (the loads from the slots in transit) was taken; A's request not admitted again yet
    (the engine schedules it a step later)."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    devices = [b.block_id for b in f.devices]
    ex.run()
    assert m.poll_store() == ["b"]
    (loads,) = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert loads.dst == tuple(devices)
    return m, devices


def test_a_landed_run_whose_load_failed_is_not_served_to_its_readmission(backend, layout):
    """The load into the run's second block failed; the engine names it before it
    admits the waiting request again: that request and any other get the first block
    only; the blocks it computes again in its step are found from then on."""
    m, devices = landed(backend, layout)
    m.uncache_blocks([devices[1]])
    m.check_invariants()
    assert m.lookup(A) == 4
    # the fetch gave up the named block and the one after it (empty now: the pool may
    # hand them out again, as blocks to compute) and holds the first only
    assert [b.block_id for b in m._waits.held.holds()] == devices[:1]
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 4 and adm.block_ids[0] == devices[0], adm
    m.check_invariants()
    assert m.add_request("c", A).block_ids[:3] == adm.block_ids[:3]
    m.check_invariants()


class Engine:
    """The KV the engine holds: what each device block and host slot holds (A's block
    ``k`` fetched is ``payload(k)``, as its writer computed it; a block computed here,
    the tokens up to its end), after each plan is run in the plan's order."""

    def __init__(self, m):
        self.m = m
        self.dev = ["junk"] * m.num_blocks
        self.host = ["junk"] * len(m._host.slots)

    def run(self, ops=None):
        for op in self.m.take_kv_ops() if ops is None else ops:
            name = type(op).__name__
            if name == "BlockOffloads":
                for d, s in zip(op.src, op.dst, strict=True):
                    self.host[s] = self.dev[d]
            elif name == "StoreFetched":
                self.host[op.dst] = bytes(op.payload)
            elif name == "BlockLoads":
                for s, d in zip(op.src, op.dst, strict=True):
                    self.dev[d] = self.host[s]
            elif name == "BlockCopy":
                self.dev[op.dst] = self.dev[op.src]

    def compute(self, prompt, block_ids, start=0, stop=None):
        """The forward pass over ``prompt``'s full blocks ``start`` to ``stop``."""
        for j in range(start, len(prompt) // 4 if stop is None else stop):
            self.dev[block_ids[j]] = tuple(prompt[:(j + 1) * 4])

    def check_a_hits(self, adm):
        for k, b in enumerate(adm.block_ids[:adm.num_cached_tokens // 4]):
            assert self.dev[b] in (payload(k), tuple(A[:(k + 1) * 4])), \
                f"A's block {k} served from block {b}: {self.dev[b]!r}"


def test_an_aborted_runs_blocks_evicted_in_its_landing_step_are_not_offloaded_unloaded(backend, layout):
    """The fetch's run landed in device blocks (their loads in this step's plan) and its
    request was aborted: the blocks are free, and another admission in the same step
    evicts them. Offloads run before loads: a block evicted so must not be offloaded
    (its KV is not there yet), and a later hit on A must find A's KV."""
    m, ex, _ = setup(backend, layout)
    e = Engine(m)
    assert m.add_request("b", A) == StoreWait("b", 3)
    ex.run()
    assert m.poll_store() == ["b"]
    m.free("b")                                        # aborted: its blocks come back
    adm = m.add_request("x", list(range(100, 129)), read_cache=False)  # 8 blocks: all of the pool
    assert adm is not None
    e.run()
    e.compute(list(range(100, 129)), adm.block_ids)
    m.free("x")
    e.run()
    m.check_invariants()
    got = m.add_request("c", A)
    if isinstance(got, StoreWait):
        ex.run()
        assert m.poll_store() == ["c"]
        got = m.add_request("c", A)
    e.run()
    e.check_a_hits(got)
    m.check_invariants()


def _admit_again(m, ex, rid, prompt):
    """The engine's admission of a waiting request: fetches run and land first."""
    got = m.add_request(rid, prompt)
    while isinstance(got, StoreWait):
        ex.run()
        assert rid in m.poll_store()
        got = m.add_request(rid, prompt)
    return got


def test_a_reset_after_a_run_landed_in_host_slots_before_its_readmission(backend, layout):
    """The run landed in host slots only (the pool was short at the start) and the
    engine reset the prefix cache before it admitted the request again: the slots lost
    their content and the plan its payloads, so the re-admission must not take them."""
    m, ex, _ = setup(backend, layout)
    e = Engine(m)
    x = m.add_request("x", list(range(100, 121)), read_cache=False)  # 6 of the 8 blocks
    e.run()
    e.compute(list(range(100, 121)), x.block_ids)
    assert m.add_request("b", A) == StoreWait("b", 3)
    assert m._waits.waiting["b"].devices is None                     # host slots only
    m.free("x")
    e.run()
    ex.run()
    assert m.poll_store() == ["b"]
    assert m.reset_prefix_cache(keep_store=True)
    e.run()
    m.check_invariants()
    got = _admit_again(m, ex, "b", A)
    e.run()
    e.check_a_hits(got)
    m.check_invariants()


# A store fetch holding the rewound blocks (its device hits, or its landed run) gives
# them up (core/store_giveup.py): before, ``rewind`` refused them (RequestError "held by
# other requests too") until the fetch's request came back. Discounting the hold in
# ``rewind`` alone (tried, 9c0999f) broke the index: the recompute records the block's
# content while the fetch still holds it ("index entry for Block(id=0, ref=2, ..., twin)
# does not match its content"; found by test_trust_machine).


PROMPT = A[:8] + [77]                        # A's first two blocks, then another token


def computed_and_fetching(backend, layout):
    """``r`` computed ``PROMPT`` (A's first two blocks) and ``q`` waits on its fetch of
    A's third block, which holds ``r``'s two as its device hits."""
    m, ex, _ = setup(backend, layout)
    e = Engine(m)
    r = m.add_request("r", PROMPT, read_cache=False)
    e.run()
    e.compute(PROMPT, r.block_ids)
    assert m.add_request("q", A) == StoreWait("q", 1)
    return m, ex, e, r


def test_a_rewind_after_a_failed_load_is_not_refused_for_a_fetchs_hold(backend, layout):
    """``r`` computed A's first two blocks; ``q``'s fetch of A's third block holds them
    (its device hits). ``r``'s second block turns out invalid: the engine names it and
    takes ``r`` back to recompute it. The fetch is not a request the engine can free
    (before: RequestError "blocks [1] are held by other requests too, which must be freed
    or preempted first"): it gives up the block; ``q``, admitted again, must be served
    only valid KV, and the recomputed blocks found again."""
    m, ex, e, r = computed_and_fetching(backend, layout)
    f = m._waits.waiting["q"]
    assert f.held == [m._pool.blocks[i] for i in r.block_ids[:2]]
    m.uncache_blocks([r.block_ids[1]])
    assert f.held == [m._pool.blocks[r.block_ids[0]]]      # the valid prefix: kept
    e.dev[r.block_ids[1]] = "invalid"
    m.rewind("r", 4)
    m.check_invariants()
    ex.run()
    assert m.poll_store() == ["q"]
    q = m.add_request("q", A)                 # before r computes its block 1 again
    e.run()
    e.check_a_hits(q)
    assert q.num_cached_tokens == 4
    assert m.extend("r", 5) is not None
    e.run()
    e.compute(PROMPT, r.block_ids, 1)
    e.compute(A, q.block_ids, 1)
    m.check_invariants()
    assert m.lookup(PROMPT) == 8 and m.lookup(A + [0]) == 12


def test_a_run_landed_under_a_block_found_invalid_since_is_not_served(backend, layout):
    """As above, but ``q``'s fetch landed (its run on the device, chained under ``r``'s
    second block) before that block was found invalid: the run was computed on it
    elsewhere, but here it hangs under KV that is not there; ``q``'s re-admission and
    every lookup take ``r``'s first block only, until ``r`` computed its second again."""
    m, ex, e, r = computed_and_fetching(backend, layout)
    ex.run()
    assert m.poll_store() == ["q"]
    e.run()                                   # the run's payload and load
    assert m.lookup(A + [0]) == 12
    m.uncache_blocks([r.block_ids[1]])
    e.dev[r.block_ids[1]] = "invalid"
    m.rewind("r", 4)
    m.check_invariants()
    assert m.lookup(A + [0]) == 4
    q = m.add_request("q", A)
    e.run()
    e.check_a_hits(q)
    assert q.num_cached_tokens == 4
    m.check_invariants()


def test_a_request_that_hit_a_landed_run_rewinds_past_it_while_the_fetch_holds_it(backend, layout):
    """``q``'s fetch landed A's run in device blocks; ``r`` was admitted on it (a hit of
    all three) before ``q`` came back. The load into the run's second block failed:
    the engine names it and takes ``r`` back. ``q``'s re-admission takes the first block
    only (the fetch's blocks after it hold no valid KV)."""
    m, ex, _ = setup(backend, layout)
    e = Engine(m)
    assert m.add_request("q", A) == StoreWait("q", 3)
    devices = [b.block_id for b in m._waits.waiting["q"].devices]
    ex.run()
    assert m.poll_store() == ["q"]
    r = m.add_request("r", A)
    assert r.num_cached_tokens == 12 and r.block_ids[:3] == tuple(devices)
    e.run()
    e.dev[devices[1]] = "failed"              # (its load failed)
    m.uncache_blocks([devices[1]])
    m.rewind("r", 4)
    m.check_invariants()
    q = m.add_request("q", A)
    e.run()
    e.check_a_hits(q)
    assert q.num_cached_tokens == 4
    m.check_invariants()


def test_a_recompute_of_a_block_a_fetch_holds_keeps_the_index_sound(backend, layout):
    """The case a rewind that only discounted the fetch's hold broke: ``r`` rewound to
    its first block (no load failed: the engine took it back) and recomputes both
    blocks while ``q``'s fetch still holds them."""
    m, ex, e, r = computed_and_fetching(backend, layout)
    m.rewind("r", 0)
    f = m._waits.waiting["q"]                 # nothing valid held: q's wait ends (it is
    assert f.expired and m._waits.held.holds() == f.devices  # listed), the run's block stays
    assert m.extend("r", len(PROMPT)) is not None
    m.check_invariants()
    e.run()
    e.compute(PROMPT, r.block_ids)
    ex.run()
    assert m.poll_store() == ["q"]
    q = m.add_request("q", A)
    e.run()
    e.check_a_hits(q)
    m.check_invariants()


def test_a_request_preempted_while_its_run_is_in_transit_gets_valid_kv_back(backend, layout):
    """``b`` is admitted on its landed run (the loads from the slots in transit are in
    this step's plan) and preempted in the same step, before its step ran; another
    admission evicts part of what it held; ``b`` comes back: every hit holds A's KV."""
    m, ex, _ = setup(backend, layout)
    e = Engine(m)
    assert m.add_request("b", A) == StoreWait("b", 3)
    ex.run()
    assert m.poll_store() == ["b"]
    assert m.add_request("b", A).num_cached_tokens == 12
    tokens = m.preempt("b", num_computed_tokens=0)
    x = m.add_request("x", list(range(100, 121)), read_cache=False)  # 6 blocks: evicts
    assert x is not None
    e.run()                                             # the payloads, the loads
    e.compute(list(range(100, 121)), x.block_ids)
    m.free("x")
    m.check_invariants()
    got = _admit_again(m, ex, "b", list(tokens))
    e.run()
    e.check_a_hits(got)
    m.check_invariants()


def test_a_rewind_refused_for_another_request_leaves_the_fetchs_holds(backend, layout):
    """``s`` holds ``r``'s blocks too (it hit them): the rewind of ``r`` is refused, before
    any change; the fetch, which would give its holds up, keeps them."""
    m, ex, e, r = computed_and_fetching(backend, layout)
    s = m.add_request("s", PROMPT)
    assert s.block_ids[:2] == r.block_ids[:2]
    f = m._waits.waiting["q"]
    held = list(f.held)
    with pytest.raises(RequestError, match="held by other requests too"):
        m.rewind("r", 4)
    assert f.held == held and not f.expired
    m.check_invariants()
    m.free("s")
    m.rewind("r", 4)                          # (now the fetch's hold alone: given up)
    assert f.held == held[:1]
    m.check_invariants()
