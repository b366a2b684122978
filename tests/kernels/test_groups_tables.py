"""Per-group block tables from ``HybridKVCacheManager`` driven through the kernels.

Each group has its own K/V cache (indexed by the shared pool's block ids), all NaN at
first, and the null block (the filler of released positions) is poisoned with NaN
again before every step: a read of any slot never written, or of the null block, turns
the output into NaN. The attention of each group, with its ``window_size``, must equal
attention over the request's whole K/V laid out densely, on both backends. K/V of a
position are a function of the group and the prefix up to it, so hits are checked too.
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window
from prefixkv.kernels import (
    build_paged_batch,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    write_kv_cache,
)

from .conftest import PRIMARY_DEVICE, triton_skip_reason

BS, HEADS, DIM, NUM_BLOCKS = 4, 2, 8, 40
GROUPS = (full_attention(), sliding_window(6))


def kv_of(g: int, prefix: tuple[int, ...]) -> torch.Tensor:
    """``[2, HEADS, DIM]``: the K and V of the last position of ``prefix`` in group g."""
    gen = torch.Generator().manual_seed(hash((g, prefix)) & 0x7FFFFFFF)
    return torch.randn(2, HEADS, DIM, generator=gen)


def dense_attention(g, spec, tokens, start, stop, q):
    """Attention of queries ``start..stop-1`` over every key, contiguous, no release."""
    kv = torch.stack([kv_of(g, tuple(tokens[:p + 1])) for p in range(stop)])  # [stop, 2, H, D]
    n_blk = -(-stop // BS)
    k = torch.zeros(n_blk * BS, HEADS, DIM)
    v = torch.zeros(n_blk * BS, HEADS, DIM)
    k[:stop], v[:stop] = kv[:, 0], kv[:, 1]
    table = torch.arange(n_blk, dtype=torch.int32)[None]
    cu = torch.tensor([0, stop - start], dtype=torch.int32)
    return paged_prefill_attention_reference(
        q, k.view(n_blk, BS, HEADS, DIM), v.view(n_blk, BS, HEADS, DIM), table, cu,
        torch.tensor([stop], dtype=torch.int32), stop - start, stop, window_size=spec.window_size)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_released_blocks_are_never_read_and_every_group_matches_dense_attention(backend):
    if backend == "triton" and triton_skip_reason():
        pytest.skip(triton_skip_reason())
    m = HybridKVCacheManager(GROUPS, NUM_BLOCKS, BS, seed=0)
    nan = float("nan")
    dev = PRIMARY_DEVICE if backend == "triton" else "cpu"  # CUDA tensors for Triton on a GPU machine
    caches = [tuple(torch.full((NUM_BLOCKS, BS, HEADS, DIM), nan, device=dev) for _ in range(2))
              for _ in GROUPS]
    tokens: dict[str, list[int]] = {}
    gen = torch.Generator().manual_seed(7)

    def step(rid, start, stop):
        for k, v in caches:
            k[m.null_block_id], v[m.null_block_id] = nan, nan
        for g, (spec, ids) in enumerate(zip(GROUPS, m.get_block_ids(rid), strict=True)):
            batch = build_paged_batch([ids], [start], [stop - start], BS, device=dev)
            kv = torch.stack([kv_of(g, tuple(tokens[rid][:p + 1])) for p in range(start, stop)]).to(dev)
            k_cache, v_cache = caches[g]
            write_kv_cache(kv[:, 0], kv[:, 1], k_cache, v_cache, batch.slot_mapping, backend=backend)
            q = torch.randn(stop - start, HEADS, DIM, generator=gen)
            out = paged_prefill_attention(
                q.to(dev), k_cache, v_cache, batch.block_table, batch.cu_seqlens_q, batch.seqused_k,
                batch.max_seqlen_q, batch.max_seqlen_k, window_size=spec.window_size, backend=backend)
            assert not out.isnan().any(), (g, start, stop)
            torch.testing.assert_close(out.cpu(), dense_attention(g, spec, tokens[rid], start, stop, q))

    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    tokens["a"] = list(prompt)
    adm = m.add_request("a", prompt, num_new_tokens=9)
    step("a", 0, 9)
    m.extend("a", 5)
    step("a", 9, 14)
    for tok in (2, 3, 8, 4, 6, 2):
        n = len(tokens["a"])
        tokens["a"].append(tok)
        m.append_tokens("a", [tok])
        step("a", n, n + 1)
    assert m.null_block_id in m.get_block_ids("a")[1]  # the window released blocks
    # a second request hits a's prefix: full group all of it, sliding group its window
    tokens["b"] = tokens["a"][:17] + [1, 1]
    adm = m.add_request("b", tokens["b"])
    assert adm.num_cached_tokens == 16 and adm.group_block_ids[1][:2] == (m.null_block_id,) * 2
    step("b", 16, 19)
    m.check_invariants()
