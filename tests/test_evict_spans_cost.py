"""Evicting a pending run (a miss's blocks, recorded as one run, not keyed one by one)
costs the index's ``drop`` the same instructions whatever the run's length: it skips the
run's blocks by their spans (``Keyless``). pressure-r18 noted the spans only with a tier
below and let ``drop`` test each block's missing key: a 2048-block eviction then ran
42,980 instructions more (twice the admission's). (With a tier below a miss is keyed
block by block, not recorded as a run; its pending runs are a store's landed runs, whose
eviction is the start of a store hit: 2,646 -> 45,598 instructions at 2048 blocks then,
``bench_store.py --only ops``.) Counted, not timed (prefixkv.bench.opcodes)."""

from __future__ import annotations

from collections import Counter

import pytest

from prefixkv import KVCacheManager
from prefixkv.bench.opcodes import count_opcodes

BS = 4
DROP = "prefixkv/index/dropping.py:DroppingIndex.drop"


def _drop_cost(n_blocks: int, events: bool) -> int:
    """``drop``'s own instructions when a miss of ``n_blocks`` evicts the one before it."""
    m = KVCacheManager(n_blocks + 1, BS, enable_events=events)
    m.add_request("a", list(range(n_blocks * BS)))
    m.free("a")
    if events:
        m.take_events()
    own: Counter[str] = Counter()
    other = list(range(10**6, 10**6 + n_blocks * BS))
    count_opcodes(lambda: m.add_request("b", other), own)
    m.check_invariants()
    assert own[DROP] > 0  # (it ran: the first run went)
    return own[DROP]


@pytest.mark.parametrize("events", [False, True], ids=["events-off", "events-on"])
def test_evicting_a_pending_run_costs_drop_the_same_whatever_its_length(events):
    assert _drop_cost(512, events) == _drop_cost(32, events)
