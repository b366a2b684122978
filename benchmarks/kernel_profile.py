"""Launch the SPEC prefill with named tiles, for Nsight Compute (``ncu``) to profile.

    python benchmarks/kernel_profile.py --tile 256x128 [--launches 3] [--smoke]
    ncu --kernel-name _paged_prefill_kernel --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight ... python benchmarks/kernel_profile.py --tile 128x64-qk

Each run launches one tile ``--launches`` times (the first compiles; ncu skips it) and
prints the median ms of triton's ``do_bench`` for it afterwards, so a profile and a timing
of the same tile sit side by side. The tiles are the ones the H100 tune ranked
(benchmarks/results/tune-nvidia-h100-80gb-hbm3-run3.md): the 256-row pick, the 128 x 64
tile with QK^T ahead (triton 3.7+'s pick until run 3), the same 128-row tiles without it,
and two with a three-deep K/V ring (5 stages, not yet measured). ``--smoke``: tiny shapes
through the Triton interpreter on a CPU (the script works; nothing to read).
"""

from __future__ import annotations

import argparse
import sys

from kernel_problems import SMOKE, SPEC_PREFILL, Timer, make_problem, open_session, prefill_flops, with_device

TILES = {
    "256x128": dict(block_m=256, block_n=128, num_warps=8, num_stages=3),
    "128x64-qk": dict(block_m=128, block_n=64, num_warps=8, num_stages=3, qk_ahead=True),
    "128x64": dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
    "128x128": dict(block_m=128, block_n=128, num_warps=8, num_stages=3),
    "64x64": dict(block_m=64, block_n=64, num_warps=4, num_stages=2),  # the tune's best 4-warp tile
    # A K/V ring three buffers deep (loads two tiles ahead; stages 2-4 give two): docs/kernels.md,
    # "Why the 256-row tile wins"; the tune times them too (tune_kernels.DEEP_RING).
    "128x64-qk-s5": dict(block_m=128, block_n=64, num_warps=8, num_stages=5, qk_ahead=True),
    "128x128-s5": dict(block_m=128, block_n=128, num_warps=8, num_stages=5),
}
SMOKE_TILES = {name: dict(block_m=16, block_n=32, num_warps=4, num_stages=2) for name in TILES}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tile", choices=sorted(TILES), required=True)
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shapes through the Triton interpreter (CPU ok)")
    opts = p.parse_args(argv)
    session = open_session("kernel_profile", opts.smoke)
    if session is None:
        return 2
    torch, kernels, cuda, _meta, _slug = session
    from prefixkv.kernels.attention import paged_prefill_attention_triton
    from prefixkv.kernels.tiling import TileConfig

    shape = dict(SPEC_PREFILL) if not opts.smoke else dict(SMOKE, batch=2, prefix=48, q_len=16)
    args, _ids = make_problem(torch, kernels, **with_device(shape, "cuda" if cuda else "cpu", torch))
    config = TileConfig(num_splits=1, **(SMOKE_TILES if opts.smoke else TILES)[opts.tile])
    out = torch.empty_like(args[0])
    for _ in range(opts.launches):
        paged_prefill_attention_triton(*args, out=out, config=config)
    if cuda:
        torch.cuda.synchronize()
    ms = Timer(cuda, warmup=5, rep=30)(lambda: paged_prefill_attention_triton(*args, out=out, config=config))
    print(f"tile {opts.tile} {config}: {ms:.3f} ms, {prefill_flops(shape) / ms / 1e9:.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
