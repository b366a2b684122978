"""The vLLM-shaped result, stats and event types handed back by
``prefixkv.adapters.vllm.VllmKVCacheManager`` (plain data, pure Python)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockIds:
    """Blocks handed back by ``allocate_slots`` (the newly allocated ones, like vLLM's
    ``KVCacheBlocks``): ``block_ids`` in token order."""

    block_ids: tuple[int, ...] = ()

    def get_block_ids(self) -> tuple[list[int]]:
        """vLLM's shape: one list per KV-cache group (prefixkv has one group)."""
        return (list(self.block_ids),)


@dataclass(frozen=True, slots=True)
class GroupBlockIds:
    """Blocks handed back by ``VllmHybridKVCacheManager.allocate_slots``: the newly
    allocated ones, ``block_ids[g]`` in token order for layer group ``g``."""

    block_ids: tuple[tuple[int, ...], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """vLLM's shape: one list per KV-cache group, in group order."""
        return tuple(map(list, self.block_ids))


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """What ``get_computed_blocks`` found: ``num_tokens`` cached prompt tokens. It names
    no block ids (difference 1 in the module docstring)."""

    num_tokens: int = 0
    num_groups: int = 1

    def get_block_ids(self) -> tuple[list[int], ...]:
        """An empty list per group (``([],)`` for one group): the hit's block ids are
        known only after ``allocate_slots``."""
        return tuple([] for _ in range(self.num_groups))


@dataclass(slots=True)
class VllmPrefixCacheStats:
    """vLLM's prefix-cache stats fields: first admissions and, apart, re-admissions of
    preempted requests; ``reset`` when the cache was reset since the previous take."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass(frozen=True, slots=True)
class VllmBlockStored:
    """Consecutive blocks of one chain became cached: ``block_hashes[i]`` holds
    ``token_ids[i*block_size:(i+1)*block_size]``; the first one's parent is
    ``parent_block_hash`` (None at the start of a sequence). ``lora_name`` and
    ``lora_id``: the request's LoRA adapter (None without one); ``medium``: where the
    blocks live ("GPU": the device pool)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


@dataclass(frozen=True, slots=True)
class VllmBlockRemoved:
    """Blocks no longer findable (evicted, or withdrawn because their KV was never
    computed), on ``medium``."""

    block_hashes: list[bytes]
    medium: str | None


@dataclass(frozen=True, slots=True)
class VllmAllBlocksCleared:
    """The whole prefix cache was reset."""


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared
"""Any of the three events ``VllmKVCacheManager.take_events()`` returns."""
