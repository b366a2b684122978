"""Tile heuristic: shapes it picks, and that the GPU's picks are correct (run in the interpreter)."""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels.tiling import TileConfig, choose_tiles

from .cases import check, make_case
from .conftest import PRIMARY_DEVICE


def test_decode_uses_short_tiles_and_prefill_long_ones():
    assert choose_tiles(group=1, head_dim=128, max_seqlen_q=1, on_gpu=True).block_m == 16
    assert choose_tiles(group=4, head_dim=128, max_seqlen_q=1, on_gpu=True).block_m == 16
    assert choose_tiles(group=4, head_dim=128, max_seqlen_q=2048, on_gpu=True) == TileConfig(128, 64, 8, 3)
    assert choose_tiles(group=4, head_dim=256, max_seqlen_q=2048, on_gpu=True).block_m == 64
    # The group's heads always fit in one tile, even past the usual cap.
    assert choose_tiles(group=32, head_dim=64, max_seqlen_q=1, on_gpu=False).block_m == 32


@pytest.mark.parametrize("block_m, block_n", [(15, 32), (64, 8), (48, 64)])
def test_tile_config_rejects_sizes_tl_dot_cannot_take(block_m, block_n):
    with pytest.raises(ValueError, match="power of two >= 16"):
        TileConfig(block_m, block_n)


@pytest.mark.parametrize("head_dim, group, q_lens, kv_lens", [
    (128, 4, [70, 1], [97, 54]),
    (256, 2, [33], [80]),
    (96, 8, [1, 1], [130, 5]),
])
def test_gpu_tiles_are_correct(needs_triton, head_dim, group, q_lens, kv_lens):
    """The configs an H100 would use, checked here even without one."""
    config = choose_tiles(group=group, head_dim=head_dim, max_seqlen_q=max(q_lens), on_gpu=True)
    case = make_case(q_lens, kv_lens, num_kv_heads=1, group=group, head_dim=head_dim, block_size=16,
                     device=PRIMARY_DEVICE, seed=head_dim)
    check(case, torch.float32, config=config, window_size=(40, 0))
