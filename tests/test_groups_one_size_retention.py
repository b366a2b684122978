"""A window's ``retention`` (vLLM's ``prefix_cache_retention_interval``) with every group
at ONE block size (a pure sliding-window model; full attention beside windows of the
same size): prefixkv's hybrid manager then serves it with the sized manager's calls
(groups/sized.py, at sizes that are all equal), held by test_groups_sizes_machine.py's
rules to tests/sized_model.py's reference (itself checked against vLLM's manager at one
size: tests/engines/test_vllm_one_size_retention.py): the same block ids, free queue
(vLLM's plain order), hits, refusals and ``BlockStored`` keys after every call, and
``check_invariants()``. Plus the scenario of vLLM's pure-SWA tests and what stays refused."""

import pytest

from machine_rules import case
from prefixkv import ConfigError
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window
from prefixkv.groups.sized import SizedHybridKVCacheManager
from test_groups_sizes_machine import PREFIXES, SizedMachine


class OneSizeRetention(SizedMachine):
    """The junction where a layout has no full-attention group (a pure-SWA model): its
    first group is the window, whose own hit is the hit: none (vLLM's, the reference's)."""

    def _junction(self, prompt, extra, end):
        if any(w is None for _, w in self.groups):
            return super()._junction(prompt, extra, end)
        assert self.model.junction(prompt, extra, end) == 0, prompt
        return 0


class PureWindowMachine(OneSizeRetention):
    """One 12-token window at 8, its tails cached every 32 tokens (2 blocks of 4) and at the marks."""

    groups = ((8, 12),)
    extra_blocks = 3
    retention = 32


class PureWindowLatestMachine(OneSizeRetention):
    """One 8-token window at 8, retention 0: the marks' tails only."""

    groups = ((8, 8),)
    extra_blocks = 2
    retention = 0


class FullBesideWindowMachine(OneSizeRetention):
    """Full attention at 4 beside a 6-token window at 4, retention 0 (the junction's tail)."""

    groups = ((4, None), (4, 6))
    extra_blocks = 4
    retention = 0


class FullBesideWindowsMachine(OneSizeRetention):
    """A 5-token window, full attention and a 13-token window, all at 4, retention 8."""

    groups = ((4, 5), (4, None), (4, 13))
    extra_blocks = 5
    retention = 8


TestPureWindowMachine = case(PureWindowMachine, max_examples=60, stateful_step_count=40)
TestPureWindowLatestMachine = case(PureWindowLatestMachine, max_examples=60, stateful_step_count=40)
TestFullBesideWindowMachine = case(FullBesideWindowMachine, max_examples=60, stateful_step_count=40)
TestFullBesideWindowsMachine = case(FullBesideWindowsMachine, max_examples=60, stateful_step_count=40)


def _prompt_of_16_blocks():
    return [i for i in range(16) for _ in range(16)]


@pytest.mark.parametrize(("retention", "want"), [(64, {3, 7, 11, 14, 15}), (0, {14}), (None, set(range(16)))])
def test_a_pure_window_caches_the_tails_vllm_caches(retention, want):
    """vLLM's test_pure_swa_retention_*: a 16-token window at 16, a prompt of 16 blocks:
    64 caches the segments' tails and the replay boundary's (240), 0 that one only,
    None every block; a replay hits 240 in each case."""
    m = HybridKVCacheManager([sliding_window(16, retention=retention)], 40, 16)
    prompt = _prompt_of_16_blocks()
    adm = m.add_request("a", prompt, num_new_tokens=len(prompt))
    assert adm is not None
    assert isinstance(m, SizedHybridKVCacheManager) == (retention is not None)
    assert {j for j in range(16) if m.cached_block_ids(prompt, (j + 1) * 16)[0] is not None} == want
    assert m.lookup(prompt) == 240
    m.check_invariants()


def test_a_window_beside_full_attention_keeps_the_junctions_tail():
    """vLLM's test_swa_shared_prefix_reuse_under_zero_retention[False]: full attention
    and a 16-token window at 16, retention 0; the second request's junction (64, the
    shared prefix full attention alone hits) keeps the window's tail there, so a third
    request sharing the prefix hits 64; without the junction it hits nothing."""
    for junction, want in ((64, 64), (0, 0)):
        m = HybridKVCacheManager([full_attention(), sliding_window(16, retention=0)], 60, 16)
        shared = [7] * 64
        for rid, v in (("0", 50), ("1", 60)):
            prompt = shared + [v] * 64
            assert m.lookup(prompt) == 0
            assert m.lookup_per_group(prompt)[0] == (64 if rid == "1" else 0)
            m.add_request(rid, prompt, num_new_tokens=len(prompt), junction=junction if rid == "1" else 0)
        assert m.lookup(shared + [70] * 64) == want
        m.check_invariants()


def test_a_retention_beside_an_uncached_window_or_in_a_subclass_is_refused():
    with pytest.raises(ConfigError, match="uncached"):
        HybridKVCacheManager([full_attention(), sliding_window(8, retention=0),
                              sliding_window(8, cached=False)], 20, 8)

    class Sub(HybridKVCacheManager):
        pass

    with pytest.raises(ConfigError, match="retention"):
        Sub([full_attention(), sliding_window(8, retention=0)], 20, 8)
    Sub([full_attention(), sliding_window(8)], 20, 8)  # (no retention: the one-size manager)


def test_fork_and_uncache_blocks_beside_a_retention_are_refused_before_any_change():
    """At one size with a window's retention the sized calls serve the manager: ``fork``
    and ``uncache_blocks`` raise ConfigError (not served there), changing nothing."""
    m = HybridKVCacheManager([full_attention(), sliding_window(8, retention=16)], 30, 8)
    adm = m.add_request("a", list(range(40)), num_new_tokens=40)
    assert adm is not None
    free, ids = m.num_free_blocks, m.get_block_ids("a")
    with pytest.raises(ConfigError, match="fork"):
        m.fork("a", "b")
    with pytest.raises(ConfigError, match="uncache_blocks"):
        m.uncache_blocks([adm.group_block_ids[0][0]])
    assert m.num_free_blocks == free and m.get_block_ids("a") == ids
    assert m.lookup(list(range(40)) + [1]) == 32  # (the tails at 16 and 32: segments and replay mark)
    m.check_invariants()


def _steps(machine, steps):
    """Run ``steps`` (rule name, keyword arguments; a ``("live", k)`` value names the k-th
    request added) on a fresh ``machine`` with its invariants after each, as Hypothesis
    runs a found example."""
    state = machine()
    state.setup()
    live = []
    for name, kw in steps:
        kw = {k: live[v[1]] if isinstance(v, tuple) and v[:1] == ("live",) else v for k, v in kw.items()}
        got = getattr(state, name)(**kw)
        if name.startswith("add"):
            live.append(got)
        state.consistent()
        state.same_events()
        state.same_hits()
        state.same_tables_and_free_queue()
    state.teardown()


P = PREFIXES[0]


@pytest.mark.parametrize(("machine", "steps"), [
    (PureWindowMachine, [  # a rewind into a hit block shared with a live request
        ("reset", {}),
        ("add", dict(chunk=None, extra=None, prompt=P[:9])),
        ("add", dict(chunk=1, extra=None, prompt=P[:24] + [0])),
        ("add_sibling", dict(chunk=None, more=[0], rid=("live", 0))),
        ("rewind", dict(back=2, cuts=[], other=None, rid=("live", 1))),
        ("rewind", dict(back=2, cuts=[], other=None, rid=("live", 2)))]),
    (PureWindowLatestMachine, [  # ... whose other holder then goes
        ("add", dict(chunk=None, extra=None, prompt=P[:9])),
        ("add", dict(chunk=None, extra=None, prompt=P[:16] + [0])),
        ("add_sibling", dict(chunk=None, more=[0], rid=("live", 1))),
        ("rewind", dict(back=2, cuts=[], other=[], rid=("live", 0))),
        ("free", dict(rid=("live", 1))),
        ("add_sibling", dict(chunk=1, more=[0], rid=("live", 2))),
        ("rewind", dict(back=2, cuts=[], other=None, rid=("live", 3))),
        ("add", dict(chunk=None, extra=None, prompt=[0])),
        ("rewind", dict(back=1, cuts=[], other=None, rid=("live", 0))),
        ("free", dict(rid=("live", 0)))]),
], ids=["shared", "shared-then-freed"])
def test_a_rewind_into_a_hit_keeps_the_content_other_requests_recorded(machine, steps):
    """Found by the machines above (session 28): after a rewind into a block of its hit
    that another request shares (pinned: the recompute gives the same tokens), the block
    keeps the content that request's count recorded, also once that request goes;
    ``check_invariants`` called it content this request's count does not record (its hit,
    where such content is allowed, now ends below the block). Tables, free queue, events
    and hits agree with the reference throughout."""
    _steps(machine, steps)


class FullBesideWindow12Machine(OneSizeRetention):
    """Full attention and a 12-token window at 8, retention 24 (the scenario below)."""

    groups = ((8, None), (8, 12))
    extra_blocks = 4
    retention = 24


def test_a_rewind_forgets_a_window_block_only_another_requests_mark_cached():
    """tests/engines/test_vllm_one_size_retention.py's scenario (found there, session
    28) on prefixkv's manager, held to the reference: a (9 tokens) caches its window
    block 0 as its replay boundary's tail; b (25 tokens) hits it, then rewinds to 7 and
    gives its tokens again. prefixkv forgets the block's content at the rewind, as the
    reference does (vLLM's recompute keeps it: by design, the reference then says it
    diverged), and does not cache it again: b's marks (24) and segment tails (blocks
    1, 2) do not reach it; full attention caches its block 0 again."""
    state = FullBesideWindow12Machine()
    state.setup()
    a = state.add(P[:9], None, None)

    def check():
        state.consistent()
        state.same_events()
        state.same_hits()
        state.same_tables_and_free_queue()
        return list(state.m.lookup_per_group(P[:8] + [0]))

    assert check() == [8, 8]
    state.free(a)
    b = state.add(P[:23] + [0, 0], None, None)
    assert state.model.reqs[b].tables == [[1, 4, 2, 5], [3, 6, 7, 8]] and check() == [8, 8]
    state.rewind(b, back=18, cuts=[], other=None)
    assert state.model.diverged and check() == [8, 0]  # (the window's block 0, id 3, forgotten)
    assert state.model.reqs[b].tables == [[1, 4, 2, 5], [3, 6, 7, 8]]
    state.teardown()
