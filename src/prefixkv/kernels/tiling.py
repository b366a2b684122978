"""Tile sizes of the attention kernel, chosen by a heuristic from shapes alone.

No autotuning: the choice depends only on Python ints known at launch (so the launch
never synchronises and CUDA graphs capture one kernel), and the Triton interpreter,
which cannot autotune over several configs, runs the same code path.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import triton

if TYPE_CHECKING:
    import torch

from .workspace import MIN_KEYS_PER_SPLIT

__all__ = ["MIN_KEYS_PER_SPLIT", "TileConfig", "choose_num_splits", "choose_tiles", "gpu_tiles",
           "interpreting", "per_block_ids", "PREFILL_TILE", "sm_count"]

DEFAULT_SM_COUNT = 132  # H100 SXM: the split heuristic's SM count for non-CUDA tensors
MAX_SPLITS = 64
MAX_SPLIT_Q = 16  # splits only for decode-like calls (speculative decode included)


# Programs of a short (decode) tile resident per SM, by (block_m, head_dim rounded up to
# 64/128/256): the lowest blocks/SM of the sm_90 compile reports over bf16, fp16 and fp8
# caches and triton 3.6 and 3.9 (benchmarks/results/kernels-sm90-compile*.md; fp8 decode
# on 3.6 holds 2). The 16 x 128 decode tiles (head_dim 64, 128): 4 and 3 on 3.9, 4 and 2
# on 3.6 (a compile of those configs with triton 3.6.0 on 2026-11-26; the committed 3.6
# report predates the 128-key tile). A test keeps this table at or below the committed
# report. Tiles not listed count 1.
CTAS_PER_SM = {(16, 64): 4, (16, 128): 2, (16, 256): 3, (32, 256): 2}


PER_BLOCK_IDS_FROM = (3, 8)  # first triton that still pipelines K/V loads behind per-block ids


@functools.cache
def version_at_least(version: str, minimum: tuple[int, int]) -> bool:
    """``"3.8.0"`` (or ``"3.8.0+git..."``) is at least ``(3, 8)``; an unreadable version is not."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is not None and tuple(map(int, match.groups())) >= minimum


def per_block_ids(left_window: bool, block_n: int, block_size: int) -> bool:
    """Whether the kernel loads one block id per block of a key tile rather than per key.

    Only when tiles are whole blocks (no left window, so tiles start on multiples of
    ``block_n``, and ``block_n % block_size == 0``) and on triton >= 3.8: on 3.6 and 3.7
    the reshape of the ids into keys stops the software pipeliner (the K/V loads become
    synchronous: 1342 SASS instructions per decode tile instead of 454; sm_90 compile).
    """
    return not left_window and block_n % block_size == 0 and version_at_least(triton.__version__,
                                                                              PER_BLOCK_IDS_FROM)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def gpu_tiles(device: torch.device | str) -> bool:
    """Whether launches on ``device`` take the GPU's tiles (CUDA) or the interpreter's."""
    return getattr(device, "type", None) == "cuda"


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One launch configuration.

    ``block_m`` rows of a tile are ``block_m // group_p2`` query positions times the
    ``group_p2`` (padded) query heads that share one KV head; ``block_n`` keys per step.
    ``num_splits`` key slices per tile (split-KV); None lets :func:`choose_num_splits` pick.
    ``ctas_per_sm``: programs of this config resident on one SM at once (registers and
    shared memory from the sm_90 compile report), which the split heuristic fills.
    ``qk_ahead``: each phase loop issues QK^T of the next key tile before this tile's
    softmax, and the unmasked one also runs PV a pass behind it, so the tensor cores work
    while the softmax runs (``attend._attend_range``); one more ``[block_m, block_n]`` fp32
    tile of registers.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None
    ctas_per_sm: int = 1
    qk_ahead: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            n = getattr(self, name)
            if n < 16 or n & (n - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {n}")
        if self.num_splits is not None and not 1 <= self.num_splits <= 1024:
            raise ValueError(f"num_splits must be None or in 1..1024, got {self.num_splits}")
        if self.ctas_per_sm < 1:
            raise ValueError(f"ctas_per_sm must be >= 1, got {self.ctas_per_sm}")


@functools.cache
def _cuda_sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str) -> int:
    """SMs of a CUDA ``device`` (asked once per device, then cached); ``DEFAULT_SM_COUNT``
    for any other device, so the interpreter and ``meta`` tensors take the H100 choice."""
    if getattr(device, "type", None) != "cuda":
        return DEFAULT_SM_COUNT
    import torch

    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(
    *, batch: int, num_kv_heads: int, max_seqlen_q: int, max_seqlen_k: int, num_sms: int,
    block_q: int = 1, ctas_per_sm: int = 1, causal: bool = True,
) -> int:
    """Key splits per tile (1: no split-KV), from launch shapes only: never reads a tensor.

    The main grid has ``batch * num_kv_heads * ceil(max_seqlen_q / block_q)`` programs at
    most (a request of ``q_len > block_q`` query positions, as when speculative decoding
    verifies several tokens, has several tiles). While they fill fewer than the
    ``num_sms * ctas_per_sm`` slots the GPU can run at once, each tile's keys are split so
    that the splits fill them, as long as a split keeps ``MIN_KEYS_PER_SPLIT`` keys (and
    at most ``MAX_SPLITS``). A causal prefill (``max_seqlen_q > MAX_SPLIT_Q``) never
    splits: its tiles are many. Without ``causal`` every row attends every key, so a call
    of long queries on few tiles splits too (cascade's prefix pass: a group's packed
    decode rows are one or two tiles a KV head over the whole shared prefix).
    """
    programs = batch * num_kv_heads * triton.cdiv(max(1, max_seqlen_q), max(1, block_q))
    slots = num_sms * ctas_per_sm
    if (causal and max_seqlen_q > MAX_SPLIT_Q) or programs == 0 or programs >= slots:
        return 1
    splits: int = min(triton.cdiv(slots, programs), max_seqlen_k // MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    return max(1, splits)


PREFILL_TILE = TileConfig(block_m=256, block_n=128, num_warps=8, num_stages=3)
"""The long-prefill tile of head_dim 65..128 (no window, no LSE), on every triton
version: 256 x 128, 8 warps, 3 stages.

Measured on an H100 with triton 3.6 (run 3, benchmarks/results/tune-nvidia-h100-80gb-hbm3-run3.md):
471.4 TFLOP/s on the SPEC shape, ahead of every 128-row tile by 1.31x or more (128 x 128:
360.5; 128 x 64 with ``qk_ahead``, the tile 3.7+ took until then on the strength of the
static model: 341.9). It spills (1104 B on 3.6: 7 local loads and 6 stores a pass of the
cached-prefix loop; 1580 B on 3.9: 41 and 33, 1808 B since the one-compare causal mask;
sm_90 compile) and still wins: with
``num_stages`` 2 to 4 the K/V ring of every tile is two buffers deep on 3.6 to 3.9, so
a pass waits at its top for the tile loaded in the pass before, and the 256-row tile's
passes, 4x the work of a 128 x 64 pass for 2x the bytes, hide that round trip where
the short passes cannot (``benchmarks/kernel_timing.py``, docs/kernels.md). No triton
>= 3.7 has run on a GPU; the tile is the measured one on the evidence that the
mechanism is the same there. (The choice depended on the version until run 3; a GPU
measuring a deeper ring, ``num_stages`` 5, on 3.7+ may make it so again.)
"""


def choose_tiles(
    *, group: int, head_dim: int, max_seqlen_q: int, on_gpu: bool, elem_bytes: int = 2,
    window: bool = False, return_lse: bool = False, kv_fp8: bool = False,
) -> TileConfig:
    """Pick tile sizes for a call.

    ``block_m`` covers the query heads of one KV head for as many query positions as fit,
    but no more rows than ``max_seqlen_q`` needs (decode uses a short tile). Starting
    points for the tuning that an H100 run will do; the interpreter prefers few, mid-size
    tiles because its cost is per program and per step. ``elem_bytes`` is the size of one
    q/cache element (4: fp32); ``window`` (a sliding window) and ``return_lse`` (or
    split-KV) need registers that the widest tile does not have.

    Register figures below are ``ptxas -v`` for sm_90 with triton 3.9
    (``benchmarks/results/kernels-sm90-compile.md``). Long prefills of head_dim 65..128
    over a 16-bit cache take ``PREFILL_TILE``, whatever the installed triton
    (``kv_fp8``: an fp8 cache keeps 128 x 128; its widening in registers needs more of
    them, and no 256-row tile was measured with it).
    """
    group_p2 = triton.next_power_of_2(group)
    rows_needed = triton.next_power_of_2(max(1, max_seqlen_q) * group_p2)
    if not on_gpu:
        return TileConfig(block_m=max(group_p2, min(64, max(16, rows_needed))), block_n=32)
    long_tile = PREFILL_TILE
    if (elem_bytes == 2 and not kv_fp8 and 64 < head_dim <= 128 and not window and not return_lse
            and rows_needed >= long_tile.block_m >= group_p2):
        return long_tile
    if elem_bytes >= 4:
        # fp32 runs tl.dot in IEEE fp32 on CUDA cores, which holds whole operand rows in
        # registers: 128 x 64 tiles spilled 38 KB per thread, 32 x 16 spills least.
        return TileConfig(block_m=max(group_p2, min(32, max(16, rows_needed))), block_n=16, num_stages=2)
    big = head_dim <= 128
    cap = 128 if big else 64
    block_m = max(group_p2, min(cap, max(16, rows_needed)))
    # 128-key tiles for the 128-row tile of head_dim <= 128: the same MMA work in half the
    # loop passes, 1.3x fewer SASS instructions per key (252 registers, no spills). A left
    # window edge or the LSE output pushes that tile over 255 registers (spills), so those
    # keep 64 keys. Short (decode) tiles take 128 keys too: the fastest decode tile of the
    # H100 tune (triton 3.6, 64 x 8k keys: 1.179x the 16 x 64 tile; 16 x 64 with 2 stages
    # 1.173x) and of split decode (1 x 32k, with 34 splits: 1.411x the 17-split 16 x 64;
    # 64 keys with 34 splits 1.384x), benchmarks/results/tune-nvidia-h100-80gb-hbm3.md;
    # sm_90 compile on 3.9: 147 registers, no spills. (Long prefills take the 256-row
    # tile of PREFILL_TILE above; this is for the rest.)
    wide = block_m >= 128 and not window and not return_lse
    block_n = (128 if wide or block_m <= 16 else 64) if big else 32
    # 8 warps once the fp32 accumulator [block_m, head_dim] passes 64 registers a thread
    # on 4 warps: 64 x 256 on 4 warps used 255 registers and spilled, on 8 warps 187.
    num_warps = 8 if block_m >= 128 or (block_m >= 64 and not big) else 4
    ctas = CTAS_PER_SM.get((block_m, 64 if head_dim <= 64 else 128 if big else 256), 1)
    return TileConfig(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=3 if big else 2,
                      ctas_per_sm=ctas)
