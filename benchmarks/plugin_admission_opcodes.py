"""Bytecodes and Python calls of the vLLM plug-in's admission and decode step (issue 26.5).

``get_computed_blocks`` + ``allocate_slots`` of a 41-token prompt on the plug-in's
``KVCacheManager`` (one full-attention group, block size 16), then one decode step
(a token appended, ``allocate_slots(request, 1)``): first a miss, then the same prompt
again from another request (a 32-token hit). The prompt is admitted prepared (the
``Prompt`` vLLM's request hasher made, ``prepared_prompts``: the engine's case) and as
ids. Deterministic: counted with ``sys.settrace``, not timed.

    PYTHONPATH=src python benchmarks/plugin_admission_opcodes.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from prefixkv.bench.opcodes import count_opcodes
from prefixkv.integrations.vllm import KVCacheManager

BS = 16


def count(fn: Callable[[], object]) -> tuple[int, int]:
    """Bytecodes (``count_opcodes``) and Python calls ``fn()`` makes, in one run."""
    calls = 0

    def profiler(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profiler)  # (not called for the tracer's own calls)
    try:
        ops = count_opcodes(fn)
    finally:
        sys.setprofile(None)
    return ops, calls - 2  # (less ``count_opcodes`` and ``fn``)


def manager() -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(config, max_model_len=8192, scheduler_block_size=BS, hash_block_size=BS)


def request(m: KVCacheManager, rid: str, tokens: list[int], prepared: bool) -> Request:
    r = Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=4),
                pooling_params=None)
    if prepared:
        m.prepared_prompts.note(r)  # (what the hasher vLLM's request calls does)
    return r


def steps(prepared: bool) -> list[tuple[str, int, int]]:
    m = manager()
    tokens = list(range(100, 141))  # 41 tokens: 2 full blocks and 9
    warm = request(m, "warm", list(range(500, 541)), prepared)  # (first calls: imports, caches)
    blocks, hit, _ = m.get_computed_blocks(warm)
    m.allocate_slots(warm, 41 - hit, hit, blocks)
    out = []
    for rid in ("miss", "hit"):
        r = request(m, rid, tokens, prepared)

        def admit(r: Request = r) -> None:
            blocks, hit, _ = m.get_computed_blocks(r)
            assert m.allocate_slots(r, 41 - hit, hit, blocks) is not None
            r.num_computed_tokens = 41

        def decode(r: Request = r) -> None:
            r.append_output_token_ids(7)
            assert m.allocate_slots(r, 1) is not None
            r.num_computed_tokens += 1

        out.append((f"{rid}: admission", *count(admit)))
        out.append((f"{rid}: decode step", *count(decode)))
    return out


def main() -> None:
    print("| prompt | step | bytecodes | calls |")
    print("|---|---|---:|---:|")
    for prepared in (True, False):
        for name, ops, calls in steps(prepared):
            print(f"| {'prepared' if prepared else 'ids'} | {name} | {ops:,} | {calls} |")


if __name__ == "__main__":
    main()
