"""prefixkv.groups' Mamba group (``mamba()``, a sparse group): the blocks a step takes and
releases, what is cached, hits, and what is refused. Exact block ids, in a pool whose
free order is known (fresh blocks in id order)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant, multiple, precondition, rule

from prefixkv.errors import ConfigError, PromptTooLongError
from prefixkv.groups import HybridKVCacheManager, full_attention, mamba, sliding_window
from prefixkv.groups.fit import least_blocks
from test_groups_state_machine import HybridMachine

BS = 4
N = 0  # the null block of a manager whose groups release blocks


def test_a_step_takes_the_block_of_its_last_position_and_the_next_step_releases_the_one_before():
    m = HybridKVCacheManager([full_attention(), mamba()], 40, BS)
    m.add_request("a", list(range(22)), num_new_tokens=12)   # [0, 12): block 2 holds the state at 12
    assert m.get_block_ids("a") == ((1, 2, 3), (N, N, 4))
    m.extend("a", 7)                                         # [12, 19): reads 4, writes block 4
    assert m.get_block_ids("a") == ((1, 2, 3, 5, 6), (N, N, 4, N, 7))
    m.extend("a", 3)                                         # [19, 22): block 2 goes back
    assert m.get_block_ids("a") == ((1, 2, 3, 5, 6, 8), (N, N, N, N, 7, 9))
    assert m.num_free_blocks == 40 - 1 - 8
    m.append_tokens("a", [100])                              # 22: in block 5, nothing moves
    assert m.get_block_ids("a")[1] == (N, N, N, N, N, 9)     # (block 4, read at 19, released)
    m.check_invariants()


def test_a_hit_takes_the_state_block_at_its_end_alone():
    m = HybridKVCacheManager([full_attention(), mamba()], 40, BS)
    m.add_request("a", list(range(13)))                      # one step: block 3 holds the state at 13
    m.append_tokens("a", [13, 14, 15])                       # fills block 3 in place: cached at 16
    assert m.lookup_block_ids(list(range(16)) + [9]) == ((1, 2, 3, 4), (N, N, N, 5))
    adm = m.add_request("b", list(range(16)) + [9, 9, 9, 9, 9])
    assert adm.num_cached_tokens == 16
    assert adm.group_block_ids == ((1, 2, 3, 4, 6, 7), (N, N, N, 5, N, 8))
    m.check_invariants()


def test_a_state_a_step_ran_past_is_not_cached_for_its_block():
    # chunks [0, 6) and [6, 14): Mamba block 1 holds the state at 6 and is never written
    # again (the next step writes block 3); cached as block 1 it would serve a prompt
    # sharing 8 tokens the state after 6 of them. Only a block whose step ended at its
    # end holds its state (vLLM's scheduler ends every prefill chunk but the last on a
    # block boundary in this mode, so it never meets this)
    m = HybridKVCacheManager([full_attention(), mamba()], 40, BS)
    m.add_request("a", list(range(14)), num_new_tokens=6)
    m.extend("a", 8)
    assert m.lookup(list(range(8)) + [99]) == 0
    m.append_tokens("a", [14, 15])                           # block 3 now holds the state at 16
    assert m.lookup(list(range(16)) + [99]) == 16
    m.check_invariants()


def test_least_blocks_counts_one_mamba_block_per_step():
    groups = (full_attention(), mamba())
    # a 40-token prompt in one step: 10 full-attention blocks and 1 Mamba block
    assert least_blocks(groups, BS, 40, None, 0, False, 100) == 11
    m = HybridKVCacheManager(groups, 12, BS)
    m.add_request("a", list(range(40)))                      # fits: 11 of 11 usable
    with pytest.raises(PromptTooLongError):
        m.add_request("b", list(range(41)))                  # 11 + 1: more than the pool
    m.check_invariants()


def test_fork_and_window_size_are_refused_for_mamba():
    m = HybridKVCacheManager([sliding_window(4), mamba()], 40, BS)
    m.add_request("a", list(range(9)))
    with pytest.raises(ConfigError, match="Mamba"):
        m.fork("a", "b")
    with pytest.raises(ConfigError, match="mamba"):
        _ = mamba().window_size
    with pytest.raises(ConfigError):
        type(mamba())("mamba", 3)
    m.check_invariants()


class MambaMachine(HybridMachine):
    """The hybrid state machine on full attention beside a Mamba group: the forward pass
    reads the state a step starts from in the block before it and writes the state at
    its end in the block of its last position; every hit must hand the right state. Not
    driven here: ``reserve`` past a step's end (the step's state would land in an entry
    it jumped over: docs/integration.md, Mamba layers), and a recompute from a position
    whose state no block holds (vLLM reads its null block there)."""

    groups = (full_attention(), mamba())
    num_blocks = 20

    def _state(self, g, rid, end):
        sound = "state", g, self.extra[rid], tuple(self.tokens[rid][:end])
        t = self.taint[rid]
        return sound if t is None or end <= t else ("lost", *sound)

    def _forward(self, rid, start, stop):
        self.start[rid] = start
        for g, ids in enumerate(self.m.get_block_ids(rid)):
            if not self.groups[g].sparse:
                for pos in range(start, stop):
                    assert ids[pos // BS] != self.null, (g, pos)
                    self.kv[ids[pos // BS]][pos % BS] = self._kv_of(g, rid, pos)
                continue
            if start and (self.taint[rid] is None or start < self.taint[rid]):  # the state
                b = ids[(start - 1) // BS]  # the step starts from (a lost one: any)
                assert b != self.null and self.kv[b][0] == self._state(g, rid, start), (rid, g, start, ids)
            b = ids[(stop - 1) // BS]
            assert b != self.null, (rid, g, stop, ids)
            self.kv[b][0] = self._state(g, rid, stop)

    def _resumable(self, rid, p):
        g = next(g for g, s in enumerate(self.groups) if s.sparse)
        ids = self.m.get_block_ids(rid)[g]
        b = ids[(p - 1) // BS] if p else None
        return p == 0 or (b != self.null and self.kv[b][0] == self._state(g, rid, p))

    @rule(target=HybridMachine.live, parent=HybridMachine.live)
    def fork(self, parent):
        if parent in self.tokens:
            with pytest.raises(ConfigError, match="Mamba"):
                self.m.fork(parent, self._new_id())
        return multiple()

    @rule()
    def fork_chain(self):
        pass

    def _lost(self, rid, p):
        """A recompute from ``p`` starts from a state no block holds (the base rule then
        rewinds there: the state written from there on is a lost one, never to be hit)."""
        return not self._resumable(rid, p)

    @rule()
    def reserve(self):
        pass

    @precondition(lambda self: self.last is not None and self.last[0] in self.tokens)
    @rule()
    def abort_before_step_ran(self):
        rid, start, stop = self.last
        for g, ids in enumerate(self.m.get_block_ids(rid)):
            if self.groups[g].sparse:
                self.kv[ids[(stop - 1) // BS]][0] = "never computed"
                continue
            for pos in range(start, stop):
                self.kv[ids[pos // BS]][pos % BS] = "never computed"
        self.m.free(rid, num_computed_tokens=start)
        self._forget(rid)
        self.last = None

    @invariant()
    def no_group_reads_kv_it_does_not_hold(self):
        for rid in self.tokens:
            for g, (spec, ids) in enumerate(zip(self.groups, self.m.get_block_ids(rid), strict=True)):
                assert len(ids) == -(-max(self.scheduled[rid], self.reserved[rid]) // BS) + spec.ahead
                n, t = self.scheduled[rid], self.taint[rid]
                if spec.sparse:  # the state at the scheduled end, in the block of its last position
                    assert not n or (t is not None and n > t) or \
                        self.kv[ids[(n - 1) // BS]][0] == self._state(g, rid, n), (rid, n, ids)
                    continue
                assert self.null not in ids
                for pos in range(n if t is None else min(n, t)):  # (past a taint: unknown)
                    assert self.kv[ids[pos // BS]][pos % BS] == self._kv_of(g, rid, pos), (rid, g, pos)
        assert all(v is None for v in self.kv[self.null])


TestMambaMachine = MambaMachine.TestCase
TestMambaMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class MambaAheadMachine(MambaMachine):
    """``MambaMachine`` with blocks ahead in the Mamba group (``mamba(ahead=2)``: vLLM's
    speculative blocks in align mode, groups/spec_states.py): after every step the
    worker writes draft states into them, so a hit or a step that read one (before a
    step made it a state block and wrote its state) reads a draft, never the state."""

    groups = (full_attention(), mamba(ahead=2))
    num_blocks = 24

    def _forward(self, rid, start, stop):
        super()._forward(rid, start, stop)
        for g, ids in enumerate(self.m.get_block_ids(rid)):
            for b in ids[len(ids) - self.groups[g].ahead:]:
                assert b != self.null, (rid, g, ids)
                self.kv[b][0] = ("draft", rid, stop)


class MambaFirstAheadMachine(MambaAheadMachine):
    """The Mamba group first (its table's length measures growth), one block ahead."""

    groups = (mamba(ahead=1), full_attention())


TestMambaAheadMachine = MambaAheadMachine.TestCase
TestMambaAheadMachine.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
TestMambaFirstAheadMachine = MambaFirstAheadMachine.TestCase
TestMambaFirstAheadMachine.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)


def test_lookup_per_group_with_peek_counts_the_prompts_last_full_block():
    # vLLM's EAGLE looks at the block holding the last token when it is full: full
    # attention alone then serves all 16 tokens (12 without peek); the hit, EAGLE's,
    # drops that block and finds no Mamba state at or below 12 (only at 16)
    m = HybridKVCacheManager([full_attention(), mamba()], 40, BS)
    m.add_request("a", list(range(16)))
    m.free("a")
    prompt = list(range(16))
    assert m.lookup_per_group(prompt) == (12, 0)
    assert m.lookup_per_group(prompt, peek=True) == (16, 16)
    assert m.lookup_per_group(prompt + [9], peek=True) == (16, 16)
    assert m.lookup(prompt + [9]) == 16 and m.lookup(prompt + [9], peek=(True, False)) == 0
    m.check_invariants()


def test_lookup_per_group_with_peek_walks_one_block_past_the_cap_with_different_block_sizes():
    # full attention at 4 beside a window of 8 at 8 (hash 4), 24 tokens computed whole:
    # a lookup of the same 24 tokens stops at the cap, 23 (full attention 20, the window
    # 16); with peek (vLLM's EAGLE: the plug-in's junction, mamba.py) it walks one
    # largest block past the cap: 24 in both. Before session 30: ConfigError.
    from prefixkv.groups import BlockSizes

    m = HybridKVCacheManager([full_attention(), sliding_window(8)], 40, BlockSizes.of((4, 8)))
    assert m.lookup_per_group(list(range(20)), peek=True) == (0, 0)
    assert m.add_request("a", list(range(24))) is not None
    m.free("a")
    assert m.lookup_per_group(list(range(24))) == (20, 16)
    assert m.lookup_per_group(list(range(24)), peek=True) == (24, 24)
    m.check_invariants()
