"""A connector asking the pool about every block of a long request, per step: prefixkv's
plug-in pool view (``block_pool.get_cached_block``, integrations/vllm/block_hashes.py)
beside vLLM 0.33's own ``BlockPool``, in one run.

vLLM's SimpleCPUOffload (``_cached_gpu_block``) and the aux-output connector
(``max_cache_hit``, ``request_finished``) ask ``get_cached_block(hash, [group])`` of a
request's blocks one at a time. Each side builds a ``--tokens``-token request (its
blocks hashed by vLLM's hasher, xxhash; prefixkv's through its preparing hasher, as its
engine does), computes and caches it, then runs the connector's loop: every block hash
of the request, each group in turn, ``--passes`` times (one pass is one step). Reported:
the loop's wall time per pass (first pass and the best later one; load varies: say
``uptime``), and the bytecodes (``sys.settrace``, deterministic) of one call on the first
block, the middle one and the last, after the passes. The answers are checked equal
(None or a block of the same id) on both sides.

    PYTHONPATH=src python benchmarks/bench_pool_view.py [--tokens 32768] [--passes 3]
        [--layout full|window]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import xxhash
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request, RequestStatus

from prefixkv.bench.opcodes import count_opcodes
from prefixkv.integrations.vllm import KVCacheManager

BS = 16
init_none_hash(xxhash)
HASHER = get_request_block_hasher(BS, xxhash)


def config(layout: str, num_blocks: int) -> KVCacheConfig:
    specs: list[Any] = [FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)]
    if layout == "window":
        specs.append(SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                       sliding_window=8 * BS))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])


def side(cls: type, layout: str, tokens: list[int]) -> tuple[Any, Request, int]:
    """A manager of ``cls`` with one request of ``tokens`` computed and cached; its
    number of groups."""
    groups = 2 if layout == "window" else 1
    n = len(tokens)
    m = cls(config(layout, groups * (n // BS + 8)), max_model_len=n + BS, scheduler_block_size=BS,
            hash_block_size=BS, enable_caching=True)
    hasher = m.prepared_prompts.hasher(HASHER) if cls is KVCacheManager else HASHER
    r = Request("r", tokens, SamplingParams(max_tokens=4), None, block_hasher=hasher)
    blocks, hit, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, n - hit, hit, blocks) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, n
    m.cache_blocks(r, n)
    return m, r, groups


def ask_all(m: Any, r: Request, groups: int) -> list[int | None]:
    """The connector's loop: every block of ``r``, each group, one call each."""
    get = m.block_pool.get_cached_block
    out: list[int | None] = []
    for h in r.block_hashes:
        for g in range(groups):
            blocks = get(h, [g])
            out.append(None if not blocks else blocks[0].block_id)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--layout", choices=("full", "window"), default="full")
    a = p.parse_args()
    tokens = [(i * 7919) % 50_000 for i in range(a.tokens)]
    rows = []
    answers = []
    for name, cls in (("prefixkv", KVCacheManager), ("vLLM 0.33", VllmManager)):
        m, r, groups = side(cls, a.layout, tokens)
        times = []
        for _ in range(a.passes):
            t = time.perf_counter()
            got = ask_all(m, r, groups)
            times.append(time.perf_counter() - t)
        answers.append(got)
        get, hashes = m.block_pool.get_cached_block, r.block_hashes
        ops = [count_opcodes(lambda get=get, h=hashes[j]: get(h, [0]))
               for j in (0, len(hashes) // 2, len(hashes) - 1)]
        rows.append((name, len(got), times[0], min(times[1:] or times), ops))
    assert answers[0] == answers[1], "the two pools answer differently"
    print(f"{a.tokens} tokens, {a.layout}, {a.passes} passes of every block hash x group")
    print("| pool | calls a pass | first pass ms | best later pass ms "
          "| bytecodes: first / middle / last block |")
    print("|---|---:|---:|---:|---|")
    for name, calls, first, best, ops in rows:
        print(f"| {name} | {calls} | {first * 1e3:,.1f} | {best * 1e3:,.1f} | "
              f"{' / '.join(f'{o:,}' for o in ops)} |")


if __name__ == "__main__":
    main()
