"""prefixkv's hybrid manager with groups of DIFFERENT block sizes
(``SizedHybridKVCacheManager``, groups/sized.py) against vLLM 0.33's own
``KVCacheManager`` (from the wheel), call for call: random prompts of shared stems are
admitted (vLLM: ``get_computed_blocks`` then ``allocate_slots``, with lookahead slots
or none) and prefilled in
chunks of a random size (one ``allocate_slots`` / ``extend`` a chunk), decoded a few
tokens (one ``allocate_slots`` a token), and freed or kept; after each call both give
the same hit, the same block ids in every group (the null block where a window
released one), the same number of free blocks and the same events (each announced or
withdrawn entry by group, kind, prefix and size; a partial tail entry, one hash block
of a full-attention group larger than the hash block, by its parent and tokens too:
vLLM's ``cache_partial_block``, groups/sized.py ``_tail``). Prompts are cut to a
multiple of the lcm at random (where partial tails are), and on a small pool every
request is freed, so entries are evicted and withdrawn (from the first spare freed on
vLLM evicts other blocks, so hits may differ: a stream with lookahead slots stops there;
one without goes on, prefixkv's manager held to the reference of its twin rule, the
test's own docstring). A spare is a
second block computing a prefix its group holds (a request recomputing the unaligned
tail of a hit): prefixkv announces it not, vLLM does, so the events are compared entry
by entry until the first spare, and from there by the whole-block entries each side
holds (vLLM announces a partial tail entry on a spare too, prefixkv not). Block
ids, free blocks, hits and held entries stay exact until a spare is freed: vLLM keeps
such a copy cached, prefixkv empties it (groups/index.py), so the free queues differ
from there on, at any block size; then the tables are compared by their null entries
and lengths.
The layouts are test_vllm_block_sizes_reference.py's, whose reference states the
rules. Needs vllm."""

from __future__ import annotations

import math
import os
from collections import Counter
from functools import reduce

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.groups import BlockSizes, HybridKVCacheManager

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
pytest.importorskip("torch")

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from sized_model import SizedModel  # noqa: E402
from twin_model import Written, held_prefixes, twin_events  # noqa: E402

from .test_vllm_block_sizes_reference import LAYOUTS, PROMPT, _request, _vllm, group_specs  # noqa: E402

POOLS = (400, 48)  # (_vllm's pool, its null block 0 included)


def ours(groups, num_blocks):
    """prefixkv's manager of a layout, its block ids as vLLM's: vLLM always reserves
    block 0 as its null block; prefixkv does when a group releases blocks, else its
    ids start at 0 (one more is added to them)."""
    sizes = BlockSizes.of([b for b, _ in groups])
    specs = group_specs(groups)
    shift = int(not any(s.releases for s in specs))
    m = HybridKVCacheManager(specs, num_blocks - shift, sizes, hash_mode="sha256", seed=0, enable_events=True)
    return m, shift


def as_vllms(m, shift, tables, exact):
    """prefixkv's block ids as vLLM's (exact), or only which are the null block."""
    null = m.null_block_id
    return [[0 if b == null else b + shift if exact else -1 for b in ids] for ids in tables]


def same_tables(m, shift, rid, theirs, exact):
    mine = as_vllms(m, shift, m.get_block_ids(rid), exact)
    assert mine == [[b if exact or b == 0 else -1 for b in ids] for ids in theirs], (rid, mine, theirs)


def _key(h):
    """A chain hash as vLLM's events carry it (an int; prefixkv's events carry bytes)."""
    return h if isinstance(h, int) else maybe_convert_block_hash(h)


def entries(events, prefixes, group_sizes, hash_size):
    """Each entry an event announces or withdraws: (kind, group, prefix tokens, size),
    with the parent's prefix and the tokens for a partial tail entry. ``prefixes``:
    each side's chain hash (as vLLM's events carry it) -> the tokens it covers."""
    out = []
    for e in events:
        if not hasattr(e, "block_hashes"):
            out.append((type(e).__name__,))
            continue
        stored = hasattr(e, "token_ids")
        for h in e.block_hashes:
            entry = (stored, e.group_idx, prefixes[_key(h)], stored and e.block_size)
            if stored and e.block_size == hash_size < group_sizes[e.group_idx]:
                up = e.parent_block_hash
                entry += (None if up is None else prefixes[_key(up)], list(e.token_ids))
            out.append(entry)
    return out


def held(counts, entries, group_sizes):
    """Count each (group, prefix) of a whole block ``entries`` announce (+1) or withdraw
    (-1); a cleared cache holds none. (Partial tail entries are left out: vLLM announces
    one on a spare, prefixkv does not, so past a spare vLLM may hold one prefixkv never
    announced, groups/sized.py ``_tail``.)"""
    for e in entries:
        if len(e) == 1:
            counts.clear()
        elif not len(e[2]) % group_sizes[e[1]]:
            counts[e[1:3]] += 1 if e[0] else -1
    return {k for k, n in counts.items() if n}


def learn(prefixes, hashes, tokens, hash_size):
    for i, h in enumerate(hashes):
        prefixes[_key(h)] = tuple(tokens[:(i + 1) * hash_size])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("num_blocks", POOLS)
@settings(max_examples=25, deadline=None)
@given(runs=st.lists(st.tuples(PROMPT, st.integers(1, 120), st.integers(0, 40), st.booleans(),
                              st.sampled_from([0, 0, 1, 5, 17]), st.booleans()), min_size=1, max_size=6),
       probe=PROMPT)
def test_the_manager_gives_vllms_hits_block_ids_and_events_per_group(layout, num_blocks, runs, probe):
    """Past a freed spare (where streams without lookahead slots go on): prefixkv's
    manager is held to the reference of its twin rule (tests/sized_model.py
    ``twins=True``, tests/twin_model.py) after every call: tables, free order, free
    blocks, hits (ids too) and events (as a multiset a call); to vLLM's where the rules
    agree: the same hit when both hold the same whole-block entries of the prompt's
    prefixes, and every block either names in a hit holds the prompt's KV. (The
    reference has no lookahead slots: a stream with some stops at the first spare
    freed on the small pool, as before.)"""
    groups = LAYOUTS[layout]
    hash_size = reduce(math.gcd, (b for b, _ in groups))
    lcm = reduce(math.lcm, (b for b, _ in groups))
    v = _vllm(groups, hash_size, lcm, events=True, num_blocks=num_blocks)
    m, shift = ours(groups, num_blocks)
    assert m.block_size == lcm
    group_sizes = [b for b, _ in groups]
    twin = None if any(run[4] for run in runs) else SizedModel(groups, num_blocks - shift, hash_size, lcm,
                                                               null=not shift, twins=True)
    kv = (Written(group_sizes, m.null_block_id), Written(group_sizes, 0))  # (mine, theirs)
    exact = True  # no spare freed
    twinned = False  # a spare made, or a partial tail entry held by two blocks (prefixkv
    # announces an entry once, by its first holder, as it announces a prefix once a group;
    # vLLM announces it on every block: groups/tails.py)
    emptied: list = []  # spares freed (prefixkv empties them)
    release = m._index.release_spare
    m._index.release_spare = lambda b: emptied.append(b) or release(b)
    theirs: dict = {}
    mine: dict = {}
    counts: tuple = (Counter(), Counter())  # (mine, theirs): (group, prefix) -> copies announced
    held_now: list = [set(), set()]

    def same_events(r):
        learn(theirs, r.block_hashes, r.all_token_ids, hash_size)
        learn(mine, m.prepare(list(r.all_token_ids)).hashes, r.all_token_ids, hash_size)
        got = entries(m.take_events(), mine, group_sizes, hash_size)
        want = entries(v.take_events(), theirs, group_sizes, hash_size)
        if not twinned:
            assert got == want, (r.request_id, got, want)
        held_now[:] = held(counts[0], got, group_sizes), held(counts[1], want, group_sizes)
        if exact:
            assert held_now[0] == held_now[1], r.request_id
        if twin is not None:
            assert Counter(twin_events(got)) == Counter(twin.events), (r.request_id, got, twin.events)
            twin.events = []

    def same_state(r, done):
        nonlocal exact
        exact = not emptied
        if twin is not None:
            assert m.free_block_order() == list(twin.free)
            assert m.num_free_blocks == len(twin.free)
            for rid in twin.reqs:
                assert [list(g) for g in m.get_block_ids(rid)] == twin.reqs[rid].tables, rid
        if done == r.num_computed_tokens:  # (the same hit: the same table lengths)
            same_tables(m, shift, r.request_id, v.get_block_ids(r.request_id), exact)
        kv[0].wrote(m.get_block_ids(r.request_id), r.all_token_ids, done)
        kv[1].wrote(v.get_block_ids(r.request_id), r.all_token_ids, r.num_computed_tokens)
        same_events(r)

    def same_hit(tokens, hit, ids):
        got = m.lookup(tokens)
        if exact or held_prefixes(held_now[0], tokens) == held_prefixes(held_now[1], tokens):
            assert got == hit, (tokens, got, hit)
        kv[1].check_hit(ids, tokens)
        kv[0].check_hit(m.lookup_block_ids(tokens), tokens)
        if twin is not None:
            assert got == twin.hit(tokens, None)[0]
            assert [list(g) for g in m.lookup_block_ids(tokens)] == twin.hit(tokens, None)[1]
        return got

    for i, (tokens, chunk, decode, free, ahead, aligned) in enumerate(runs):
        tokens = tokens[:len(tokens) // lcm * lcm] if aligned and len(tokens) >= lcm else tokens
        if num_blocks < 400:  # (every request freed: entries evicted, in the same order until a spare)
            free = True
            if not exact and twin is None:
                return
        r = _request(f"r{i}", tokens, hash_size)
        blocks, hit, *_ = v.get_computed_blocks(r)
        got_hit = same_hit(tokens, hit, blocks.get_block_ids() if hit else [[]] * len(groups))
        step = min(chunk, len(tokens) - hit)
        assert v.allocate_slots(r, step, hit, blocks, num_lookahead_tokens=ahead) is not None
        got = m.add_request(r.request_id, tokens, num_new_tokens=chunk, num_lookahead_tokens=ahead)
        assert got is not None and got.num_cached_tokens == got_hit
        done = got_hit + min(chunk, len(tokens) - got_hit)
        if twin is not None:
            assert twin.add(r.request_id, tokens, None, done - got_hit) == got_hit
        r.num_computed_tokens = hit + step
        while True:
            twinned = twinned or any(m._index.twins) or any(n > 1 for n in m._index.tails.held.values())
            same_state(r, done)
            step = min(chunk, len(tokens) - r.num_computed_tokens)
            more = min(chunk, len(tokens) - done)
            if not step and not more:
                break
            if step:
                assert v.allocate_slots(r, step) is not None
                r.num_computed_tokens += step
            if more:
                assert m.extend(r.request_id, more) is not None
                assert twin is None or twin.grow(r.request_id, more)
                done += more
        for t in range(decode):  # (tokens of this request's own: no other computes them)
            r.append_output_token_ids(1000 + 50 * i + t)
            assert v.allocate_slots(r, 1) is not None
            assert m.append_tokens(r.request_id, [1000 + 50 * i + t]) is not None
            assert twin is None or twin.grow(r.request_id, 1, [1000 + 50 * i + t])
            r.num_computed_tokens += 1
            done += 1
            twinned = twinned or any(m._index.twins) or any(n > 1 for n in m._index.tails.held.values())
            same_state(r, done)
        if free:
            v.free(r)
            m.free(r.request_id)
            if twin is not None:
                twin.free_request(r.request_id)
            exact = not emptied
            same_events(r)
        if exact or twin is None:
            assert m.num_free_blocks == v.block_pool.get_num_free_blocks()
        m.check_invariants()
    r = _request("probe", probe, hash_size)
    blocks, hit, *_ = v.get_computed_blocks(r)
    want = blocks.get_block_ids() if hit else [[]] * len(groups)
    same_hit(probe, hit, want)
    if exact:
        assert as_vllms(m, shift, m.lookup_block_ids(probe), True) == [list(ids) for ids in want]
