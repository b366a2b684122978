"""A model runner for layer groups: each layer belongs to a group (full attention, a
sliding window or chunked local attention) and reads its K/V through that group's block
table from ``prefixkv.groups.HybridKVCacheManager``.

It takes the same ``SeqBatchEntry`` as ``ModelRunner``, with ``block_ids`` as the hybrid
manager's ``get_block_ids`` gives them (one tuple per group), so ``Engine`` drives either
runner without knowing which. Per step and per group, one ``build_paged_batch``; each
layer writes the batch's new K/V into its own cache through its group's slot mapping,
then attends:

    full attention      the group's table, causal
    sliding window W    the group's table, ``window_size=(W - 1, 0)``
    chunked local C     one virtual sequence per chunk a sequence's new tokens touch,
                        its table starting at the chunk (``local_chunks``), causal

Released positions of a windowed group's table hold the manager's null block, which no
query reads (with ``poison=True`` every cache starts as NaN, so a read of the null block
or of any unwritten slot would show). Also the oracle: ``dense_group_attention`` computes
each layer without any cache. Needs torch; imported as ``prefixkv.engine.hybrid``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import nn

from prefixkv.core.block import blocks_for
from prefixkv.errors import ConfigError
from prefixkv.groups import CHUNKED, GroupBlockCopy, GroupSpec
from prefixkv.kernels import (
    ArgumentTypeError,
    BlockIdError,
    PagedBatch,
    build_paged_batch,
    paged_prefill_attention,
    write_kv_cache,
)
from prefixkv.results import KVOp

from .model import AttentionFn, TinyLlama
from .runner import SeqBatchEntry, group_tables


class HybridModelRunner:
    """Runs ``model`` whose layer ``l`` belongs to group ``layer_groups[l]`` of ``groups``,
    over per-layer caches ``k_cache, v_cache: [num_layers, num_blocks, block_size,
    num_kv_heads, head_dim]`` on ``device`` (the backend as ``ModelRunner``'s).
    Raises ConfigError when ``layer_groups`` is not a sequence naming a group (an int
    index, not a bool) for every layer, and for a chunked local group whose chunk is not a multiple of
    ``block_size`` (a chunk must start at a block)."""

    def __init__(self, model: TinyLlama, groups: Sequence[GroupSpec], layer_groups: Sequence[int],
                 num_blocks: int, block_size: int, *, device: torch.device | str = "cpu",
                 backend: str | None = None, poison: bool = True) -> None:
        cfg = model.cfg
        if not isinstance(layer_groups, Sequence) or len(layer_groups) != cfg.num_layers or not all(
                type(g) is int and 0 <= g < len(groups) for g in layer_groups):
            raise ConfigError(f"layer_groups must give one of {len(groups)} groups for each of "
                             f"{cfg.num_layers} layers, got {layer_groups!r}")
        for spec in groups:
            if spec.kind == CHUNKED and spec.tokens % block_size:
                raise ConfigError(f"a chunked local group of {spec.tokens} tokens needs chunks "
                                  f"that are a multiple of block_size {block_size}")
        self.windows = [None if groups[g].kind == CHUNKED else groups[g].window_size
                        for g in layer_groups]
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.groups = tuple(groups)
        self.layer_groups = tuple(layer_groups)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.backend = backend
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        fill = float("nan") if poison else 0.0
        self.k_cache = torch.full(shape, fill, dtype=cfg.dtype, device=self.device)
        self.v_cache = torch.full(shape, fill, dtype=cfg.dtype, device=self.device)
        self.num_forward_tokens = 0

    def copy_blocks(self, copies: Sequence[GroupBlockCopy]) -> None:
        """Copy each ``src`` block into ``dst`` in the layers of its group."""
        for c in copies:
            layers = [layer for layer, g in enumerate(self.layer_groups) if g == c.group_idx]
            self.k_cache[layers, c.dst] = self.k_cache[layers, c.src]
            self.v_cache[layers, c.dst] = self.v_cache[layers, c.src]

    def run_kv_ops(self, ops: Sequence[KVOp | GroupBlockCopy]) -> None:
        """Run a step's plan from the hybrid manager's ``take_kv_ops()`` (fork copies, in
        order). Raises ArgumentTypeError for an op that is not a GroupBlockCopy and
        BlockIdError for a block or group outside these caches, before any copy."""
        copies: list[GroupBlockCopy] = []
        for op in ops:
            if type(op) is not GroupBlockCopy:
                raise ArgumentTypeError(f"a hybrid runner's ops are GroupBlockCopy, got {op!r}")
            if not (0 <= op.src < self.num_blocks and 0 <= op.dst < self.num_blocks
                    and 0 <= op.group_idx < len(self.groups)):
                raise BlockIdError(f"{op!r} is outside {self.num_blocks} blocks and "
                                   f"{len(self.groups)} groups")
            copies.append(op)
        self.copy_blocks(copies)

    @torch.inference_mode()
    def execute(self, batch: Sequence[SeqBatchEntry],
                copies: Sequence[GroupBlockCopy] = ()) -> torch.Tensor:
        """Make ``copies``, compute the new tokens of every entry (``block_ids``: one
        sequence of ids per group) and return the logits after each entry's last new
        token: ``[len(batch), vocab_size]`` fp32.
        Raises prefixkv.kernels.BatchError when an entry's tokens do not fit its blocks,
        ValueError for an empty batch or an entry without new tokens or with another
        number of tables than groups."""
        if not batch:
            raise ValueError("execute() needs at least one sequence")
        num_new = [len(e.new_token_ids) for e in batch]
        if min(num_new) < 1 or any(len(e.block_ids) != len(self.groups) for e in batch):
            raise ValueError(f"every entry needs new tokens and {len(self.groups)} block tables, "
                             f"got counts {num_new} and {[len(e.block_ids) for e in batch]}")
        self.copy_blocks(copies)
        num_computed = [e.num_computed for e in batch]
        tables = [group_tables(e.block_ids) for e in batch]
        metas = [self._group_batch(spec, [t[g] for t in tables], num_computed, num_new)
                 for g, spec in enumerate(self.groups)]
        dev = self.device
        ids = torch.tensor([t for e in batch for t in e.new_token_ids], dtype=torch.int64, device=dev)
        pos = torch.tensor([e.num_computed + i for e in batch for i in range(len(e.new_token_ids))],
                           dtype=torch.int64, device=dev)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: [total_new, num_heads, head_dim]; k, v: [total_new, num_kv_heads, head_dim]
            meta = metas[self.layer_groups[layer]]
            k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
            write_kv_cache(k.contiguous(), v.contiguous(), k_cache, v_cache, meta.slot_mapping,
                           backend=self.backend)
            out: torch.Tensor = paged_prefill_attention(
                q.contiguous(), k_cache, v_cache, meta.block_table, meta.cu_seqlens_q,
                meta.seqused_k, meta.max_seqlen_q, meta.max_seqlen_k, causal=True,
                window_size=self.windows[layer], backend=self.backend)
            return out

        hidden = self.model(ids, pos, attn)  # [total_new, hidden_size]
        last = torch.tensor(num_new, device=dev).cumsum(0) - 1  # [batch]
        self.num_forward_tokens += len(ids)
        return self.model.logits(hidden[last])

    def _group_batch(self, spec: GroupSpec, block_ids: list[Sequence[int]],
                     num_computed: list[int], num_new: list[int]) -> PagedBatch:
        if spec.kind == CHUNKED:
            block_ids, num_computed, num_new = local_chunks(
                block_ids, num_computed, num_new, spec.tokens, self.block_size)
        return build_paged_batch([list(b) for b in block_ids], num_computed, num_new,
                                 self.block_size, device=self.device)


def local_chunks(block_ids: Sequence[Sequence[int]], num_computed: Sequence[int],
                 num_new: Sequence[int], chunk: int, block_size: int,
                 ) -> tuple[list[Sequence[int]], list[int], list[int]]:
    """Chunked local attention as plain causal attention over virtual sequences: the new
    tokens of a sequence are split at chunk edges, and the piece in chunk ``c`` becomes a
    sequence whose table starts at the chunk's first block (``chunk`` is a multiple of
    ``block_size``)::

        positions  | chunk c-1 ........ | chunk c: cached | new | chunk c+1: new |
        virtual    (not in any table)   | seq 1: table from chunk c | seq 2 ...  |

    The pieces keep the order of the new tokens (so the rows of q and of the output do
    not move) and their slots are the real ones. Returns (block ids, num_computed,
    num_new) per virtual sequence."""
    ids, comp, new = [], [], []
    for blocks, start, n in zip(block_ids, num_computed, num_new, strict=True):
        p, end = start, start + n
        while p < end:
            first = p - p % chunk
            stop = min(end, first + chunk)
            ids.append(blocks[first // block_size:blocks_for(stop, block_size)])
            comp.append(p - first)
            new.append(stop - p)
            p = stop
    return ids, comp, new


def dense_group_attention(cu_seqlens: list[int], layer_specs: Sequence[GroupSpec]) -> AttentionFn:
    """Attention without any cache: sequence i owns rows ``cu_seqlens[i]:cu_seqlens[i+1]``
    (its whole text from position 0); a query of layer ``l`` at position p attends to
    the keys ``layer_specs[l].first_needed(p) .. p``. The oracle of the hybrid runner."""

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        spec = layer_specs[layer]
        for lo, hi in pairwise(cu_seqlens):
            n = hi - lo
            first = torch.tensor([spec.first_needed(p) for p in range(n)], device=q.device)
            j = torch.arange(n, device=q.device)[None, :]
            allowed = (j <= torch.arange(n, device=q.device)[:, None]) & (j >= first[:, None])
            qi = q[lo:hi].transpose(0, 1).float()  # [heads, len, head_dim]
            ki = k[lo:hi].repeat_interleave(group, 1).transpose(0, 1).float()
            vi = v[lo:hi].repeat_interleave(group, 1).transpose(0, 1).float()
            o = nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed)
            out[lo:hi] = o.transpose(0, 1).to(q.dtype)
        return out

    return attn
