"""prefixkv's cache events as vLLM's own ``KVCacheEvent`` objects (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared`` of ``vllm.distributed.kv_events``), so that vLLM's
``ZmqEventPublisher`` publishes them unchanged.

prefixkv's own log withdraws a batch of evictions in one ``BlockRemoved``; vLLM's pool
sends one a hash (``BlockPool._emit_block_removed_events``), so here each hash of a batch
becomes its own ``BlockRemoved``, in the batch's order (the order its blocks were
evicted, vLLM's). prefixkv announces a run of blocks per ``BlockStored``, as vLLM does; consecutive runs
that continue one chain (each one's parent is the previous one's last hash) in the same
group with the same LoRA, medium and session become one ``BlockStored``. ``session_id``:
the session of the request whose call stored the blocks (sessions.py's marks in the
log), None for a request without one. Hashes are prefixkv's
chain hashes (bytes; the manager's ``hash_mode``). ``extra_keys`` per block are vLLM
0.33's, built as the fleet wire builds them (``prefixkv.fleet.wire.vllm_extra_keys``):
the LoRA name; each multimodal input overlapping the block as ``(identifier, its offset
minus the block's first token)``; the cache salt on a request's first block only; a
block's prompt-embeddings digest, bare (prefixkv hashes the salt into every block of a
salted request, but announces it as vLLM does). Under lookahead hashing (``LookaheadBlockStored``) a
``BlockStored`` carries ``lookahead_token_ids`` (per block, the ``L`` tokens after it)
and ``extra_keys`` over the block and those tokens, as vLLM 0.33's ``BlockPool`` fills
them; None without.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

from prefixkv import events as core
from prefixkv.fleet.wire import lookahead_of, vllm_extra_keys

from .sessions import SessionMark

__all__ = ["to_vllm_events"]


def to_vllm_events(events: Iterable[core.Event | SessionMark], block_size: int,
                   spec_of_group: Sequence[tuple[str, int | None]]) -> list[KVCacheEvent]:
    """``events`` (oldest first) as vLLM's events, in the same order. ``spec_of_group[g]``:
    vLLM's ``(kv_cache_spec_kind, kv_cache_spec_sliding_window)`` of group ``g``. Each
    ``BlockStored`` has its own event's ``block_size`` (its group's, where groups' sizes
    differ); ``block_size``, the scheduler's, is not read."""
    out: list[KVCacheEvent] = []
    session: str | None = None  # (the request's whose call stored them: sessions.py)
    for e in events:
        group = getattr(e, "group_idx", 0)
        if isinstance(e, core.BlockStored):
            extra = e.extra
            lora, lora_id = (extra.lora, extra.lora_id) if extra is not None else (None, None)
            n = len(e.block_hashes)
            bs = e.block_size
            la = 0 if e.__class__ is core.BlockStored else lookahead_of(e)
            keys: list[tuple[Any, ...] | None]
            if extra is None:
                keys = [None] * n
            else:
                width = bs + la  # (the block and the L tokens after it: vLLM's window)
                first = e.first_block
                keys = [vllm_extra_keys(extra, j * bs, width) for j in range(first, first + n)]
            after = e.lookahead_token_ids if la else None  # type: ignore[attr-defined]
            last = out[-1] if out else None
            if (isinstance(last, BlockStored) and last.group_idx == group and last.block_size == bs
                    and e.parent_block_hash == last.block_hashes[-1]
                    and (last.lora_name, last.lora_id, last.medium, last.session_id)
                    == (lora, lora_id, e.medium, session)):
                last.block_hashes.extend(e.block_hashes)
                last.token_ids.extend(e.token_ids)
                assert last.extra_keys is not None
                last.extra_keys.extend(keys)
                if after is not None:
                    assert last.lookahead_token_ids is not None, "one manager, one L"
                    last.lookahead_token_ids.extend(after)
                continue
            kind, window = spec_of_group[group]
            out.append(BlockStored(
                block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash,
                token_ids=e.token_ids, block_size=bs, lora_id=lora_id,
                medium=e.medium, lora_name=lora, extra_keys=keys, group_idx=group,
                kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
                session_id=session, lookahead_token_ids=after))
        elif isinstance(e, core.BlockRemoved):
            medium = e.medium
            out.extend([BlockRemoved(block_hashes=[h], medium=medium, group_idx=group)
                        for h in e.block_hashes])
        elif isinstance(e, core.AllBlocksCleared):
            out.append(AllBlocksCleared())
        elif isinstance(e, SessionMark):
            session = e.session_id
    return out
