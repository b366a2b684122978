"""vLLM's ``prefix_cache_retention_interval`` beside EAGLE (``use_eagle``) and sliding
windows with groups of different block sizes (integrations/vllm/retention.py
``_beside_eagle``; groups/eagle_retention.py ``peek_retains``): vLLM keeps, in a window its EAGLE
flags, the tail a hit reads at each segment's end and at EAGLE's replay boundaries (one
scheduler block below the prompt's last aligned boundaries) and a junction (and one
block below it) one block up, one block longer (``reachable_block_mask``'s shift), and
in another window the plain tail at those boundaries. Random side-by-side streams of
vLLM's manager and the plug-in (test_vllm_mamba_sizes.py's ``Sides``: the same answers,
tables, free counts and hits after every call, up to the first spare), every hit's
blocks holding the prefix it says; and vLLM's test's scene with exact values. Needs vllm
installed."""

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

from .test_vllm_block_sizes_reference import _request, _spec  # noqa: E402
from .test_vllm_mamba_sizes import OP, Sides  # noqa: E402
from .test_vllm_sized_model import EAGLE, PROMPT  # noqa: E402

# (windows beside full attention, of different block sizes: vLLM takes a retention there)
LAYOUTS = {k: v for k, v in EAGLE.items() if any(w is not None for _, w in v[0])}


class WindowSides(Sides):
    """``Sides`` over windows and full attention (any chunk: vLLM's scheduler cuts them
    anywhere), both managers with EAGLE, the flags and the interval; ``written``: what
    each prefixkv block holds (by id)."""

    def __init__(self, groups: Any, flags: tuple[bool, ...], retention: int | None, num_blocks: int) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

        from prefixkv.integrations.vllm import KVCacheManager

        sizes = [b for b, _ in groups]
        self.partial, self.groups = False, groups
        self.h, self.lcm = reduce(math.gcd, sizes), reduce(math.lcm, sizes)
        self.names, self.partial_entries, self.reqs = [{}, {}], 0, [{}, {}]
        self.serial = self.hits = self.copies = self.checked = 0
        self.written: dict[int, tuple[int, ...]] = {}
        init_none_hash(sha256)
        c = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                          prefix_cache_retention_interval=retention,
                          kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], _spec(b, w), is_eagle_group=f)
                                           for i, ((b, w), f) in enumerate(zip(groups, flags, strict=True))])
        self.ms = [make(c, max_model_len=256, scheduler_block_size=self.lcm, hash_block_size=self.h,
                        use_eagle=True) for make in (VllmManager, KVCacheManager)]
        assert all(g.retention == retention for g in self.ms[1].core.groups if g.kind == "sliding_window")

    def _chunk(self, start: int, n: int, total: int, prompt: int) -> int:
        return n

    def holds(self, probe: list[int]) -> None:
        """Note what prefixkv's live requests' blocks hold (the tokens up to each block's
        end, or its computed tokens inside one), then check that every block of its hit
        for ``probe`` and for each live request's tokens and one more holds the prefix
        up to its end (a wrong KV: anything else; the null block, 0, holds nothing)."""
        m = self.ms[1]
        for r in self.reqs[1].values():
            n, tokens = r.num_computed_tokens, tuple(r.all_token_ids)
            for g, ids in enumerate(m.get_block_ids(r.request_id)):
                b = self.groups[g][0]
                for j, i in enumerate(ids[:-(-n // b)]):
                    if i:
                        self.written[i] = tokens[:min((j + 1) * b, n)]
        for tokens in [probe] + [list(r.all_token_ids) + [0] for r in self.reqs[1].values()]:
            blocks, hit, _ = m.get_computed_blocks(_request("holds", tokens, self.h))
            for g, ids in enumerate(blocks.get_block_ids()):
                b = self.groups[g][0]
                for j, i in enumerate(ids):
                    assert not i or self.written.get(i) == tuple(tokens[:(j + 1) * b]), (g, j, i, hit)
            self.checked += hit > 0


@pytest.mark.parametrize(("segments", "small"), [(k, small) for k in (0, 1, 2) for small in (False, True)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugin_retains_vllms_window_tails_beside_eagle(layout, small, segments, ops, probe):
    groups, flags = LAYOUTS[layout]
    lcm = reduce(math.lcm, (b for b, _ in groups))
    s = WindowSides(groups, flags, segments * lcm, sum(-(-256 // b) for b, _ in groups) + 3 if small else 400)
    s.drive(ops, probe, lambda s: s.holds(probe))


def _scene(make: Any) -> list[tuple[int, list[int]]]:
    """vLLM's test_hybrid_local_kv_retention_mtp_reuses_latest_boundary: full attention
    at 32 beside a window of 8 at 8 that EAGLE flags, hash block 8, retention 0; a prompt
    of 127 tokens computed whole, freed: the hits (and each group's blocks in them) of
    its first 40, 72, 80, 96 and 127 tokens and one more token."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    init_none_hash(sha256)
    c = KVCacheConfig(num_blocks=100, kv_cache_tensors=[], prefix_cache_retention_interval=0,
                      kv_cache_groups=[KVCacheGroupSpec(["full"], _spec(32, None)),
                                       KVCacheGroupSpec(["swa"], _spec(8, 8), is_eagle_group=True)])
    m = make(c, max_model_len=8192, scheduler_block_size=32, hash_block_size=8, use_eagle=True)
    tokens = [i for i in range(15) for _ in range(8)] + [15] * 7
    r = _request("0", tokens, 8)
    blocks, hit, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, len(tokens), hit, blocks) is not None
    m.free(r)
    got = []
    for n in (40, 72, 80, 96, 127):
        blocks, hit, _ = m.get_computed_blocks(_request("1", tokens[:n] + [999], 8))
        got.append((hit, [len(g) for g in blocks.get_block_ids()]))
    return got


def test_a_flagged_windows_tail_at_eagles_replay_boundary_moves_one_block_up():
    # the replay boundary: 127 // 32 * 32 - 32 = 64; the window keeps its tail there (one
    # block) and EAGLE's block past it: hash blocks 7 and 8 (vLLM's test reads them), so
    # every prompt reaching 72 (EAGLE's peek) hits 64 (full attention's 2 blocks, the
    # window's 8, nulls below), a shorter one nothing. Both managers alike (before:
    # prefixkv took the interval dense, every window block cached: 96 for 127 tokens)
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    from prefixkv.integrations.vllm import KVCacheManager

    for make in (VllmManager, KVCacheManager):
        assert _scene(make) == [(0, [0, 0]), (64, [2, 8]), (64, [2, 8]), (64, [2, 8]), (64, [2, 8])], make
