"""prefixkv's cache events converted to the shapes of vLLM's KV events (pure Python)."""

from __future__ import annotations

from collections.abc import Iterable

from prefixkv.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

from .vllm_types import VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored, VllmEvent

__all__ = ["to_vllm_events"]


def to_vllm_events(events: Iterable[Event], block_size: int) -> list[VllmEvent]:
    """``events`` (oldest first) in vLLM's shapes, in the same order.

    prefixkv stores one block per ``BlockStored``; consecutive stores that continue one
    chain (each one's parent is the previous one's hash) with the same LoRA name,
    ``lora_id`` and medium become one ``VllmBlockStored`` with several hashes, as vLLM
    emits them. ``lora_name``/``lora_id`` come from the block's extra keys (None without
    a LoRA); ``medium`` is the core event's. Cache salts and multimodal keys are not
    carried. Each ``BlockRemoved`` stays one ``VllmBlockRemoved``.
    """
    out: list[VllmEvent] = []
    for e in events:
        if isinstance(e, BlockStored):
            extra = e.extra
            lora, lora_id = (extra.lora, extra.lora_id) if extra is not None else (None, None)
            last = out[-1] if out else None
            if (isinstance(last, VllmBlockStored) and e.parent_block_hash == last.block_hashes[-1]
                    and (last.lora_name, last.lora_id, last.medium) == (lora, lora_id, e.medium)):
                last.block_hashes.append(e.block_hash)
                last.token_ids.extend(e.token_ids)
            else:
                out.append(VllmBlockStored([e.block_hash], e.parent_block_hash, list(e.token_ids),
                                           block_size, lora_id, e.medium, lora))
        elif isinstance(e, BlockRemoved):
            out.append(VllmBlockRemoved([e.block_hash], e.medium))
        elif isinstance(e, AllBlocksCleared):
            out.append(VllmAllBlocksCleared())
    return out
