"""``rewind`` on the hybrid manager over groups of different block sizes, worked by hand
(docs/groups.md, "Rewind"): each case runs tests/test_groups_sizes_machine.py's rules on
prefixkv's manager beside tests/sized_model.py's reference (same block ids, free queue,
hits and events after every call), then states what the case is about."""

import pytest

from prefixkv import ConfigError, ExtraKeys, RequestError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba, sliding_window
from test_groups_sizes_machine import PREFIXES, EagleWindowMachine, FullOnlyMachine, SizedMachine

STEM = [1 + k % 7 for k in range(48)]


def _machine(groups):
    machine = type("Case", (SizedMachine,), {"groups": groups, "extra_blocks": 4})()
    machine.setup()
    return machine


def _checked(machine):
    machine.consistent()
    machine.same_tables_and_free_queue()
    machine.same_events()
    machine.same_hits()


def _add(machine, prompt):
    rid = machine.add(prompt, None, None)
    _checked(machine)
    return rid


def test_a_whole_prompt_loaded_recomputes_its_last_token():
    # vLLM's test_two_groups_different_block_sizes: full attention at 12 and at 16 (hash
    # 4, lcm 48). A prompt of 48 is loaded whole; vLLM recomputes its last token. Both
    # groups' last blocks lose their content (3 at 12, 2 at 16), are not found until the
    # recompute records them again, in the same blocks (vLLM's tables).
    machine = _machine(((12, None), (16, None)))
    m = machine.m
    a = _add(machine, STEM)
    before = m.get_block_ids(a)
    assert m.lookup(STEM + [0]) == 48
    m.take_events()
    machine.model.events.clear()
    machine.rewind(a, 1, [])
    _checked(machine)
    assert m.get_block_ids(a) == before
    assert m.lookup(STEM + [0]) == 48  # (the recompute recorded them again)
    # the same, stopped between the rewind and the recompute
    m.rewind(a, 47)
    assert m.lookup(STEM + [0]) == 0 and m.get_block_ids(a) == before
    assert m.append_tokens(a, STEM[47:]) == ((), ())
    assert m.lookup(STEM + [0]) == 48
    m.check_invariants()


def test_a_shared_block_loses_its_content_and_cuts_the_sharer():
    # Full attention at 4 and at 8 (hash 4, lcm 8). a caches STEM[:16]; c (a prompt of
    # 16: a hit of 8) recomputes hash blocks 2 and 3, spares of a's; b hits a's 16. a
    # rewinds to 8: its blocks past it hand their prefixes to c's spares and hold
    # nothing, b's too (b shares them), so b's next step passing a hash boundary right
    # after one makes b's prefix ids from there lost: nothing b computes is found.
    machine = _machine(((4, None), (8, None)))
    m, model = machine.m, machine.model
    a = _add(machine, STEM[:16] + [0])
    c = _add(machine, STEM[:16])
    b = _add(machine, STEM[:16] + [5])
    ta = m.get_block_ids(a)
    assert m.get_block_ids(b)[0][:4] == ta[0][:4] and model.spares
    gone = model.reqs[a].tokens[8:]
    m.rewind(a, 8)
    assert model.rewind(a, 8)
    machine.tokens[a] = machine.tokens[a][:8]
    _checked(machine)
    assert model.reqs[b].lost is None and m.get_block_ids(a) == ta
    machine.append(b, [1, 2, 3, 4, 5, 6, 7])  # (b: 17 -> 24, before a's recompute)
    _checked(machine)
    assert model.reqs[b].lost == 4
    assert m.lookup(STEM[:16] + [5, 1, 2, 3, 4, 5, 6, 7, 0]) == 16
    assert m.append_tokens(a, gone) is not None and model.grow(a, len(gone), gone)
    machine.tokens[a] += gone
    _checked(machine)
    assert m.get_block_ids(a) == ta and list(m.get_block_ids(c)[0][2:4]) == [model.holders[k][0] for k in (
        (0, None, tuple(STEM[:12])), (0, None, tuple(STEM[:16])))]


def test_a_rewind_forgets_longer_prefixes_and_empties_their_free_blocks():
    # Full attention at 4 and at 12 (hash 4, lcm 12). a caches STEM[:24] and goes; b
    # (a prompt of 13) hits a's first 12, in blocks no other request holds now. b
    # rewinds to 0: the prefixes of its blocks are forgotten with every longer one, so
    # a's free blocks holding STEM[:16] .. STEM[:24] (hash blocks 3..5 at 4, block 1 at
    # 12) hold nothing any more: they go to the queue's head (by group, then block id,
    # the last first), and no request finds them; b's recompute caches its 12 again.
    machine = _machine(((4, None), (12, None)))
    m, model = machine.m, machine.model
    a = _add(machine, STEM[:24] + [0])
    ta = m.get_block_ids(a)
    machine.free(a)
    _checked(machine)
    b = _add(machine, STEM[:13])
    assert m.lookup(STEM[:24] + [0]) == 24
    gone = model.reqs[b].tokens[:]
    m.rewind(b, 0)
    assert model.rewind(b, 0)
    machine.tokens[b] = []
    _checked(machine)
    assert m.free_block_order()[:4] == [ta[1][1], ta[0][5], ta[0][4], ta[0][3]]
    assert m.lookup(STEM[:24] + [0]) == 0
    assert m.append_tokens(b, gone) is not None and model.grow(b, len(gone), gone)
    machine.tokens[b] = gone
    _checked(machine)
    assert m.lookup(STEM[:24] + [0]) == 12


def test_tokens_unlike_the_forgotten_ones_at_a_shared_block_are_refused():
    # pins at each group's own size: a's blocks 2..3 at 4 and 1 at 8 are b's hit too; a
    # rewound to 8 must give the same tokens up to 16 (the end of the last block b holds)
    machine = _machine(((4, None), (8, None)))
    m = machine.m
    a = _add(machine, STEM[:16] + [0])
    _add(machine, STEM[:16] + [5])
    m.rewind(a, 8)
    before = (m.get_block_ids(a), m.free_block_order())
    with pytest.raises(RequestError, match="block 3 of group 0"):
        m.append_tokens(a, STEM[8:12] + [0])
    assert (m.get_block_ids(a), m.free_block_order()) == before
    m.append_tokens(a, STEM[8:16])
    m.append_tokens(a, [3])  # (past the pinned tokens: anything)
    m.check_invariants()


def test_what_a_rewind_with_sizes_does_not_serve_is_refused_before_any_change():
    sizes = BlockSizes.of([4, 8])
    ours = HybridKVCacheManager([full_attention(), mamba()], 40, sizes)
    ours.add_request("a", STEM[:20])
    before = (ours.get_block_ids("a"), ours.free_block_order(), ours.num_scheduled_tokens("a"))
    with pytest.raises(ConfigError, match="Mamba"):
        ours.rewind("a", 16)
    assert (ours.get_block_ids("a"), ours.free_block_order(), ours.num_scheduled_tokens("a")) == before
    # a window of 6 at 8 released blocks 0 and 1 (a query at 24 reads from 19); a query
    # at 4 reads block 0, one at 20 block 1 (from 15), one at 23 only block 2 (from 18)
    ours = HybridKVCacheManager([full_attention(), sliding_window(6)], 40, sizes)
    ours.add_request("a", STEM[:24], extra=ExtraKeys(cache_salt="s"))
    assert ours.append_tokens("a", [1]) is not None
    before = (ours.get_block_ids("a"), ours.free_block_order(), ours.num_scheduled_tokens("a"))
    assert ours.get_block_ids("a")[1][0] == ours.null_block_id
    for p in (4, 20):
        with pytest.raises(ConfigError, match="window released"):
            ours.rewind("a", p)
        assert (ours.get_block_ids("a"), ours.free_block_order(), ours.num_scheduled_tokens("a")) == before
    ours.rewind("a", 23)
    with pytest.raises(RequestError):
        ours.rewind("a", 24)  # (past the scheduled tokens)
    with pytest.raises(RequestError):
        ours.rewind("b", 0)
    ours.check_invariants()


def test_full_only_rewinds_run_beside_the_reference():
    machine = FullOnlyMachine()
    machine.setup()
    a = _add(machine, STEM[:30])
    b = _add(machine, STEM[:30])  # (a hit of 24: a's blocks held by both)
    machine.rewind(a, 10, [2, 5])
    _checked(machine)
    machine.rewind(b, 30, [])
    _checked(machine)


def _rewound(machine, rid, p):
    """``rid`` rewound to ``p`` on both, nothing given again yet (the engine stopped
    between the rewind and the recompute); the tokens it forgot."""
    gone = machine.model.reqs[rid].tokens[p:]
    machine.m.rewind(rid, p)
    assert machine.model.rewind(rid, p)
    machine.tokens[rid] = machine.tokens[rid][:p]
    _checked(machine)
    return gone


def test_a_second_rewind_empties_what_a_sharer_recorded_again_past_its_prefix_ids():
    # Full attention at 4 and at 12 (hash 4, lcm 12). c hits a's 24 and is rewound to 0
    # before its recompute: the shared blocks lose their content, c keys none of them.
    # a rewinds and records them again (its own KV, the same tokens: pins), then goes.
    # c, rewound to 0 again, writes other tokens there: those blocks hold a's prefixes
    # past c's own prefix ids, and lose them too (the manager kept them found: a hit of
    # 24 on KV computed for c's tokens; seen first in TestEagleWindowMachine as a free
    # queue, a hit and events unlike the reference's).
    machine = _machine(((4, None), (12, None)))
    m = machine.m
    a = _add(machine, STEM[:24] + [0])
    c = _add(machine, STEM[:24] + [5])
    assert m.get_block_ids(c)[1][:2] == m.get_block_ids(a)[1][:2]
    _rewound(machine, c, 0)
    gone = _rewound(machine, a, 0)
    machine.append(a, gone)
    _checked(machine)
    assert m.lookup(STEM[:24] + [0]) == 24
    machine.free(a)
    _checked(machine)
    _rewound(machine, c, 0)
    assert m.lookup(STEM[:24] + [0]) == 0
    machine.append(c, [9] * 25)
    _checked(machine)
    assert m.lookup(STEM[:24] + [0]) == 0


def test_the_sizes_machine_gives_back_the_scheduled_tokens_before_the_prompts_rest():
    # TestEagleWindowMachine's example: r3 (a prompt of 41, 17 scheduled: a hit of 16)
    # is rewound to 15; block 1 of group 0 (tokens 8..15) is r2's too, so tokens 15 and
    # 16 are pinned. The rule gave them back with the prompt's unscheduled rest in one
    # step, which found no room; the request then took token 0 at 15 and the manager
    # refused it (RequestError, pins.py), as it must. The rule now gives the scheduled
    # tokens back first (the tables cover them), then the rest.
    machine = EagleWindowMachine()
    machine.setup()
    machine.add(PREFIXES[0][:11] + [0, 0], None, None)
    machine.add_known_prefix(0, 28, 0)
    r3 = machine.add(PREFIXES[1][:41], None, 1)
    assert machine.model.reqs[r3].computed == 17
    machine.rewind(r3, 2, [])
    _checked(machine)
    r = machine.model.reqs[r3]
    assert r.computed == len(r.tokens) >= 17  # (so the next step is taken)
    machine.append(r3, [0])
    assert r.tokens[-1] == 0
    _checked(machine)
