"""A model runner for layer groups: each layer belongs to a group (full attention or a
sliding window) and reads its K/V through that group's block table from
``prefixkv.groups.HybridKVCacheManager``, with the group's ``window_size``.

Per step and per group, one ``build_paged_batch`` over the entries' block ids of that
group; each layer writes the batch's new K/V into its own cache through its group's slot
mapping, then attends. Released positions of a windowed group's table hold the manager's
null block, which no query reads (with ``poison=True`` every cache starts as NaN, so a
read of the null block or of any unwritten slot would show). Also the oracle:
``dense_windowed_attention`` computes each layer without any cache.
Needs torch; imported as ``prefixkv.engine.hybrid``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from prefixkv.groups import GroupBlockCopy, GroupSpec
from prefixkv.kernels import build_paged_batch, paged_prefill_attention, write_kv_cache

from .model import AttentionFn, TinyLlama


@dataclass(frozen=True, slots=True)
class HybridEntry:
    """One sequence's share of a step: its block ids per group, how many of its tokens
    are already in the cache, and the token ids computed now (at least one)."""

    group_block_ids: Sequence[Sequence[int]]
    num_computed: int
    new_token_ids: Sequence[int]


class HybridModelRunner:
    """Runs ``model`` whose layer ``l`` belongs to group ``layer_groups[l]`` of
    ``groups``, over per-layer caches ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    Raises ValueError when ``layer_groups`` does not name a group for every layer, and
    ConfigError for a chunked local group (the kernels take a (left, right) window)."""

    def __init__(self, model: TinyLlama, groups: Sequence[GroupSpec], layer_groups: Sequence[int],
                 num_blocks: int, block_size: int, *, backend: str | None = None,
                 poison: bool = True) -> None:
        cfg = model.cfg
        if len(layer_groups) != cfg.num_layers or not all(0 <= g < len(groups) for g in layer_groups):
            raise ValueError(f"layer_groups must give one of {len(groups)} groups for each of "
                             f"{cfg.num_layers} layers, got {list(layer_groups)}")
        self.windows = [groups[g].window_size for g in layer_groups]
        self.model = model
        self.groups = tuple(groups)
        self.layer_groups = tuple(layer_groups)
        self.block_size = block_size
        self.backend = backend
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        fill = float("nan") if poison else 0.0
        self.k_cache = torch.full(shape, fill, dtype=cfg.dtype)
        self.v_cache = torch.full(shape, fill, dtype=cfg.dtype)

    def copy_blocks(self, copies: Sequence[GroupBlockCopy]) -> None:
        """Copy each ``src`` block into ``dst`` in the layers of its group."""
        for c in copies:
            layers = [l for l, g in enumerate(self.layer_groups) if g == c.group_idx]
            self.k_cache[layers, c.dst] = self.k_cache[layers, c.src]
            self.v_cache[layers, c.dst] = self.v_cache[layers, c.src]

    @torch.inference_mode()
    def execute(self, batch: Sequence[HybridEntry],
                copies: Sequence[GroupBlockCopy] = ()) -> torch.Tensor:
        """Make ``copies``, compute the new tokens of every entry, and return the logits
        after each entry's last new token: ``[len(batch), vocab_size]`` fp32.
        Raises prefixkv.kernels.BatchError when an entry's tokens do not fit its blocks."""
        self.copy_blocks(copies)
        num_new = [len(e.new_token_ids) for e in batch]
        num_computed = [e.num_computed for e in batch]
        metas = [build_paged_batch([list(e.group_block_ids[g]) for e in batch], num_computed,
                                   num_new, self.block_size) for g in range(len(self.groups))]
        ids = torch.tensor([t for e in batch for t in e.new_token_ids], dtype=torch.int64)
        pos = torch.tensor([e.num_computed + i for e in batch for i in range(len(e.new_token_ids))],
                           dtype=torch.int64)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            meta = metas[self.layer_groups[layer]]
            k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
            write_kv_cache(k.contiguous(), v.contiguous(), k_cache, v_cache, meta.slot_mapping,
                           backend=self.backend)
            return paged_prefill_attention(
                q.contiguous(), k_cache, v_cache, meta.block_table, meta.cu_seqlens_q,
                meta.seqused_k, meta.max_seqlen_q, meta.max_seqlen_k, causal=True,
                window_size=self.windows[layer], backend=self.backend)

        hidden = self.model(ids, pos, attn)
        last = torch.tensor(num_new).cumsum(0) - 1
        return self.model.logits(hidden[last])


def dense_windowed_attention(cu_seqlens: list[int],
                             windows: Sequence[tuple[int, int] | None]) -> AttentionFn:
    """Attention without any cache: sequence i owns rows ``cu_seqlens[i]:cu_seqlens[i+1]``
    (its whole text from position 0); layer ``l`` attends causally within the window
    ``windows[l]`` (``(left, 0)`` or None for full attention)."""

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            n = hi - lo
            i = torch.arange(n)[:, None]
            j = torch.arange(n)[None, :]
            allowed = j <= i
            if windows[layer] is not None:
                allowed &= j >= i - windows[layer][0]
            qi = q[lo:hi].transpose(0, 1).float()  # [heads, len, head_dim]
            ki = k[lo:hi].repeat_interleave(group, 1).transpose(0, 1).float()
            vi = v[lo:hi].repeat_interleave(group, 1).transpose(0, 1).float()
            o = nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed)
            out[lo:hi] = o.transpose(0, 1).to(q.dtype)
        return out

    return attn
