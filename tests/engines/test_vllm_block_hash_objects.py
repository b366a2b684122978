"""The plug-in's ``KVCacheBlock`` objects beside vLLM 0.33's own (block_hash_view.py):
``block_hash`` and ``block_hash_num_tokens`` of every block read from what prefixkv's
block holds, equal to vLLM's.

``compare_block_hashes``, which test_vllm_block_hashes.py's random stream (one
full-attention group; full attention beside a sliding window; LoRA adapters, salts,
images, remote loads, preemption, evictions) asks after every call: each live request's
blocks, group by group and block by block, read vLLM's hash and token count, None
where vLLM's read None; until either pool removes a block, so do the blocks the free
queue lists, as a multiset. Here, directed: every copy of a prefix hashed (two requests
computing it), a freed block keeping its hash, eviction (reuse, ``evict_blocks``)
resetting it, popped blocks, a block whose request is gone read (test_vllm_block_hash_kept.py
has more), one no noted request named refused, groups this view does not follow, and
writes refused. Needs vllm."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Collection
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from . import test_vllm_reference as ref  # noqa: E402
from .test_vllm_hybrid_reference import _window  # noqa: E402
from .test_vllm_plugin import config, full  # noqa: E402

BS = ref.BS


def _hashes(blocks: Any) -> list[tuple[bytes | None, int | None]]:
    return [(b.block_hash, b.block_hash_num_tokens) for b in blocks]


def compare_block_hashes(sides: tuple[ref.Side, ref.Side], loaded_badly: Collection[str] = ()) -> None:
    """Both sides' block objects read the same hashes (the module's docstring says which).
    ``loaded_badly``: requests live when ``evict_blocks`` ran (a failed load), whose
    blocks may read a hash on one side alone: prefixkv caches what such a request
    recomputes again where vLLM's count of its cached blocks leaves it unhashed, and
    uncaches what it computed after the invalid block where vLLM keeps it
    (docs/integration.md); where both read one, it is the same."""
    ours, theirs = sides
    for slot in ours.live & theirs.live:
        r, v = ours.reqs[slot], theirs.reqs[slot]
        if list(r.all_token_ids) == list(v.all_token_ids):
            mine, vllms = ([_hashes(g) for g in s.m.get_blocks(q.request_id).blocks]
                           for s, q in ((ours, r), (theirs, v)))
            if r.request_id in loaded_badly:
                assert all(x == y or None in (x[0], y[0]) for a, b in zip(mine, vllms, strict=True)
                           for x, y in zip(a, b, strict=True)), slot
            else:
                assert mine == vllms, slot
    if not (ours.evicted or theirs.evicted or ours.diverged):
        _compare_free(ours.m.block_pool, theirs.m.block_pool)


def _compare_free(mine: Any, vllms: Any) -> None:
    """The free blocks' hashes, as multisets: prefixkv's are vLLM's, but a spare emptied
    at its free reads None where vLLM keeps its copy cached (the free-duplicate
    difference, docs/groups.md): another block still holds that key in vLLM's pool."""
    ours = Counter(h for h in _hashes(mine.free_block_queue.get_all_free_blocks()) if h[0] is not None)
    theirs = Counter(h for h in _hashes(vllms.free_block_queue.get_all_free_blocks()) if h[0] is not None)
    assert not ours - theirs, (ours, theirs)
    held = Counter(b.block_hash for b in vllms.blocks if b.block_hash is not None)
    assert all(held[h] > 1 for h, _ in theirs - ours), (theirs - ours)


def _admit(m: Any, r: Any, n: int | None = None) -> None:
    from vllm.v1.request import RequestStatus

    blocks, hit, _ = m.get_computed_blocks(r)
    n = r.num_tokens - hit if n is None else n
    assert m.allocate_slots(r, n, hit, blocks) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, hit + n


def _step(m: Any, r: Any, token: int) -> None:
    r.append_output_token_ids(token)
    assert m.allocate_slots(r, 1) is not None
    r.num_computed_tokens += 1


def _noted(s: ref.Side, rid: str, tokens: list[int]) -> Any:
    r = ref._request(rid, tokens, None)
    if hasattr(s.m, "prepared_prompts"):
        s.m.prepared_prompts.note(r)
    return r


def _table(m: Any, rid: str) -> list[list[tuple[bytes | None, int | None]]]:
    return [_hashes(g) for g in m.get_blocks(rid).blocks]


def _pool(m: Any, ids: list[int]) -> list[tuple[bytes | None, int | None]]:
    return _hashes(m.block_pool.blocks[i] for i in ids)


@pytest.mark.parametrize("window", [False, True])
def test_every_copy_is_hashed_and_a_freed_block_keeps_its_hash_until_reused(window):
    sides = ref._managers(12, (full(BS), _window(2 * BS)) if window else None)
    ms = [s.m for s in sides]
    a, b = ([_noted(s, rid, list(range(BS + BS // 2))) for s in sides] for rid in "ab")
    for m, x, y in zip(ms, a, b, strict=True):
        _admit(m, x)
        _admit(m, y)  # (a hit on block 0; block 1 its own)
        for t in range(BS // 2):  # both compute the same block 1: two copies of one prefix
            _step(m, x, 50 + t)
            _step(m, y, 50 + t)
    mine, vllms = ([_table(m, "a"), _table(m, "b")] for m in ms)
    assert mine == vllms
    assert mine[0] == mine[1] and all(h is not None for g in mine[0] for h, _ in g), mine
    assert mine[0][0][1][1] == 2 * BS
    ids = [[i for g in m.get_block_ids("a") + m.get_block_ids("b") for i in g if i] for m in ms]
    for m, x in zip(ms, a, strict=True):
        m.free(x)
    assert _pool(ms[0], ids[0]) == _pool(ms[1], ids[1])  # (a's blocks kept cached; b's held)
    for m, y in zip(ms, b, strict=True):
        m.free(y)
    _compare_free(*(m.block_pool for m in ms))
    mine, vllms = (_pool(m, i) for m, i in zip(ms, ids, strict=True))
    # the same but for b's copy of block 1 (in each group), which prefixkv empties at its free
    diff = [i for i, (x, y) in enumerate(zip(mine, vllms, strict=True)) if x != y]
    assert len(diff) == len(sides[0].windows), (mine, vllms)
    assert all(mine[i] == (None, None) and vllms[i][0] is not None for i in diff), (mine, vllms)
    old = {h for h in vllms if h[0] is not None}
    kept: list[list[Any]] = [[], []]  # (the scheduler holds its running requests)
    for s, m, mine in zip(sides, ms, kept, strict=True):  # requests that take every block
        while m.block_pool.get_num_free_blocks() >= len(s.windows):
            mine.append(_noted(s, f"c{len(mine)}", [100 + len(mine)] * BS))
            _admit(m, mine[-1])
    assert [_table(ms[0], r.request_id) for r in kept[0]] == [_table(ms[1], r.request_id) for r in kept[1]]
    for m, i, mine in zip(ms, ids, kept, strict=True):  # (each pool reuses them in its own order)
        reused = [b for b in set(i) if any(b in g for r in mine for g in m.get_block_ids(r.request_id))]
        now = _pool(m, reused)
        assert len(reused) >= len(set(i)) - 1 and not old & set(now), (now, old)


def test_evict_blocks_resets_a_held_blocks_hash_and_popped_blocks_read_theirs():
    seen = []
    for s in ref._managers(12):
        r = _noted(s, "r", list(range(3 * BS + 1)))
        _admit(s.m, r)
        before = _table(s.m, "r")
        s.m.evict_blocks({s.m.get_block_ids("r")[0][2]})  # (KV a connector failed to load)
        after = _table(s.m, "r")
        popped = s.m.pop_blocks_for_free(r)
        held = _hashes(popped)
        s.m.block_pool.free_blocks(reversed(popped))
        seen.append((before, after, held, _hashes(popped)))
    assert seen[0] == seen[1], seen
    before, after, held, freed = seen[0]
    assert [h is None for h, _ in before[0]] == [False, False, False, True]
    assert after[0] == [*before[0][:2], (None, None), (None, None)]
    assert sorted(held, key=repr) == sorted(after[0], key=repr) and freed == held


def test_evict_blocks_below_a_held_block_resets_its_hash_too_where_vllm_keeps_it():
    """The documented difference: prefixkv makes the blocks after an evicted one
    unfindable too (their prefix runs through it), vLLM keeps their hashes."""
    seen = []
    for s in ref._managers(12):
        r = _noted(s, "r", list(range(3 * BS + 1)))
        _admit(s.m, r)
        s.m.evict_blocks({s.m.get_block_ids("r")[0][1]})
        seen.append([h is None for h, _ in _table(s.m, "r")[0]])
    assert seen == [[False, True, True, True], [False, True, False, True]]


def test_writes_are_refused_by_name():
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    s = ref._managers(12)[0]
    r = _noted(s, "r", list(range(BS + 1)))
    _admit(s.m, r)
    block = s.m.get_blocks("r").blocks[0][0]
    key = block.block_hash
    assert key is not None
    for write, name in ((lambda: block.set_block_hash(key, BS), "set_block_hash"),
                        (block.reset_hash, "reset_hash"),
                        (lambda: setattr(block, "_block_hash", None), "_block_hash"),
                        (lambda: setattr(block, "_block_hash_num_tokens", 1), "_block_hash_num_tokens")):
        with pytest.raises(UnsupportedByPrefixKV, match=name):
            write()
    with pytest.raises(AttributeError, match="pool"):  # (vLLM's pool alone writes it)
        block.pool = None
    assert (block.block_hash, block.block_hash_num_tokens) == (key, BS)


def test_a_block_whose_request_is_gone_reads_its_hash_and_one_no_noted_request_named_is_refused():
    import gc

    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    s = ref._managers(12)[0]
    assert s.m.block_pool.blocks[5].block_hash is None  # (a read: frees keep hashes from now on)
    gone = _noted(s, "gone", [9] * (BS + 1))
    _admit(s.m, gone)
    unread = s.m.get_blocks("gone").blocks[0][0]
    key = gone.block_hashes[0]
    s.m.free(gone)
    del gone
    gc.collect()
    assert (unread.block_hash, unread.block_hash_num_tokens) == (key + bytes(4), BS)  # (kept at its free)
    stray = ref._request("stray", list(range(BS + 1)), None)  # (built without prefixkv's hasher)
    _admit(s.m, stray)
    with pytest.raises(UnsupportedByPrefixKV, match="block_hash of prefixkv block"):
        _ = s.m.get_blocks("stray").blocks[0][0].block_hash
    assert s.m.block_pool.blocks[5].block_hash is None  # (never used)


@pytest.mark.parametrize("layout", ["sizes", "mamba"])
def test_groups_the_view_does_not_follow_read_none_and_say_why(layout):
    """Beside groups of different block sizes or a Mamba group every block reads None (as
    before the view: vLLM's connectors ask a request's blocks whether they are hashed),
    and the view says why; a connector's ``touch`` is refused by name."""
    from vllm.v1.request import RequestStatus

    from prefixkv.integrations.vllm import KVCacheManager
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    from .test_vllm_hybrid_reference import _mamba

    specs = (full(2 * BS), _window(2 * BS)) if layout == "sizes" else (full(BS), _mamba())
    m = KVCacheManager(config(*specs, num_blocks=40), max_model_len=ref.MAX_LEN,
                       scheduler_block_size=2 * BS if layout == "sizes" else BS, hash_block_size=BS)
    r = ref._request("r", list(range(4 * BS + 1)), None)
    m.prepared_prompts.note(r)
    blocks, hit, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens, 0, blocks) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, r.num_tokens
    held = [b for g in m.get_blocks("r").blocks for b in g if not b.is_null]
    assert held and all(b.block_hash is None and b.block_hash_num_tokens is None for b in held)
    assert m.block_pool.get_cached_block(r.block_hashes[1], [0]) is not None  # (cached all the same)
    view = m.block_pool.blocks[1]._hashes.hashes
    assert ("different block sizes" if layout == "sizes" else "Mamba") in view.unserved
    with pytest.raises(UnsupportedByPrefixKV, match="touch"):
        m.block_pool.touch(held)


def test_a_probe_kept_over_a_reset_finds_what_is_cached_after_it():
    """A prefix asked of the pool (its probe kept), the prefix cache reset, the same
    request admitted again: its new blocks are the answer, as vLLM's (before: the probe
    kept the node the reset left out of the table, and answered None)."""
    from vllm.v1.request import RequestStatus

    seen = []
    for s in ref._managers(24, (full(BS), _window(2 * BS))):
        r = _noted(s, "r", list(range(2 * BS + 1)))
        _admit(s.m, r)
        asked = [s.m.block_pool.get_cached_block(h, [0, 1]) for h in r.block_hashes]
        s.m.free(r)
        r.status, r.num_computed_tokens = RequestStatus.PREEMPTED, 0
        assert s.m.reset_prefix_cache()
        _admit(s.m, r)
        again = [s.m.block_pool.get_cached_block(h, [0, 1]) for h in r.block_hashes]
        seen.append(([b is None for b in asked], [b is None for b in again], _table(s.m, "r")))
    assert seen[0] == seen[1] and seen[0][1] == [False, False], seen
