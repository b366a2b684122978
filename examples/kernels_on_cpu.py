"""prefixkv's Triton kernels on a CPU, in Triton's interpreter: the scheduler's block ids
through ``build_paged_batch`` into ``write_kv_cache`` and ``paged_prefill_attention``,
checked against the pure-torch reference, which is also what runs on a CPU by default.

    python examples/kernels_on_cpu.py

What an engine author can run before a GPU is at hand. ``TRITON_INTERPRET=1`` must be
set before triton is imported, so this script sets it first; the interpreter runs every
program in NumPy (a few seconds here). On CUDA tensors the same calls run compiled, and
without the variable ``backend="triton"`` on CPU tensors raises ``BackendError``.

Two requests share a 32-token prefix (two blocks of 16): ``a`` computed it in step 1;
in step 2 ``b`` is admitted, hits those blocks, and computes only its own 9 tokens,
while ``a`` decodes one token. Blocks nobody wrote hold NaN: a result that read one
would be NaN.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import torch  # noqa: E402 (after the variable, on purpose)

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.kernels import build_paged_batch, paged_prefill_attention, write_kv_cache  # noqa: E402

BLOCK, NUM_BLOCKS, HEADS, KV_HEADS, DIM = 16, 8, 4, 2, 64  # GQA: 2 query heads per KV head


def step(backend: str, k_cache: torch.Tensor, v_cache: torch.Tensor,
         batch: list[tuple[tuple[int, ...], int, int]], gen: torch.Generator) -> torch.Tensor:
    """One forward pass of one attention layer. ``batch``: per request its block ids,
    tokens already in the cache and new tokens. Returns ``[total_new, HEADS, DIM]``."""
    meta = build_paged_batch([ids for ids, _, _ in batch], [done for _, done, _ in batch],
                             [new for _, _, new in batch], BLOCK)
    total = sum(new for _, _, new in batch)
    k, v = (torch.randn(total, KV_HEADS, DIM, generator=gen) for _ in range(2))
    q = torch.randn(total, HEADS, DIM, generator=gen)
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend=backend)  # all new K/V first,
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_table,  # then attention
                                   meta.cu_seqlens_q, meta.seqused_k, meta.max_seqlen_q,
                                   meta.max_seqlen_k, backend=backend)


def run(backend: str) -> list[torch.Tensor]:
    """Both steps on a fresh cache with the given backend; the attention outputs."""
    mgr = KVCacheManager(NUM_BLOCKS, BLOCK, seed=0)
    k_cache = torch.full((NUM_BLOCKS, BLOCK, KV_HEADS, DIM), float("nan"))  # [blocks, slots, heads, dim]
    v_cache = torch.full_like(k_cache, float("nan"))
    gen = torch.Generator().manual_seed(0)  # the same "model" for both backends
    shared = list(range(1000, 1032))

    a = mgr.add_request("a", [*shared, 1, 2, 3])  # step 1: a computes all 35 tokens
    assert a is not None and a.num_cached_tokens == 0
    out1 = step(backend, k_cache, v_cache, [(a.block_ids, 0, a.num_new_tokens)], gen)
    mgr.take_kv_ops()  # ends the step (no copies owed here)

    assert mgr.append_tokens("a", [7]) == ()  # step 2: a decodes its sampled token,
    b = mgr.add_request("b", [*shared, *range(9)])  # b hits the shared two blocks
    assert b is not None and b.num_cached_tokens == 32 and b.block_ids[:2] == a.block_ids[:2]
    batch = [(mgr.get_block_ids("a"), 35, 1), (b.block_ids, b.num_cached_tokens, b.num_new_tokens)]
    out2 = step(backend, k_cache, v_cache, batch, gen)
    mgr.take_kv_ops()
    mgr.check_invariants()
    return [out1, out2]


def main() -> None:
    triton_out, torch_out = run("triton"), run("torch")
    for i, (t, r) in enumerate(zip(triton_out, torch_out, strict=True), start=1):
        assert not t.isnan().any(), "the kernel read a slot nobody wrote"
        err = (t - r).abs().max().item()
        assert err < 1e-4, f"step {i}: triton and the torch reference differ by {err}"
        print(f"step {i}: {t.shape[0]} new tokens, triton (interpreted) vs torch reference: "
              f"max |diff| {err:.2e}")


if __name__ == "__main__":
    main()
