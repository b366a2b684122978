"""prefixkv's vLLM plug-in beside vLLM 0.33's own ``KVCacheManager``: the Mamba states
offered to a KV connector (``take_boundary_state_offloads``, and a finished request's
partial tails, ``finalize_partial_tail_offloads``; integrations/vllm/offloads.py).

test_vllm_mamba_sizes.py's random streams (``Sides``: every answer, table, free count,
hit and copy on write compared after each step) on Mamba layouts of one block size, of
other sizes, with vLLM's fine-grained partial hits, with chunk-end checkpoint blocks and
with a retention interval; after each step, or every second or third (so that a request
freed before the drain takes its offers with it), both drain their offers and give the
same ``{request id: [(group, block id, boundary), ...]}``, in the same order, each offered
block with the same ``ref_cnt`` on both (an offer holds nothing); a request freed is
first finalized on both (when ``a`` is even, sometimes with a token in flight), with the
same answer; prefixkv's
``check_invariants`` after each step, and after a drain no tail of a request that left.
Needs vllm installed."""

from __future__ import annotations

import math
import os
from functools import reduce
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import MAMBA_LAYOUTS, _request  # noqa: E402
from .test_vllm_mamba_checkpoint_plugin import CheckpointSides  # noqa: E402
from .test_vllm_mamba_retention import RetentionSides  # noqa: E402
from .test_vllm_mamba_sizes import OP, Sides  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PARTIAL, PROMPT  # noqa: E402

ONE_SIZE = {  # (every group at the hash block's size: the one-size manager's calls)
    "full8+mamba8": ((8, None), (8, "mamba")),
    "full8+mamba8x3": ((8, None), (8, "mamba"), (8, "mamba"), (8, "mamba")),
}


class Offers:
    """The offer checks on ``sides`` (module docstring): drained every ``every`` steps."""

    def __init__(self, sides: Any, every: int) -> None:
        self.sides, self.every, self.steps = sides, every, 0
        self.offers = self.inside = self.finalized = 0  # (offers; of a state inside a block; tails)

    def before(self, op: str, a: int) -> None:
        """A request about to be freed is finalized first, when ``a`` is even (with a
        token in flight when ``a`` is 2 or 4: none handed off)."""
        live = sorted(self.sides.reqs[0])
        if op == "free" and live and a % 2 == 0:
            rid = live[a % len(live)]
            got = []
            for m, reqs in zip(self.sides.ms, self.sides.reqs, strict=True):
                reqs[rid].num_in_flight_tokens = int(a > 0)
                got.append(m.finalize_partial_tail_offloads(reqs[rid]))
            assert got[0] == got[1], got
            self.finalized += len(got[0])

    def after(self) -> None:
        ms = self.sides.ms
        ms[1].core.check_invariants()
        self.steps += 1
        if self.steps % self.every == 0:
            got = [m.take_boundary_state_offloads() for m in ms]
            assert list(got[0].items()) == list(got[1].items()), got
            for offers in got[0].values():
                self.offers += len(offers)
                sizes = [ms[0].coordinator.single_type_managers[g].block_size for g, _, _ in offers]
                self.inside += sum(n % b != 0 for (_, _, n), b in zip(offers, sizes, strict=True))
                for _, i, _ in offers:
                    assert ms[0].block_pool.blocks[i].ref_cnt == ms[1].block_pool.blocks[i].ref_cnt
            keys = ms[1]._keys  # (no partial tail of a request gone is kept past a drain)
            assert all(keys.get(rid) == k for k, (rid, _) in ms[1]._mamba.offers._tails.items())


def run(sides: Any, ops: Any, probe: list[int], every: int) -> Offers:
    """``ops`` on ``sides`` with the offer checks, up to prefixkv's first spare (as
    test_vllm_mamba_sizes.py's ``Sides.drive``)."""
    check = Offers(sides, every)
    for op, a, b in ops:
        check.before(op, a)
        sides.do(op, a, b)
        sides.compare(probe)
        check.after()
        if any(sides.ms[1].core._index.twins):
            break
    return check


def _small(groups: Any) -> int:
    return sum(-(-MAX_LEN // b) for b, _ in groups) + 4


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(ONE_SIZE) + list(MAMBA_LAYOUTS) + [f"partial: {k}" for k in PARTIAL])
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT, every=st.integers(1, 3))
def test_the_plugin_offers_vllms_boundary_states(layout, small, ops, probe, every):
    # (small: a pool a little over one longest request: refusals and evictions)
    partial = layout.startswith("partial: ")
    groups = {**ONE_SIZE, **MAMBA_LAYOUTS}.get(layout) or PARTIAL[layout[len("partial: "):]]
    run(Sides(groups, _small(groups) if small else 400, partial=partial), ops, probe, every)


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(PARTIAL))
@pytest.mark.parametrize("retention", [None, 0, 2])
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT, scale=st.sampled_from([1, 2]),
       every=st.integers(1, 3))
def test_the_plugin_offers_vllms_checkpoints(layout, retention, small, ops, probe, scale, every):
    # chunk-end checkpoint blocks (aligned to the hash block or two), with vLLM's
    # prefix_cache_retention_interval None, 0 or 2 scheduler blocks
    groups = PARTIAL[layout]
    h, lcm = reduce(math.gcd, (b for b, _ in groups)), reduce(math.lcm, (b for b, _ in groups))
    sides = CheckpointSides(groups, _small(groups) if small else 400, scale * h,
                            retention=None if retention is None else retention * lcm)
    run(sides, ops, probe, every)


@pytest.mark.parametrize("layout", list(MAMBA_LAYOUTS) + [f"partial: {k}" for k in PARTIAL])
@pytest.mark.parametrize("segments", [0, 2])
@settings(max_examples=20, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT, every=st.integers(1, 3))
def test_the_plugin_offers_vllms_retained_states(layout, segments, ops, probe, every):
    # (a retention interval of 0 or 2 scheduler blocks: sparse states, offered as kept)
    partial = layout.startswith("partial: ")
    groups = MAMBA_LAYOUTS.get(layout) or PARTIAL[layout[len("partial: "):]]
    run(RetentionSides(groups, 400, partial, segments * reduce(math.lcm, (b for b, _ in groups))), ops,
        probe, every)


def test_a_partial_tail_and_its_copy_are_offered_as_in_vllm():
    # full attention at 8 beside Mamba at 16 (hash 8; vLLM's partial hits): a's 30
    # tokens in chunks of 16, 8 (to its prompt's last hash boundary, 24, inside Mamba
    # block 1: a partial tail in block 5) and 6: the state at 16 (block 3) is offered,
    # then nothing, then the copy the tail moved to (7), at 24; nothing left to finalize.
    # c's state at 32 is not offered: c left before the drain; d's, cached in the same
    # step, is.
    from .test_vllm_block_sizes_reference import _plugin, _vllm

    groups = ((8, None), (16, "mamba"))
    for m in (_vllm(groups, 8, 16, 40), _plugin(groups, 8, 16, 40)):
        a, got = _request("a", list(range(30)), 8), []
        for n in (16, 8, 6):
            m.new_step_starts()
            assert m.allocate_slots(a, n) is not None
            a.num_computed_tokens += n
            copies, held = m.take_kv_cache_block_copies()
            got.append((m.get_block_ids("a"), m.take_boundary_state_offloads(),
                        [(c.src_block_id, c.dst_block_id) for c in copies]))
            m.block_pool.free_blocks(held)
        assert got == [(([1, 2], [3]), {"a": [(1, 3, 16)]}, []),
                       (([1, 2, 4], [3, 5]), {}, []),
                       (([1, 2, 4, 6], [0, 5]), {"a": [(1, 7, 24)]}, [(5, 7)])], m
        assert m.finalize_partial_tail_offloads(a) == []
        m.new_step_starts()
        c, d = _request("c", [6] * 40, 8), _request("d", [7] * 40, 8)
        assert m.allocate_slots(c, 32) is not None and m.allocate_slots(d, 16) is not None
        m.free(c)
        assert m.take_boundary_state_offloads() == {"d": [(1, 15, 16)]}
        assert m.take_boundary_state_offloads() == {}


@pytest.mark.parametrize("computed,in_flight,offered", [(24, 0, True), (25, 0, False), (24, 1, False)])
def test_a_finished_partial_tail_is_handed_off_once_as_in_vllm(computed, in_flight, offered):
    # b stops at its tail (24 of 30) and finishes: its table's block 4 holds the state
    # at 24 only while no later token was computed nor is in flight; asked again, none
    from .test_vllm_block_sizes_reference import _plugin, _vllm

    groups = ((8, None), (16, "mamba"))
    for m in (_vllm(groups, 8, 16, 40), _plugin(groups, 8, 16, 40)):
        b = _request("b", [5] * 30, 8)
        assert m.allocate_slots(b, 24) is not None
        assert m.get_block_ids("b") == ([1, 2, 3], [0, 4])
        b.num_computed_tokens, b.num_in_flight_tokens = computed, in_flight
        assert m.finalize_partial_tail_offloads(b) == ([(1, 4, 24)] if offered else []), m
        assert m.finalize_partial_tail_offloads(b) == []
        assert m.take_boundary_state_offloads() == {}


def test_a_held_row_of_req_to_blocks_follows_the_table_as_vllms():
    # (vLLM's tests hold coordinator.single_type_managers[g].req_to_blocks[rid] and read
    # it after later steps: the Mamba row of full8+mamba16 grows, and turns the state
    # two steps old null, in place; once the request is freed the row keeps what it
    # showed)
    from .test_vllm_block_sizes_reference import _plugin, _vllm

    groups = ((8, None), (16, "mamba"))
    got = []
    for m in (_vllm(groups, 8, 16, 40), _plugin(groups, 8, 16, 40)):
        a = _request("a", list(range(60)), 8)
        assert m.allocate_slots(a, 16) is not None
        a.num_computed_tokens = 16
        row = m.coordinator.single_type_managers[1].req_to_blocks["a"]
        seen = [[b.block_id for b in row]]
        for _ in range(2):
            m.new_step_starts()
            assert m.allocate_slots(a, 16) is not None
            a.num_computed_tokens += 16
            seen.append([b.block_id for b in row])
        assert row[-1].block_id == seen[-1][-1] and len(row) == 3 and row == list(row)
        m.free(a)
        seen.append([b.block_id for b in row])
        got.append(seen)
    assert got[0] == got[1] == [[3], [3, 6], [0, 6, 9], [0, 6, 9]]
