"""The model runner: owns the paged K/V caches and runs one forward pass per step.

Per sequence in a step it receives plain ints from the scheduler (block ids, tokens
already in the cache, the new tokens) and lays them out as::

    | cached: num_computed tokens (read from blocks) | new tokens (computed now) |
    position:  0 ..................... num_computed-1 | num_computed .. +len(new)-1

Each layer first writes every new token's K/V of the whole batch into its slot
(``write_kv_cache``), then attends (``paged_prefill_attention``). Writing the whole
batch before any read is what lets a request admitted in a step hit blocks that another
request of the same step is computing (the manager indexes blocks when scheduled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from prefixkv.groups import GroupBlockCopy
from prefixkv.kernels import (
    ArgumentTypeError,
    alloc_host_cache,
    build_paged_batch,
    paged_prefill_attention,
    run_kv_ops,
    write_kv_cache,
)
from prefixkv.results import BlockCopy, BlockLoads, BlockOffloads, KVOp

from .model import TinyLlama


def flat_table(block_ids: Sequence[int] | Sequence[Sequence[int]]) -> list[int]:
    """One sequence's block table as a list of ids. Raises ValueError for per-group
    tables (those are a ``HybridModelRunner``'s)."""
    out: list[int] = []
    for b in block_ids:
        if not isinstance(b, int):
            raise ValueError("a ModelRunner takes one block table per sequence; per-group "
                             "tables need a HybridModelRunner")
        out.append(b)
    return out


def group_tables(block_ids: Sequence[int] | Sequence[Sequence[int]]) -> list[Sequence[int]]:
    """One sequence's per-group block tables. Raises ValueError for a single table (a
    ``ModelRunner``'s)."""
    out: list[Sequence[int]] = []
    for t in block_ids:
        if isinstance(t, int):
            raise ValueError("a HybridModelRunner takes one block table per group")
        out.append(t)
    return out


@dataclass(frozen=True, slots=True)
class SeqBatchEntry:
    """One sequence's share of a step: its blocks as the allocator's ``get_block_ids``
    gives them (ids in token order; for a ``HybridKVCacheManager``, one such sequence per
    group), how many of its tokens are already in the cache, and the token ids computed
    now (at least one). The engine never looks inside ``block_ids``."""

    block_ids: Sequence[int] | Sequence[Sequence[int]]
    num_computed: int
    new_token_ids: Sequence[int]


class Runner(Protocol):
    """What ``Engine`` needs of a model runner: ``ModelRunner`` (block ids of one table,
    for ``KVCacheManager`` and the baselines) or ``prefixkv.engine.hybrid.HybridModelRunner``
    (a table per group, for ``HybridKVCacheManager``)."""

    model: TinyLlama
    num_blocks: int
    block_size: int

    def run_kv_ops(self, ops: Sequence[KVOp | GroupBlockCopy]) -> None:
        """Run the allocator's ``take_kv_ops()`` plan before the next forward pass."""

    def execute(self, batch: Sequence[SeqBatchEntry]) -> torch.Tensor:
        """Compute the entries' new tokens; the logits after each entry's last one."""


class ModelRunner:
    """Runs ``model`` over paged caches of ``num_blocks`` blocks of ``block_size`` slots.

    ``k_caches[l], v_caches[l]``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the
    model's dtype, on ``device``; their content before a slot is written is garbage (NaN
    when ``poison=True``, to prove unwritten slots are never read).
    The attention backend follows ``prefixkv.kernels``: Triton on CUDA tensors, the torch
    reference on the CPU (or whatever ``backend`` names).
    ``host_blocks``: slots of the host caches ``k_host, v_host`` (``[host_blocks, num_layers,
    block_size, num_kv_heads, head_dim]`` on the CPU, pinned on CUDA) for an allocator with
    a host tier of that many blocks; 0: none (zero-slot host caches).
    """

    def __init__(self, model: TinyLlama, num_blocks: int, block_size: int, *,
                 device: torch.device | str = "cpu", backend: str | None = None,
                 poison: bool = False, host_blocks: int = 0) -> None:
        cfg = model.cfg
        self.model = model.to(device)
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = backend
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        fill = float("nan") if poison else 0.0
        self.k_cache = torch.full(shape, fill, dtype=cfg.dtype, device=self.device)
        self.v_cache = torch.full(shape, fill, dtype=cfg.dtype, device=self.device)
        self.host_blocks = host_blocks
        # zero slots without a host tier: any host op is then refused as out of range
        self.k_host, self.v_host = (
            alloc_host_cache(c, host_blocks, block_dim=1).fill_(fill) if host_blocks else
            torch.empty((0, *c.shape[:1], *c.shape[2:]), dtype=c.dtype) for c in (self.k_cache, self.v_cache))
        self.num_forward_tokens = 0

    @property
    def k_caches(self) -> list[torch.Tensor]:
        """Per-layer views ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return list(self.k_cache.unbind(0))

    @property
    def v_caches(self) -> list[torch.Tensor]:
        """Per-layer views ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return list(self.v_cache.unbind(0))

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Copy every slot of each ``src`` block into ``dst``, in all layers (the
        copy-on-write that ``fork`` asks for), as if one after another in order: a copy
        whose source is an earlier copy's destination reads what that copy wrote (a fork
        of a fork in one step, as ``take_kv_ops()`` plans it)."""
        if copies:
            self.run_kv_ops(copies)

    def run_kv_ops(self, ops: Sequence[KVOp | GroupBlockCopy]) -> None:
        """Run a step's plan from the allocator's ``take_kv_ops()`` (offloads, loads,
        copies, all layers) and make the next forward pass wait for it (on CUDA the copies
        run on a side stream; the CPU waits for nothing).
        Raises prefixkv.kernels.BlockIdError when an op names a block or host slot outside
        these caches (a plan with host ops needs ``host_blocks``), before any copy, and
        ArgumentTypeError for a store op (this runner moves no shared-store values)."""
        moves = [op for op in ops if isinstance(op, (BlockOffloads, BlockLoads, BlockCopy))]
        if len(moves) != len(ops):
            raise ArgumentTypeError(f"this runner runs offloads, loads and copies; the plan has "
                                    f"{[type(op).__name__ for op in ops if op not in moves]}")
        event = run_kv_ops(moves, [self.k_cache, self.v_cache], [self.k_host, self.v_host], block_dim=1)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @torch.inference_mode()
    def execute(self, batch: Sequence[SeqBatchEntry],
                copies: Sequence[BlockCopy] = ()) -> torch.Tensor:
        """Make ``copies``, compute the new tokens of every entry, and return the logits
        after each entry's last new token: ``[len(batch), vocab_size]`` fp32.

        Raises prefixkv.kernels.BatchError when an entry's tokens do not fit its blocks,
        ValueError for an empty batch or an entry without new tokens.
        """
        if not batch:
            raise ValueError("execute() needs at least one sequence")
        self.copy_blocks(copies)
        num_new = [len(e.new_token_ids) for e in batch]
        if min(num_new) < 1:
            raise ValueError(f"every entry needs at least one new token, got counts {num_new}")
        num_computed = [e.num_computed for e in batch]
        meta = build_paged_batch([flat_table(e.block_ids) for e in batch], num_computed, num_new,
                                 self.block_size, device=self.device)
        ids = [t for e in batch for t in e.new_token_ids]
        positions = [p for e in batch for p in range(e.num_computed, e.num_computed + len(e.new_token_ids))]
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        k_caches, v_caches = self.k_caches, self.v_caches

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: [total_new, num_heads, head_dim]; k, v: [total_new, num_kv_heads, head_dim]
            write_kv_cache(k.contiguous(), v.contiguous(), k_caches[layer], v_caches[layer],
                           meta.slot_mapping, backend=self.backend)
            out: torch.Tensor = paged_prefill_attention(
                q.contiguous(), k_caches[layer], v_caches[layer], meta.block_table,
                meta.cu_seqlens_q, meta.seqused_k, meta.max_seqlen_q, meta.max_seqlen_k,
                causal=True, backend=self.backend)
            return out

        hidden = self.model(input_ids, pos, attn)  # [total_new, hidden_size]
        last = torch.tensor(num_new, device=self.device).cumsum(0) - 1  # [batch]
        self.num_forward_tokens += len(ids)
        return self.model.logits(hidden[last])
