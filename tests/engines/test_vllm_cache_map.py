"""vLLM's ``cached_block_hash_to_block._cache`` read from prefixkv's plug-in (cache_map.py):
a read-only snapshot keyed by vLLM's ``BlockHashWithGroupId``, built from the block
objects' hashes. prefixkv's plug-in and vLLM's own manager run the same requests side by
side (an exact scene; seeded random admissions, growth and frees): the same keys, each
under as many blocks; writes refused with nothing changed; refused where the block
objects show no hash. Needs vllm installed."""

from __future__ import annotations

import copy
import os
import random
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hybrid_reference import _window  # noqa: E402
from .test_vllm_plugin import full  # noqa: E402
from .test_vllm_reference import BS, _managers, _request  # noqa: E402
from .vllm_steps import admit as _admit  # noqa: E402
from .vllm_steps import random_step  # noqa: E402


def _shape(m: Any) -> dict[bytes, int]:
    """Each key of the map, with how many blocks it lists."""
    return {k: len(v) if isinstance(v, dict) else 1
            for k, v in m.block_pool.cached_block_hash_to_block._cache.items()}


def test_the_map_of_a_scene_is_vllms():
    """Exact values: a prompt of 3 full blocks (3 keys, its blocks 1, 2, 3 on both sides),
    freed (kept), then another sharing its first block (1 more key: its block 4)."""
    seen = []
    for m in (s.m for s in _managers(11)):
        a = _admit(m, "a", list(range(3 * BS + 1)))
        first = dict(m.block_pool.cached_block_hash_to_block._cache)
        m.free(a)
        b = _admit(m, "b", [0, 1, 2, 3, 70, 71, 72, 73, 74])
        later = dict(m.block_pool.cached_block_hash_to_block._cache)
        seen.append(([k for k in first], {k: v.block_id for k, v in later.items()},
                     a.block_hashes[:3] + b.block_hashes[1:2]))
    assert seen[0] == seen[1]
    keys = [h + (0).to_bytes(4, "big") for h in seen[0][2]]
    assert seen[0][0] == keys[:3]
    assert seen[0][1] == {keys[0]: 1, keys[1]: 2, keys[2]: 3, keys[3]: 4}


@pytest.mark.parametrize("layout", ["full", "full and window"])
@pytest.mark.parametrize("seed", range(4))
def test_the_map_agrees_with_vllms_through_random_steps(seed, layout):
    rnd = random.Random(seed)
    specs = (full(BS),) if layout == "full" else (full(BS), _window(2 * BS))
    sides = [s.m for s in _managers(200, specs)]  # (no eviction: the pools' orders differ there)
    live: dict[str, list[Any]] = {}
    sizes = set()
    for step in range(40):
        random_step(rnd, sides, live, step)
        # the same keys; under a key, no more blocks than vLLM's (a spare emptied at its
        # free holds nothing where vLLM keeps its copy cached: docs/groups.md)
        shapes = [_shape(m) for m in sides]
        assert set(shapes[0]) == set(shapes[1]), f"seed {seed}, step {step}"
        assert all(n <= shapes[1][k] for k, n in shapes[0].items()), f"seed {seed}, step {step}"
        sizes.add(len(shapes[0]))
        sides[0].core.check_invariants()
    assert max(sizes) >= 4


def test_writes_are_refused_and_change_nothing():
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    m = _managers(11)[0].m
    a = _admit(m, "a", list(range(3 * BS + 1)))  # (held, as the engine holds a live request)
    cache = m.block_pool.cached_block_hash_to_block._cache
    key = next(iter(cache))
    mine = copy.copy(cache)
    assert type(mine) is dict and mine == cache
    mine.pop(key)  # (a copy is the caller's own)
    for write in (lambda: cache.pop(key), lambda: cache.__setitem__(key, cache[key]),
                  lambda: cache.__delitem__(key), cache.clear, lambda: cache.update({}),
                  lambda: cache.setdefault(key, None), cache.popitem):
        with pytest.raises(UnsupportedByPrefixKV, match="_cache is read-only"):
            write()
    assert len(m.block_pool.cached_block_hash_to_block._cache) == 3 and a.num_computed_tokens
    assert m.get_computed_blocks(_request("b", list(range(3 * BS + 1)), None))[1] == 3 * BS
    m.core.check_invariants()


def test_a_layout_whose_blocks_show_no_hash_is_refused():
    """(Groups of different block sizes: vLLM keys partial tail entries inside the larger
    blocks; prefixkv's blocks show no hash: an empty map would be a false answer.)"""
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    m = _managers(24, (full(BS), full(2 * BS)), scheduler_block_size=2 * BS)[0].m
    with pytest.raises(UnsupportedByPrefixKV, match="_cache: prefixkv's block objects show no hash here"):
        len(m.block_pool.cached_block_hash_to_block._cache)
