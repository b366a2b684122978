"""Caches over 2^31 elements: slot and block offsets must be computed in int64.

The 2 x 4 GiB caches are allocated with ``torch.empty`` and only a few blocks are ever
touched, so little of them is resident; they are freed when the test returns (on CUDA,
handed back to the driver too). The blocks used sit past element 2^31, where int32
offsets would wrap. (The test ran in a child process until its torch and triton imports,
~3.5 s of CPU, turned out to be most of its time; the caches never needed one.)
"""

from __future__ import annotations

import pytest

from .conftest import PRIMARY_DEVICE, torch, triton_skip_reason


@pytest.fixture
def big_caches():
    """K and V caches of ``(2^21 + 64) * 16 * 64`` fp16 elements each, freed after the test."""
    num_blocks = 2**21 + 64
    k_cache = torch.empty(num_blocks, 16, 1, 64, dtype=torch.float16, device=PRIMARY_DEVICE)
    caches = [k_cache, torch.empty_like(k_cache)]
    yield caches
    caches.clear()
    del k_cache
    if PRIMARY_DEVICE == "cuda":
        torch.cuda.empty_cache()


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
def test_cache_over_two_to_the_31_elements(big_caches):
    from prefixkv.kernels import (
        build_paged_batch,
        paged_prefill_attention,
        paged_prefill_attention_reference,
        write_kv_cache,
    )

    device = PRIMARY_DEVICE
    k_cache, v_cache = big_caches
    num_blocks, block_size, heads, dim = k_cache.shape
    assert k_cache.numel() > 2**31
    ids = [[num_blocks - 1, 2**21 + 3, 5, num_blocks - 20], [2**21 + 40]]
    cached, new = [40, 3], [14, 4]
    lengths = [a + b for a, b in zip(cached, new, strict=True)]
    batch = build_paged_batch(ids, [0, 0], lengths, block_size, device=device)
    key = torch.randn(batch.slot_mapping.shape[0], heads, dim, device=device).half()
    value = torch.randn_like(key)
    # int32 slots: the kernel itself must widen before multiplying by the block stride
    write_kv_cache(key, value, k_cache, v_cache, batch.slot_mapping.int(), backend="triton")
    assert torch.equal(k_cache[num_blocks - 1, 0], key[0]), "write landed elsewhere"
    assert torch.equal(v_cache[2**21 + 40, 6], value[-1]), "write landed elsewhere"

    step = build_paged_batch(ids, cached, new, block_size, device=device)
    q = torch.randn(sum(new), 4, dim, device=device).half()
    args = (q, k_cache, v_cache, step.block_table, step.cu_seqlens_q, step.seqused_k,
            step.max_seqlen_q, step.max_seqlen_k)
    got = paged_prefill_attention(*args, backend="triton")
    want = paged_prefill_attention_reference(*args)
    torch.testing.assert_close(got, want, atol=5e-3, rtol=1e-2)
