"""Bytecodes of the vLLM plug-in's ``KVCacheBlock.block_hash`` reads (block_hash_view.py)
and of ``free`` beside them: deterministic (``count_opcodes``), not timed.

One full-attention group, block size 16, ``--live`` requests of ``--blocks`` full
blocks each (noted, as vLLM's request hasher does, admitted, computed). Rows:

- ``first read, oldest`` / ``newest``: the first read of a block of the request noted
  first / last (nothing read before: the scan over the noted requests);
- ``new block read`` (per read): each request computes one block more (a decode step
  filling it), then that block's hash is read, request by request: what a connector
  asking each step's new blocks pays;
- ``free`` (per request, over 2 x 64 + 8 requests: the kept requests' notes amortized
  in): each request freed after its admission, nothing read;
- ``hit admission after its free``: the first of those prompts admitted again (a hit
  on the blocks its free left cached);
- ``read after free``: the first read of a block whose request went.

    PYTHONPATH=src python benchmarks/plugin_block_hash_reads.py [--live 4 64] [--blocks 8]
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from prefixkv.bench.opcodes import count_opcodes
from prefixkv.integrations.vllm import KVCacheManager
from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

BS = 16


def _count(fn: Callable[[], object]) -> int:
    gc.disable()  # (a collection's callbacks would be counted)
    try:
        return count_opcodes(fn)
    finally:
        gc.enable()


def _manager(num_blocks: int) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(config, max_model_len=8192, scheduler_block_size=BS, hash_block_size=BS)


def _request(m: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    from vllm.utils.hashing import sha256

    r = Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=4),
                pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256))
    m.prepared_prompts.note(r)  # (what the hasher vLLM's request calls does)
    return r


def _admit(m: KVCacheManager, r: Request) -> None:
    blocks, hit, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, r.num_tokens


def _live(live: int, blocks: int) -> tuple[KVCacheManager, list[Request]]:
    m = _manager(live * (blocks + 4) + 2 * 64 * 2 + 64)
    reqs = [_request(m, f"l{i}", [10_000 * (i + 1) + t for t in range(blocks * BS)]) for i in range(live)]
    for r in reqs:
        _admit(m, r)
    return m, reqs


def rows(live: int, blocks: int) -> list[tuple[str, int]]:
    from vllm.utils.hashing import sha256

    init_none_hash(sha256)
    out = []
    for which, at in (("oldest", 0), ("newest", -1)):
        m, reqs = _live(live, blocks)
        block = m.get_blocks(reqs[at].request_id).blocks[0][blocks // 2]
        out.append((f"first read, {which}", _count(lambda b=block: b.block_hash)))
    m, reqs = _live(live, blocks)
    assert m.get_blocks(reqs[0].request_id).blocks[0][0].block_hash  # (the view's first scan done)
    total = 0
    for _ in range(2):  # (two steps: a block each request)
        for r in reqs:
            for _t in range(BS):
                r.append_output_token_ids(7)
                assert m.allocate_slots(r, 1) is not None
                r.num_computed_tokens += 1
        for r in reqs:
            block = m.get_blocks(r.request_id).blocks[0][r.num_computed_tokens // BS - 1]
            total += _count(lambda b=block: b.block_hash)
    out.append(("new block read (per read)", total // (2 * live)))
    m, _ = _live(0, blocks)
    n, total = 2 * 64 + 8, 0
    first = None
    for i in range(n):
        r = _request(m, f"f{i}", [7 * (i + 1)] * (blocks * BS))
        _admit(m, r)
        if first is None:
            first = m.get_blocks(r.request_id).blocks[0][0]
        r.status = RequestStatus.FINISHED_STOPPED
        total += _count(lambda r=r: m.free(r))
        del r
    out.append(("free (per request)", total // n))
    again = _request(m, "again", [7] * (blocks * BS))  # (the first freed request's prompt)
    out.append(("hit admission after its free", _count(lambda: _admit(m, again))))
    assert first is not None
    try:
        out.append(("read after free", _count(lambda: first.block_hash)))
    except UnsupportedByPrefixKV:  # (before its request was kept: refused)
        out.append(("read after free (refused)", -1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--live", type=int, nargs="+", default=[4, 64])
    p.add_argument("--blocks", type=int, default=8)
    a = p.parse_args()
    table: dict[str, list[Any]] = {}
    for live in a.live:
        for name, ops in rows(live, a.blocks):
            table.setdefault(name, []).append(ops)
    print("| read | " + " | ".join(f"{n} live" for n in a.live) + " |")
    print("|---|" + "---:|" * len(a.live))
    for name, counts in table.items():
        print(f"| {name} | " + " | ".join(f"{c:,}" for c in counts) + " |")


if __name__ == "__main__":
    main()
