"""Events of blocks a store fetch landed in host slots: every ``BlockRemoved`` withdraws
a hash that an earlier ``BlockStored`` of the same medium announced (a router's index
stays exact), whatever takes the slots later: offloads, other fetches, re-admissions,
preemptions; and no event names a block without its hash."""

import random

import pytest

from prefixkv import AllBlocksCleared, BlockRemoved, BlockStored

from .test_shared_store import admit, computed, manager


class Mirror:
    """A router's view of one replica: per medium, how many announcements each hash has."""

    def __init__(self):
        self.held: dict[tuple[str, bytes], int] = {}

    def apply(self, events):
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.held.clear()
                continue
            for h in ev.block_hashes:
                assert isinstance(h, bytes) and h, ev
                key = (ev.medium, h)
                if isinstance(ev, BlockStored):
                    self.held[key] = self.held.get(key, 0) + 1
                    continue
                assert isinstance(ev, BlockRemoved)
                assert self.held.get(key, 0) > 0, f"{key} withdrawn, never announced"
                self.held[key] -= 1
                if not self.held[key]:
                    del self.held[key]


@pytest.mark.parametrize("seed", range(12))
def test_landed_slots_withdraw_what_they_announced(backend, shared, seed):
    rng = random.Random(seed)
    base = [rng.randrange(1, 9) for _ in range(8)]           # a prefix some prompts share
    prompts = [base[:rng.choice([0, 4, 8])] + [rng.randrange(1, 30)
                                               for _ in range(rng.randrange(5, 21))]
               for _ in range(8)]
    m1 = manager(shared, num_blocks=64, host_blocks=8)
    for i, p in enumerate(prompts[:5]):                      # the store holds five of them
        computed(m1, backend, ("w", i), p)
    m2 = manager(shared, num_blocks=rng.choice([8, 10, 12]),
                 host_blocks=rng.choice([2, 3, 4, 6]), enable_events=True)
    mirror, live, on_host = Mirror(), [], 0
    for step in range(60):
        if live and rng.random() < 0.5:                      # finished or preempted
            m2.free(live.pop(rng.randrange(len(live))))
        else:
            rid = ("r", step)
            adm = admit(m2, rid, prompts[rng.randrange(len(prompts))])
            if adm is not None:
                live.append(rid)
            elif live:
                m2.free(live.pop(0))
        m2.take_kv_ops()
        events = m2.take_events()
        on_host += sum(len(e.block_hashes) for e in events
                      if isinstance(e, BlockStored) and e.medium == "CPU")
        mirror.apply(events)
        m2.check_invariants()
    assert on_host > 0
