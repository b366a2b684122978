"""Fetch or compute: where a store hit starts to pay, for stated models and GPUs.

A fetch of n tokens' KV costs ``latency + n x bytes_per_token / bandwidth``; computing
them costs ``n x flops_per_token / (TFLOP/s)`` (linear: attention's growth with the
prefix is left out, which favours computing). The latency and bandwidth are measured
here (a store fetch through prefixkv from the bench's redis-server: a round trip of one
small block, then 2 MiB blocks) and, for comparison, stated for networks the fleet may
have. The crossover is ``FetchCost.crossover_tokens``: above it a hit is worth fetching;
"never" when the store moves a token's KV slower than the GPU computes it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..core.manager import KVCacheManager
from ..results import StorePut, StoreWait
from .cost import PrefillCost

MODELS = (  # name, layers, kv heads, head dim (bf16 KV), GFLOP per prefill token
    ("Llama-3.2-1B-like", 16, 8, 64, 2.5),
    ("Llama-3-8B-like", 32, 8, 128, 2 * PrefillCost().linear_params / 1e9),
    ("Llama-3-70B-like", 80, 8, 128, 140.0),
)
TFLOPS = 400.0
"""The GPU's prefill throughput (an H100 at about 40% of its bf16 peak)."""
NETWORKS = (("10 GB/s (a 100 Gb/s link)", 1e9 * 10, 0.0005), ("25 GB/s (RDMA)", 25e9, 0.0002))
"""Stated networks: name, bandwidth (bytes/s), latency (s)."""
BIG = 2 << 20
BLOCKS = 16


def _fetch_seconds(backend: Any, block_bytes: int, blocks: int) -> float:
    """Seconds from a fetch's start to its landing: ``blocks`` blocks of ``block_bytes``
    written to the store, then fetched by a fresh manager into attached host memory."""
    from ..store import FetchCost, SharedStore, StoreLayout, encode_value
    layout = StoreLayout(f"bench-cost-{uuid.uuid4().hex}", "stand-in", block_bytes)
    shared = SharedStore(backend, layout, cost=FetchCost(1.0), max_fetch=blocks, timeout=30.0)
    prompt = [(7 * i + 11) % 30000 + 1 for i in range(16 * blocks + 1)]
    w = KVCacheManager(blocks + 1, 16, hash_mode="sha256", host_blocks=1,
                       store=SharedStore(backend, layout))
    w.add_request("w", prompt, read_cache=False)
    w.take_kv_ops()
    payload = bytes(block_bytes)
    for op in w.take_kv_ops():
        if isinstance(op, StorePut):
            backend.put([(op.key, encode_value(op.head, payload))])
    m = KVCacheManager(blocks + 2, 16, hash_mode="sha256", host_blocks=blocks, store=shared)
    memory = memoryview(bytearray(block_bytes * blocks))
    m.attach_host_memory([[memory[i * block_bytes:(i + 1) * block_bytes]] for i in range(blocks)])
    t = time.perf_counter()
    adm = m.add_request("r", prompt)
    while isinstance(adm, StoreWait):
        time.sleep(0.0002)
        if "r" in m.poll_store():
            adm = m.add_request("r", prompt)
    seconds = time.perf_counter() - t
    shared.close()
    if adm is None or adm.num_cached_tokens != 16 * blocks:
        raise RuntimeError("the cost measurement's fetch did not find its blocks")
    return seconds


def run_store_cost(backend: Any) -> dict[str, Any]:
    """Measure this store's latency and bandwidth; the crossovers for ``MODELS``."""
    from ..store import FetchCost
    latency = min(_fetch_seconds(backend, 4096, 1) for _ in range(3))
    big = min(_fetch_seconds(backend, BIG, BLOCKS) for _ in range(2))
    bandwidth = BIG * BLOCKS / max(big - latency, 1e-6)
    networks = [("this machine, measured", bandwidth, latency), *NETWORKS]
    rows = []
    for name, layers, kv, hd, gflop in MODELS:
        bpt = 2 * layers * kv * hd * 2
        tps = TFLOPS * 1e12 / (gflop * 1e9)
        cross = [FetchCost(tps, latency=lat, bandwidth=bw).crossover_tokens(bpt)
                 for _, bw, lat in networks]
        rows.append({"model": name, "bytes_per_token": bpt, "gflop_per_token": gflop,
                     "compute_us_per_token": 1e6 / tps,
                     "fetch_us_per_token": [1e6 * bpt / bw for _, bw, _ in networks],
                     "crossover_tokens": cross})
    return {"latency_s": latency, "bandwidth": bandwidth, "tflops": TFLOPS,
            "networks": [n for n, _, _ in networks], "rows": rows}


def cost_table(data: dict[str, Any]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Columns and rows of the crossover table."""
    nets = data["networks"]
    cols = ("model", "KiB/token", "GFLOP/token", "compute us/token",
            *[f"fetch us/token, {n}" for n in nets], *[f"fetch wins above, {n}" for n in nets])
    rows = [(r["model"], f"{r['bytes_per_token'] / 1024:g}", f"{r['gflop_per_token']:.1f}",
             f"{r['compute_us_per_token']:.1f}", *[f"{x:.1f}" for x in r["fetch_us_per_token"]],
             *["never" if c is None else f"{c:,.0f} tokens" for c in r["crossover_tokens"]])
            for r in data["rows"]]
    return cols, rows


def cost_note(data: dict[str, Any]) -> str:
    return (f"fetch or compute: this machine's store measured {data['latency_s'] * 1e3:.2f} ms a "
            f"round trip and {data['bandwidth'] / 2**20:,.0f} MiB/s for 2 MiB blocks (a prefixkv "
            f"fetch into host memory, checked); prefill at an assumed {data['tflops']:g} TFLOP/s "
            f"(linear FLOPs only); other networks are stated, not measured")
