"""A reference of vLLM 0.33's hit rule for layer groups of DIFFERENT block sizes, checked
against vLLM's own ``KVCacheManager`` (from the wheel). prefixkv refuses these layouts
(integrations/vllm/layout.py ``read_layout``); this reference is the specification its
hybrid manager must meet once it offers them (docs/groups.md). It tests no prefixkv code.

The rule (docs/groups.md, "Hits"): the hit is the largest ``L <= max_length``, a multiple
of ``scheduler_block_size`` (the lcm of the groups' sizes), at which every group ``g`` of
block size ``b_g`` holds, cached, every block a query at ``L`` reads: blocks
``first_needed(L) // b_g .. L // b_g - 1``; group ``g``'s block ``j`` is keyed by the
fine hash at its last hash boundary, ``block_hashes[(j + 1) * b_g // hash - 1]``. Group g's
hit is ``L // b_g`` entries, the null block below what it reads. And what vLLM caches
per group once a prompt is computed (``reference_cached``). prefixkv's own rules for such
layouts (``prefixkv.groups.BlockSizes``: the hit, the blocks cached, the events) are
checked here against vLLM beside the reference, for the same calls; the hybrid manager
does not take these layouts yet. Needs vllm installed."""

from __future__ import annotations

import math
import os
from functools import reduce
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixkv.groups import BlockSizes, GroupSpec, full_attention, sliding_window

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_plugin import config  # noqa: E402

NULL = 0  # vLLM's null block

# (block size, window): window None is full attention, an int a sliding window of that
# many tokens (>= 2: a window of one token reads no earlier block)
LAYOUTS = {
    "full8+window20@16": ((8, None), (16, 20)),
    "window10@8+full16": ((8, 10), (16, None)),  # (W - 2 a multiple of b)
    "full8+full24": ((8, None), (24, None)),
    "window6@8+full16+window40@32": ((8, 6), (16, None), (32, 40)),
    "window9@16+window30@8": ((16, 9), (8, 30)),
    "window17@16+full8+window9@8": ((16, 17), (8, None), (8, 9)),  # (W - 1 a multiple of b)
    "window20@16+full24": ((16, 20), (24, None)),  # (hash 8, lcm 48: neither group's size)
}

# Mamba beside attention of other sizes, with vLLM's fine-grained partial hits off (a
# Mamba block no larger than the hash block, or a sliding window larger than it beside):
# hits and caching aligned to the lcm (tests/sized_model.py states them)
MAMBA_LAYOUTS = {
    "full16+mamba8": ((16, None), (8, "mamba")),
    "mamba8+full24+window20@8": ((8, "mamba"), (24, None), (8, 20)),
    "window20@16+full8+mamba16": ((16, 20), (8, None), (16, "mamba")),
}


def group_specs(groups: tuple[tuple[int, int | None], ...]) -> tuple[GroupSpec, ...]:
    """prefixkv's specs of a layout."""
    return tuple(full_attention() if w is None else sliding_window(w) for _, w in groups)


def first_needed(window: int | None, pos: int) -> int:
    """The first position a query at ``pos`` reads (design.md, "What a group reads")."""
    return 0 if window is None else max(0, pos - window + 1)


def reference_hit(groups: tuple[tuple[int, int | None], ...], limit: int, align: int,
                  cached: Any) -> int:
    """The largest ``L <= limit``, a multiple of ``align``, at which every group holds the
    blocks it reads; ``cached(g, j)``: block ``j`` of group ``g`` is cached."""
    for end in range(limit - limit % align, 0, -align):
        if all(all(cached(g, j) for j in range(first_needed(w, end) // b, end // b))
               for g, (b, w) in enumerate(groups)):
            return end
    return 0


def _spec(block_size: int, window: int | str | None, retained: int = 0) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if window == "mamba":
        return MambaSpec(block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,),
                         mamba_cache_mode="align")
    if window is None:
        return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=window, extra_retained_tokens=retained)


def _vllm(groups: tuple[tuple[int, int | None], ...], hash_size: int, lcm: int, num_blocks: int = 400,
          events: bool = False, retained: tuple[int, ...] = (), retention: int | None = None) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    specs = (_spec(b, w, e) for (b, w), e in zip(groups, retained or (0,) * len(groups), strict=True))
    return KVCacheManager(config(*specs, num_blocks=num_blocks, prefix_cache_retention_interval=retention),
                          max_model_len=256,
                          scheduler_block_size=lcm, hash_block_size=hash_size, enable_kv_cache_events=events)


def _run(m: Any, rid: str, tokens: list[int], hash_size: int, free: bool) -> tuple[Any, int]:
    """Admit ``tokens`` as ``rid`` on ``m`` with its hit, computed whole (cached as the
    manager caches); freed when ``free``. The request and its hit."""
    r = _request(rid, tokens, hash_size)
    blocks, hit, *_ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, len(tokens) - hit, hit, blocks) is not None
    r.num_computed_tokens = len(tokens)
    if free:
        m.free(r)
    return r, hit


def _request(rid: str, tokens: list[int], hash_size: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=4),
                   pooling_params=None, block_hasher=get_request_block_hasher(hash_size, sha256))


# prompts of shared stems (so hits are partial) and a few random tokens; each is run
# (computed whole, cached as vLLM caches) and kept or freed; then one more is looked up
PROMPT = st.tuples(st.integers(0, 2), st.integers(0, 90), st.lists(st.integers(0, 2), max_size=20)).map(
    lambda p: [100 * p[0] + k for k in range(p[1])] + p[2] or [7])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@settings(max_examples=40, deadline=None)
@given(runs=st.lists(st.tuples(PROMPT, st.booleans()), min_size=1, max_size=6), probe=PROMPT)
def test_the_reference_gives_vllms_hit_and_blocks_per_group(layout, runs, probe):
    groups = LAYOUTS[layout]
    hash_size = reduce(math.gcd, (b for b, _ in groups))
    lcm = reduce(math.lcm, (b for b, _ in groups))
    m = _vllm(groups, hash_size, lcm)
    for i, (tokens, free) in enumerate(runs):
        _run(m, f"r{i}", tokens, hash_size, free)
    r = _request("probe", probe, hash_size)
    blocks, hit, *_ = m.get_computed_blocks(r)
    pool = m.coordinator.block_pool

    def cached(g: int, j: int) -> bool:
        key = r.block_hashes[(j + 1) * groups[g][0] // hash_size - 1]
        return pool.get_cached_block(key, [g]) is not None

    want = reference_hit(groups, len(probe) - 1, lcm, cached)
    assert hit == want, (hit, want)
    ours = BlockSizes.of([b for b, _ in groups]).longest_hit(group_specs(groups), len(probe) - 1, cached)
    assert ours == hit, (ours, hit)
    tables = blocks.get_block_ids() if hit else [[]] * len(groups)
    for g, ((b, w), ids) in enumerate(zip(groups, tables, strict=True)):
        assert len(ids) * b == hit, (g, ids, hit)
        for j, block in enumerate(ids):
            key = r.block_hashes[(j + 1) * b // hash_size - 1]
            if j < first_needed(w, hit) // b:
                assert block == NULL, (g, j, ids)
            else:  # (the block vLLM keyed under group g's prefix up to (j + 1) * b)
                assert block == pool.get_cached_block(key, [g])[0].block_id, (g, j, ids)


def test_the_reference_at_one_case_by_hand():
    # full attention at 8 beside a 20-token window at 16 (lcm 16): a query at 32 reads
    # full blocks 0..3 and window blocks 13 // 16 = 0 .. 1; at 48, full 0..5, window 1..2
    groups = ((8, None), (16, 20))
    have = {(0, j) for j in range(6)} | {(1, 1), (1, 2)}
    assert reference_hit(groups, 50, 16, lambda g, j: (g, j) in have) == 48
    have.discard((1, 1))  # the window's block 1 gone: 48 and 32 read it; 16 reads block 0
    assert reference_hit(groups, 50, 16, lambda g, j: (g, j) in have) == 0
    have.add((1, 0))
    assert reference_hit(groups, 50, 16, lambda g, j: (g, j) in have) == 16


def reference_cached(groups: tuple[tuple[int, int | None], ...], lcm: int, n: int, g: int, j: int) -> bool:
    """Whether vLLM caches block ``j`` of group ``g`` once a prompt of ``n`` tokens is
    computed (docs/groups.md, "What is cached"): the group's whole blocks below ``n``
    rounded down to the lcm; a sliding window's only where a hit at an lcm boundary reads
    them (the ``cdiv(W - 1, b)`` blocks before each boundary), all of them when those
    runs cover every block."""
    b, w = groups[g]
    if (j + 1) * b > n // lcm * lcm:
        return False
    if w is None:
        return True
    need, per_boundary = -(-(w - 1) // b), lcm // b
    return need >= per_boundary or j % per_boundary >= per_boundary - need


@pytest.mark.parametrize("layout", list(LAYOUTS))
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 200))
def test_the_reference_gives_the_blocks_vllm_caches_per_group(layout, n):
    groups = LAYOUTS[layout]
    hash_size = reduce(math.gcd, (b for b, _ in groups))
    lcm = reduce(math.lcm, (b for b, _ in groups))
    m = _vllm(groups, hash_size, lcm)
    r = _request("r", [5 + k % 7 for k in range(n)], hash_size)
    assert m.allocate_slots(r, n) is not None
    pool = m.coordinator.block_pool
    for g, (b, _) in enumerate(groups):
        got = [pool.get_cached_block(r.block_hashes[(j + 1) * b // hash_size - 1], [g]) is not None
               for j in range(n // b)]
        assert got == [reference_cached(groups, lcm, n, g, j) for j in range(n // b)], (g, got)
        sizes, spec = BlockSizes.of([b for b, _ in groups]), group_specs(groups)[g]
        assert got == [sizes.caches(spec, g, n, j) for j in range(n // b)], (g, got)


def reference_stored(groups: tuple[tuple[int, int | None], ...], hash_size: int, lcm: int,
                     n: int) -> set[tuple[int, int, int]]:
    """What vLLM announces (``BlockStored``) once a prompt of ``n`` tokens is computed, as
    ``(group, fine hash index, block_size)``: each cached block under its key, with its
    group's size; and a full-attention group larger than the hash block, when the
    prompt's last hash boundary before its last token falls inside a block below the
    lcm-rounded end (only an lcm-aligned prompt), that block's partial entry, announced
    as one hash block (its tokens the last hash block before the boundary)."""
    out = set()
    for g, (b, w) in enumerate(groups):
        out |= {(g, (j + 1) * b // hash_size - 1, b) for j in range(n // b)
                if reference_cached(groups, lcm, n, g, j)}
        boundary = (n - 1) // hash_size * hash_size
        if w is None and b > hash_size and 0 < boundary <= n // lcm * lcm and boundary % b:
            out.add((g, boundary // hash_size - 1, hash_size))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 200))
@example(n=96)  # (a multiple of every layout's lcm: partial entries where a block > hash block)
def test_the_reference_gives_the_blocks_vllm_announces_per_group(layout, n):
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    groups = LAYOUTS[layout]
    hash_size = reduce(math.gcd, (b for b, _ in groups))
    lcm = reduce(math.lcm, (b for b, _ in groups))
    m = _vllm(groups, hash_size, lcm, events=True)
    r = _request("r", [5 + k % 7 for k in range(n)], hash_size)
    assert m.allocate_slots(r, n) is not None
    index = {maybe_convert_block_hash(h): i for i, h in enumerate(r.block_hashes)}
    got = [(e.group_idx, index[h], e.block_size) for e in m.take_events() if isinstance(e, BlockStored)
           for h in e.block_hashes]
    assert len(got) == len(set(got))
    assert set(got) == reference_stored(groups, hash_size, lcm, n)
    assert sorted(got) == sorted(BlockSizes.of([b for b, _ in groups]).stored(group_specs(groups), n))


def _hash_and_lcm(groups: tuple[tuple[int, int | None], ...]) -> tuple[int, int]:
    """vLLM's hash and scheduler block sizes of a layout: the gcd and the lcm of its sizes."""
    sizes = [b for b, _ in groups]
    return reduce(math.gcd, sizes), reduce(math.lcm, sizes)


def _plugin(groups: tuple[tuple[int, int | None], ...], hash_size: int, lcm: int,
            num_blocks: int = 400, events: bool = False) -> Any:
    """prefixkv's plug-in over the layout ``_vllm`` gives vLLM's manager."""
    from prefixkv.integrations.vllm import KVCacheManager

    return KVCacheManager(config(*(_spec(b, w) for b, w in groups), num_blocks=num_blocks), max_model_len=256,
                          scheduler_block_size=lcm, hash_block_size=hash_size, enable_kv_cache_events=events)


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(MAMBA_LAYOUTS))
@settings(max_examples=40, deadline=None)
@given(runs=st.lists(st.tuples(PROMPT, st.booleans()), min_size=1, max_size=6), probe=PROMPT)
def test_prefixkv_gives_vllms_hit_and_true_blocks_per_group(layout, runs, probe):
    # the third side: prefixkv's plug-in, for the same calls as vLLM's manager, gives
    # the same hit, each group's table as long with its null entries where vLLM's are,
    # and each hit block one that holds, in that group, the probe's prefix up to its end
    # (beside Mamba each run in a step of its own: a hit on a state cached in the same
    # step waits, in vLLM's manager as in prefixkv's plug-in)
    groups = {**LAYOUTS, **MAMBA_LAYOUTS}[layout]
    hash_size, lcm = _hash_and_lcm(groups)
    sides = [_vllm(groups, hash_size, lcm), _plugin(groups, hash_size, lcm)]
    holds: list[dict[tuple[int, int], tuple[int, ...]]] = [{}, {}]  # (group, block) -> prefix
    for i, (tokens, free) in enumerate(runs):
        for m, held in zip(sides, holds, strict=True):
            m.new_step_starts()
            r, hit = _run(m, f"r{i}", tokens, hash_size, False)
            for g, ((b, _), ids) in enumerate(zip(groups, m.get_block_ids(r.request_id), strict=True)):
                for j, x in enumerate(ids):
                    if x != NULL and j >= hit // b:  # (computed here: whole or not)
                        held[(g, x)] = tuple(tokens[:(j + 1) * b])
            if free:
                m.free(r)
    got = []
    for m, held in zip(sides, holds, strict=True):
        r = _request("probe", probe, hash_size)
        blocks, hit, *_ = m.get_computed_blocks(r)
        tables = [list(g) for g in blocks.get_block_ids()] if hit else [[] for _ in groups]
        for g, ((b, _), ids) in enumerate(zip(groups, tables, strict=True)):
            assert len(ids) * b == hit, (g, ids, hit)
            assert all(held[(g, x)] == tuple(probe[:(j + 1) * b]) for j, x in enumerate(ids) if x != NULL)
        got.append((hit, [[x == NULL for x in ids] for ids in tables]))
    assert got[0] == got[1], got
