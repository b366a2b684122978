"""Blocks filled under a parent whose content cannot be found: ``uncache`` emptied it
(its KV turned out invalid, ``uncache_blocks``) or left it as a spare of a content the
index no longer holds, while its request goes on. What such a block computes read that
KV, so no lookup may find it, and no event may name it: its chain hash is the one a
recomputation of the same tokens would announce, and a router would then count it while
``lookup`` cannot reach it. ``ContentRecorder.store`` records such blocks here: each
takes a content id (the blocks after it in its request name it as their parent's, as
``check_request`` expects) and no key."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import Block, ContentKey


def cut_off(parent: Block, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> bool:
    """Whether no lookup finds ``parent``'s content: it has none (emptied), or it is a
    spare and the block the index keys under its key holds another content (``uncache``
    kept it as a spare of a content that left). ``parent`` is emptied or a spare (the
    caller checks that first: a primary's content is found)."""
    key = parent.key
    if key is None:
        return True
    entry = by_chunk.get(key) if type(key) is bytes else by_key.get(key)  # type: ignore[arg-type]
    return entry is None or entry.content_id != parent.content_id


def record_cut_off(blocks: Sequence[Block], parent: Block, extras: Sequence[bytes],
                   hashes: Sequence[bytes] | None, next_id: int, step: int) -> int:
    """Give ``blocks`` (filled after ``parent``, in order) their content fields and new
    content ids from ``next_id`` on, but no key; their chain hashes when ``hashes``
    (their children's ``prepare`` reads them). Returns the next unused id."""
    cid = parent.content_id
    for i, (b, extra) in enumerate(zip(blocks, extras, strict=True)):
        b.key = None
        b.twin = b.chained = False
        b.parent_cid = cid
        b.extra = extra
        b.content_id = cid = next_id
        next_id += 1
        b.step = step
        if hashes is not None:
            b.hash = hashes[i]
    return next_id
