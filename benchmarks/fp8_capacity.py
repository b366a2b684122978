"""What an fp8 KV cache buys: twice the blocks in the same bytes, and the hit rate that follows.

1. Blocks per GiB of KV memory for a stated model shape (default: 32 layers, 8 KV heads,
   head_dim 128, block_size 16, i.e. Llama-3.1-8B), for bf16 and fp8 caches. One block
   holds K and V of ``block_size`` tokens in every layer; fp8 scales (per tensor or per
   KV head, per layer) are a few bytes and are left out.
2. The ``pressure`` workload of ``prefixkv bench`` (48 skewed 1024-token prefixes, a pool
   six times too small, so eviction never stops) replayed through ``KVCacheManager``
   with the workload's pool (as a bf16 cache would hold it) and with twice as many blocks
   (the same bytes in fp8): hit rate, prefill tokens computed and saved, preemptions.

Pure Python and CPU; no kernel runs. ``--scale`` shrinks the workload (tests use 0.1).
Writes ``benchmarks/results/fp8-capacity.json`` and ``.md`` (``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kernel_problems import ROOT, git_commit

GIB = 1 << 30
DTYPE_BYTES = {"bfloat16": 2, "float8_e4m3fn": 1}


def block_bytes(*, layers: int, kv_heads: int, head_dim: int, block_size: int, elem_bytes: int) -> int:
    """Bytes of one block across all layers: K and V, ``block_size`` tokens each."""
    return 2 * layers * block_size * kv_heads * head_dim * elem_bytes


def capacity(model: dict) -> dict:
    """Blocks (and tokens) per GiB of KV memory, per cache dtype."""
    out = {}
    for name, elem in DTYPE_BYTES.items():
        size = block_bytes(elem_bytes=elem, **model)
        out[name] = {"block_bytes": size, "blocks_per_gib": GIB // size,
                     "tokens_per_gib": GIB // size * model["block_size"]}
    return out


def pressure_hit_rates(scale: float, seed: int, block_size: int) -> dict:
    """Replay ``pressure`` with its own pool and with twice the blocks."""
    sys.path.insert(0, str(ROOT / "src"))
    from prefixkv.bench.capacity import default_pool_blocks, make_allocator
    from prefixkv.bench.replay import replay
    from prefixkv.bench.workloads import pressure

    wl = pressure(scale, seed)
    pool = default_pool_blocks(wl, block_size)
    rows = {}
    for label, blocks in (("bfloat16", pool), ("float8_e4m3fn", 2 * pool)):
        res = replay(make_allocator("prefixkv", blocks, block_size, wl.max_tokens()), wl, "prefixkv")
        rows[label] = {k: v for k, v in res.to_dict().items()
                       if k in ("pool_blocks", "hit_rate", "prefill_computed", "prefill_saved", "preemptions",
                                "requests", "max_running")}
    return {"workload": wl.name, "description": wl.description, "requests": len(wl.requests), "runs": rows}


def markdown(result: dict) -> str:
    m = result["model"]
    lines = ["# What an fp8 KV cache buys", "",
             f"commit `{result['commit']}`; `benchmarks/fp8_capacity.py`, CPU only (no kernel runs).", "",
             f"## Blocks per GiB ({m['layers']} layers, {m['kv_heads']} KV heads, head_dim {m['head_dim']}, "
             f"block_size {m['block_size']})", "",
             "| cache | bytes per block | blocks per GiB | tokens per GiB |", "|---|---|---|---|"]
    for name, c in result["capacity"].items():
        lines.append(f"| {name} | {c['block_bytes']} | {c['blocks_per_gib']} | {c['tokens_per_gib']} |")
    p = result["pressure"]
    lines += ["", f"## `{p['workload']}` workload (scale {result['scale']}): {p['description']}", "",
              "Same bytes: the bf16 pool, and the fp8 pool with twice its blocks.", "",
              "| cache | pool blocks | hit rate | prefill computed | prefill saved | preemptions |",
              "|---|---|---|---|---|---|"]
    for name, r in p["runs"].items():
        lines.append(f"| {name} | {r['pool_blocks']} | {r['hit_rate']:.1%} | {r['prefill_computed']} | "
                     f"{r['prefill_saved']} | {r['preemptions']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--scale", type=float, default=1.0, help="size of the pressure workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    opts = p.parse_args(argv)
    model = dict(layers=opts.layers, kv_heads=opts.kv_heads, head_dim=opts.head_dim,
                 block_size=opts.block_size)
    result = {"commit": git_commit(), "model": model, "scale": opts.scale, "capacity": capacity(model),
              "pressure": pressure_hit_rates(opts.scale, opts.seed, opts.block_size)}
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    (opts.out_dir / "fp8-capacity.json").write_text(json.dumps(result, indent=2) + "\n")
    (opts.out_dir / "fp8-capacity.md").write_text(md := markdown(result))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
