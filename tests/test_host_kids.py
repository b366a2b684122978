"""``SlotIndex.forget_under`` through ``SlotKids`` (tiers/host_kids.py): the slots it drops
are those the pass over every slot map it replaces found (kept here as the oracle), on
random managers with a host tier; and it reads no map whole. block_size 4."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager, RequestError
from prefixkv.core.parent_notes import FLOOR
from prefixkv.tiers.host_kids import SlotKids

BS = 4


def map_pass(tier, lost):
    """The slots the old ``forget_under`` dropped: every map entry under a lost content."""
    return {s for home in (tier.by_chunk, tier.by_key) for s in home.values()
            if s.parent_cid in lost}


def watched(m, dropped):
    """``m``'s tier's ``forget_under`` checked against ``map_pass`` at each call; the
    slots it drops appended to ``dropped``."""
    tier = m._host
    real = tier.forget_under

    def forget_under(lost):
        want = map_pass(tier, lost)
        got = real(lost)
        assert len(got) == len(set(got)) and set(got) == want
        dropped.extend(got)
        return got
    tier.forget_under = forget_under


def prompt(rng):
    """Blocks over few tokens, most under one first block: prompts share prefixes, and a
    request holds a first block on the device while another's later ones go to the host."""
    return [t for x in [1, *rng.choices((1, 2, 3), k=rng.randint(1, 4))] for t in [x] * BS] + [9]


@settings(max_examples=40, deadline=None)
@given(st.randoms(use_true_random=False))
def test_forget_under_drops_what_the_pass_over_the_maps_found(rng):
    m = KVCacheManager(8, BS, seed=0, host_blocks=12, enable_events=True)
    watched(m, [])
    live: list[int] = []
    for i in range(120):
        op = rng.choices(("add", "free", "step", "uncache", "rewind"), (4, 3, 3, 1, 1))[0]
        if op == "free" or len(live) > 3:
            if live:
                m.free(live.pop(rng.randrange(len(live))))
        elif op == "add":
            if m.add_request(i, prompt(rng)) is not None:
                live.append(i)
        elif op == "step":
            m.take_kv_ops()
            m.take_events()
        elif live:
            r = rng.choice(live)
            ids = m.get_block_ids(r)
            if op == "uncache":
                m.uncache_blocks([rng.choice(ids)])
            else:
                try:
                    m.rewind(r, 0)
                except RequestError:  # (a block another request holds: refused)
                    pass
        m.check_invariants()


def test_a_forget_reads_no_map_whole():
    # many slots cached under contents the device keeps; forgetting one content drops
    # its slot alone, looking at no other (the old pass read every map entry)
    m = KVCacheManager(4, BS, seed=0, host_blocks=64)
    for i in range(40):  # 40 prompts of 2 blocks under one shared first block
        m.add_request(i, [1] * BS + [100 + i] * BS + [9])
        m.take_kv_ops()
        m.free(i)
    m.take_kv_ops()
    tier = m._host
    assert len(tier) > 20

    class Watched(dict):
        def values(self):
            raise AssertionError("a pass over the map")

        def items(self):
            raise AssertionError("a pass over the map")

    parent = next(iter(tier.by_chunk.values())).parent_cid or next(
        s.parent_cid for s in tier.by_chunk.values() if s.parent_cid)
    want = map_pass(tier, {parent})
    tier.by_chunk, tier.by_key = Watched(tier.by_chunk), Watched(tier.by_key)
    got = tier.forget_under({parent})
    tier.by_chunk, tier.by_key = dict(tier.by_chunk), dict(tier.by_key)
    assert want and set(got) == want


def test_stale_notes_are_swept_once_they_outgrow_the_live_ones():
    # a slot keyed, dropped and keyed again under the same parent is noted each time; the
    # notes stay within twice the live ones (and FLOOR)
    m = KVCacheManager(4, BS, seed=0, host_blocks=4)
    for i in range(3 * FLOOR):
        m.add_request(i, [1] * BS + [100 + i] * BS + [9])
        m.take_kv_ops()
        m.free(i)
    m.take_kv_ops()
    kids: SlotKids = m._host.kids
    assert kids.noted <= max(FLOOR, 2 * len(m._host)) + 1
    m.check_invariants()
