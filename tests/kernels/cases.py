"""Random paged-attention problems for the kernel tests, with poisoned unused memory."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixkv.kernels import build_block_table, build_cu_seqlens_q, paged_prefill_attention_reference


@dataclass
class PagedCase:
    """One batch: paged caches plus a dense per-request copy of the same K/V."""

    q: torch.Tensor  # [total_q, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [batch, max_blocks] int32, padded with a poisoned block id
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]
    dense_k: list[torch.Tensor] = field(default_factory=list)  # each [kv_len, num_kv_heads, head_dim]
    dense_v: list[torch.Tensor] = field(default_factory=list)

    @property
    def args(self) -> tuple:
        """Positional arguments of ``paged_prefill_attention``."""
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.cu_seqlens_q,
                self.seqused_k, max(self.q_lens, default=0), max(self.kv_lens, default=0))


def make_case(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    extra_columns: int = 2,
) -> PagedCase:
    """Build a batch whose blocks are shuffled over the pool.

    Unused blocks, the unused tail of each last block and the block-table padding (which
    points at an unused block) are NaN, so any read outside a request's keys shows up.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(need) + spare_blocks + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    poison_block = perm.pop()
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    ids, dense_k, dense_v = [], [], []
    for n_keys, n_blk in zip(kv_lens, need, strict=True):
        blocks, perm = perm[:n_blk], perm[n_blk:]
        ids.append(blocks)
        k = torch.randn(n_keys, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n_keys, num_kv_heads, head_dim, generator=gen)
        for j in range(n_keys):
            k_cache[blocks[j // block_size], j % block_size] = k[j]
            v_cache[blocks[j // block_size], j % block_size] = v[j]
        dense_k.append(k.to(dtype))
        dense_v.append(v.to(dtype))
    width = max(need, default=0) + extra_columns
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    return PagedCase(
        q=q.to(dtype).to(device),
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        block_table=build_block_table(ids, max_blocks=max(width, 1), pad_id=poison_block, device=device),
        cu_seqlens_q=build_cu_seqlens_q(q_lens, device=device),
        # built directly: tests also need kv_len < q_len, which build_seqused_k rejects
        seqused_k=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        q_lens=list(q_lens),
        kv_lens=list(kv_lens),
        dense_k=[t.to(device) for t in dense_k],
        dense_v=[t.to(device) for t in dense_v],
    )


def tolerance(dtype: torch.dtype) -> dict:
    """``torch.testing.assert_close`` tolerances for outputs of ``dtype``."""
    return {
        torch.float32: dict(atol=2e-4, rtol=2e-4),
        torch.float16: dict(atol=5e-3, rtol=1e-2),
        torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    }[dtype]


def check(case, dtype, config=None, **options):
    """Run both backends on ``case`` and compare outputs and LSE."""
    from prefixkv.kernels.attention import paged_prefill_attention_triton  # imports triton

    got, got_lse = paged_prefill_attention_triton(*case.args, return_lse=True, config=config, **options)
    want, want_lse = paged_prefill_attention_reference(*case.args, return_lse=True, **options)
    assert not got.isnan().any(), "NaN in the output: a masked or unused key leaked"
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))
    torch.testing.assert_close(got_lse, want_lse, **tolerance(dtype))
