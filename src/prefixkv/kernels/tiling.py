"""Tile sizes of the attention kernel, chosen by a heuristic from shapes alone.

No autotuning: the choice depends only on Python ints known at launch (so the launch
never synchronises and CUDA graphs capture one kernel), and the Triton interpreter,
which cannot autotune over several configs, runs the same code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton

__all__ = ["TileConfig", "choose_tiles", "interpreting"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One launch configuration.

    ``block_m`` rows of a tile are ``block_m // group_p2`` query positions times the
    ``group_p2`` (padded) query heads that share one KV head; ``block_n`` keys per step.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            n = getattr(self, name)
            if n < 16 or n & (n - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {n}")


def choose_tiles(
    *, group: int, head_dim: int, max_seqlen_q: int, on_gpu: bool, elem_bytes: int = 2
) -> TileConfig:
    """Pick tile sizes for a call.

    ``block_m`` covers the query heads of one KV head for as many query positions as fit,
    but no more rows than ``max_seqlen_q`` needs (decode uses a short tile). Starting
    points for the tuning that an H100 run will do; the interpreter prefers few, mid-size
    tiles because its cost is per program and per step. ``elem_bytes`` is the size of one
    q/cache element (4: fp32).

    Register figures below are ``ptxas -v`` for sm_90 with triton 3.9
    (``benchmarks/results/kernels-sm90-compile.md``).
    """
    group_p2 = triton.next_power_of_2(group)
    rows_needed = triton.next_power_of_2(max(1, max_seqlen_q) * group_p2)
    if not on_gpu:
        return TileConfig(block_m=max(group_p2, min(64, max(16, rows_needed))), block_n=32)
    if elem_bytes >= 4:
        # fp32 runs tl.dot in IEEE fp32 on CUDA cores, which holds whole operand rows in
        # registers: 128 x 64 tiles spilled 38 KB per thread, 32 x 16 spills least.
        return TileConfig(block_m=max(group_p2, min(32, max(16, rows_needed))), block_n=16, num_stages=2)
    big = head_dim <= 128
    cap = 128 if big else 64
    block_m = max(group_p2, min(cap, max(16, rows_needed)))
    block_n = 64 if big else 32
    # 8 warps once the fp32 accumulator [block_m, head_dim] passes 64 registers a thread
    # on 4 warps: 64 x 256 on 4 warps used 255 registers and spilled, on 8 warps 187.
    num_warps = 8 if block_m >= 128 or (block_m >= 64 and not big) else 4
    return TileConfig(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=3 if big else 2)
