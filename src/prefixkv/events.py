"""Cache events an engine drains each step (``KVCacheManager.take_events()``), shaped for
KV-aware routers: a router that mirrors BlockStored/BlockRemoved knows which chain hashes
this instance holds. Use ``hash_mode="sha256"`` for ids that are stable across processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .extra_keys import ExtraKeys


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block became findable under ``block_hash``. ``parent_block_hash`` is None
    for a request's first block. ``token_ids`` are the block's block_size tokens.
    ``extra``: the extra keys that entered this block's hash (LoRA, salt and only the
    multimodal inputs overlapping the block), None when there are none."""

    block_hash: bytes
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_id: int
    extra: ExtraKeys | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The block stored under ``block_hash`` was evicted; its id may now hold other KV."""

    block_hash: bytes
    block_id: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """``reset_prefix_cache()`` dropped every cached block."""


Event = BlockStored | BlockRemoved | AllBlocksCleared
"""Any of the three events ``take_events()`` returns."""
