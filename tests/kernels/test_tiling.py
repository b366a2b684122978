"""Tile heuristic: shapes it picks, and that the GPU's picks are correct (run in the interpreter)."""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import tiling
from prefixkv.kernels.tiling import PREFILL_TILE, TileConfig, choose_tiles, per_block_ids, version_at_least

from .cases import check, make_case
from .conftest import PRIMARY_DEVICE


def test_decode_uses_short_tiles_and_prefill_long_ones():
    assert choose_tiles(group=1, head_dim=128, max_seqlen_q=1, on_gpu=True).block_m == 16
    decode = TileConfig(16, 128, 4, 3, ctas_per_sm=2)  # 128 keys: 1.18x over 64 on an H100
    assert choose_tiles(group=4, head_dim=128, max_seqlen_q=1, on_gpu=True) == decode

    long_prefill = choose_tiles(group=4, head_dim=128, max_seqlen_q=2048, on_gpu=True)
    assert long_prefill == PREFILL_TILE
    # A sliding window or the LSE output keep 64 keys (128 spills there).
    assert choose_tiles(group=4, head_dim=128, max_seqlen_q=2048, on_gpu=True, window=True).block_n == 64
    assert choose_tiles(group=4, head_dim=128, max_seqlen_q=2048, on_gpu=True, return_lse=True).block_n == 64
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
    # elem_bytes=4: the case is fp32 (a bf16-sized tile needs 263168 B of shared memory in
    # fp32, over an H100's 232448: the GPU run of 2026-11-26 failed on that).
    config = choose_tiles(group=group, head_dim=head_dim, max_seqlen_q=max(q_lens), on_gpu=True,
                          elem_bytes=4)
    case = make_case(q_lens, kv_lens, num_kv_heads=1, group=group, head_dim=head_dim, block_size=16,
                     device=PRIMARY_DEVICE, seed=head_dim)
    check(case, torch.float32, config=config, window_size=(40, 0))


def test_ctas_per_sm_never_exceeds_the_committed_compile_report():
    """The split heuristic's CTAs per SM are at most the occupancy the sm_90 compile measured."""
    import json
    from pathlib import Path

    import triton

    report = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                         / "kernels-sm90-compile.json").read_text())
    if report["triton"] != triton.__version__:  # the long-prefill tile follows the triton version
        pytest.skip(f"the committed report is for triton {report['triton']}, this is {triton.__version__}")
    rows = [r for r in report["configs"]
            if r["ok"] and r["kind"] == "attn" and r.get("kernel") != "combine"
            and "tiles" not in r]  # a config compiled with tiles of its own, not the heuristic's
    checked = 0
    for r in rows:
        window = r.get("window_size") is not None and r["window_size"][0] >= 0
        elem = 4 if r["dtype"] == "float32" else 2
        tile = choose_tiles(group=r["heads"] // r["kv_heads"], head_dim=r["head_dim"],
                            max_seqlen_q=r["q_len"],
                            on_gpu=True, elem_bytes=elem, window=window,
                            return_lse=r.get("return_lse", False),
                            kv_fp8=r.get("cache_dtype", "").startswith("float8"))
        assert tile.block_m == r["constexprs"]["BLOCK_M"], r["name"]
        assert tile.ctas_per_sm <= r["blocks_per_sm"], (r["name"], tile, r["blocks_per_sm"])
        checked += tile.ctas_per_sm > 1
    assert checked >= 5


def test_per_block_ids_only_for_whole_block_tiles_on_triton_3_8_and_later():
    import triton

    new = version_at_least(triton.__version__, (3, 8))
    assert per_block_ids(False, 64, 16) is new and per_block_ids(False, 128, 128) is new
    assert not per_block_ids(True, 64, 16)  # a left window: tiles start anywhere
    assert not per_block_ids(False, 64, 5) and not per_block_ids(False, 64, 128)
    assert version_at_least("3.8.0+git1234", (3, 8)) and version_at_least("4.0.0", (3, 8))
    assert not version_at_least("3.7.1", (3, 8)) and not version_at_least("dev", (3, 8))


# Measured on an H100 with triton 3.6 (tune-nvidia-h100-80gb-hbm3-run3.md): 471.4 TFLOP/s,
# 1.38x the 128 x 64 tile with QK^T ahead that 3.7+ took before, 1.31x 128 x 128. Every
# version takes it: the two-buffer K/V ring that makes the 128-row tiles lose is emitted
# by 3.6 to 3.9 alike (sm_90 compile).
@pytest.mark.parametrize("version, tile", [
    ("3.6.0", TileConfig(256, 128, 8, 3)),
    ("3.5.1", TileConfig(256, 128, 8, 3)),
    ("3.7.0", TileConfig(256, 128, 8, 3)),
    ("3.9.0", TileConfig(256, 128, 8, 3)),
    ("3.10.0+git5e2f", TileConfig(256, 128, 8, 3)),
])
def test_long_prefill_tile_per_triton_version(monkeypatch, version, tile):
    assert PREFILL_TILE == tile
    monkeypatch.setattr(tiling.triton, "__version__", version)
    spec = dict(group=4, head_dim=128, max_seqlen_q=2048, on_gpu=True)
    assert choose_tiles(**spec) == tile
    assert choose_tiles(**dict(spec, head_dim=80)) == tile  # head_dim 65..128 share the 128-wide tile
    # Where the long tile was neither measured nor compiled, today's choice stays.
    assert choose_tiles(**dict(spec, window=True)) == TileConfig(128, 64, 8, 3)
    assert choose_tiles(**dict(spec, return_lse=True)) == TileConfig(128, 64, 8, 3)
    assert choose_tiles(**dict(spec, head_dim=64)) == TileConfig(128, 128, 8, 3)
    assert choose_tiles(**dict(spec, head_dim=256)).block_m == 64
    assert choose_tiles(**dict(spec, elem_bytes=4)).block_n == 16
    assert choose_tiles(**dict(spec, max_seqlen_q=1)).block_m == 16
    assert not choose_tiles(**dict(spec, on_gpu=False)).qk_ahead
    assert choose_tiles(**dict(spec, kv_fp8=True)) == TileConfig(128, 128, 8, 3)  # 172 B of spills on 3.9
    # a prefill of 128 rows (32 queries x 4 heads) keeps 128 x 128
    assert choose_tiles(**dict(spec, max_seqlen_q=32)) == TileConfig(128, 128, 8, 3)
