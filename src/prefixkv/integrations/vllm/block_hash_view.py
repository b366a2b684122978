"""vLLM's hash on the plug-in's ``KVCacheBlock`` objects (``block_hash``,
``block_hash_num_tokens``), read from what prefixkv's block holds.

vLLM sets a block's hash when it caches it (``cache_full_blocks``: every block that
computed a prefix, a second copy of one included) and resets it when it evicts it (reused
from the free queue, ``evict_blocks``, ``reset_prefix_cache``); a freed block keeps it.
prefixkv's block holds findable content exactly then (its content's primary or a held
spare; ``held_content``: an id naming that content, never reused), so the hash is
vLLM's hash of that content: None while the block holds none, else the hash the
``block_hashes`` of a request holding that prefix have at the block's end, with the
block's group appended (``BlockHashWithGroupId``), covering the tokens to the block's end.

Nothing is recorded on the admission path. The hash is found when first read: the
requests prefixkv's block hasher noted (block_hashes.py) are asked, through their probes,
which blocks hold each of their prefixes, until one names the block; each block found
keeps its hash while it holds the same content id. A block holding content that no live
noted request names (its request gone) is refused with UnsupportedByPrefixKV, as a hash
of no live request is: vLLM would answer from its own map.

Served where every group's block is the hash block and none is Mamba. Elsewhere vLLM
keys partial tail entries inside larger blocks and Mamba's sparse states, which this
view does not follow: there every block reads None, as before this view
(docs/integration.md lists it; a refusal there failed vLLM's connectors that ask a
request's blocks whether they are hashed, which ran before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from .layout import Layout, UnsupportedByPrefixKV

if TYPE_CHECKING:
    from .block_hashes import HashLookups

__all__ = ["KEEP", "BlockHashView", "Held", "view_for"]

KEEP = 64
"""Freed requests kept alive for their blocks' hashes before those are noted (``gone``)."""

Held = Callable[[int], "tuple[int, int] | None"]
"""prefixkv's ``held_content`` of a block id: (group, content id), or None."""


class BlockHashView:
    """``hash_entry(core_id)`` (block_objects.py's ``HashSource``) over ``lookups``'
    noted requests and probes; ``held``: the manager's ``held_content``; ``groups``: the
    number of groups; ``unserved``: why no hash is served in this layout (every block
    reads None), or None."""

    def __init__(self, lookups: HashLookups, held: Held, groups: int, unserved: str | None) -> None:
        self._lookups, self._held, self._groups, self.unserved = lookups, held, groups, unserved
        # prefixkv block id -> (what it held: group and content id, vLLM's hash with group
        # id, tokens)
        self._known: dict[int, tuple[tuple[int, int], bytes, int]] = {}
        self._gone: list[Any] = []  # requests freed, kept alive (``gone``)

    def hash_entry(self, core_id: int) -> tuple[bytes, int] | None:
        """(vLLM's ``BlockHashWithGroupId``, the tokens it covers) of block ``core_id``,
        None while it holds no findable content, and in a layout not served. Raises
        UnsupportedByPrefixKV for content no live noted request names."""
        if self.unserved is not None:
            return None
        held = self._held(core_id)
        if held is None:
            return None
        known = self._known.get(core_id)
        if known is None or known[0] != held:
            self._scan(core_id, held)
            known = self._known.get(core_id)
            if known is None or known[0] != held:
                raise UnsupportedByPrefixKV(
                    f"KVCacheBlock.block_hash of prefixkv block {core_id}: it holds content no live "
                    f"request prefixkv's block hasher noted names (its request is gone), so vLLM's "
                    f"hash of it is not known here")
        return known[1], known[2]

    def gone(self, request: Any) -> None:
        """``request`` (one the manager frees: finished, aborted, preempted) is kept
        alive, so a later first read of a block it cached still finds its hash through
        it (its record in the noted prompts lives as long); past ``KEEP`` such requests,
        the hashes of every block they name that still holds their content are noted and
        they are let go. O(1) a request, the note amortized."""
        if self.unserved is not None:
            return
        kept = self._gone
        kept.append(request)
        if len(kept) > KEEP:
            self._gone = []
            for r in kept:
                self._note(r)

    def _scan(self, core_id: int, held: tuple[int, int]) -> None:
        """Note the hash of every block holding a prefix of the noted live requests
        (those kept past their free included), one request at a time, until block
        ``core_id`` is found holding ``held``."""
        known = self._known
        for r in self._lookups.prefixes.requests():
            self._note(r)
            found = known.get(core_id)
            if found is not None and found[0] == held:
                return

    def _note(self, r: Any) -> None:
        """Note the hash of every block holding a prefix of request ``r``."""
        hashes, h = r.block_hashes, self._lookups.prefixes.hash_block_size
        m = min(len(hashes), r.num_tokens // h)
        if not m:
            return
        held_content, known, groups = self._held, self._known, range(self._groups)
        probe = self._lookups.probe_for(r, m * h, hashes[m - 1])
        for j in range(m):
            n = (j + 1) * h
            for g in groups:
                for b in probe.copies(n, g):
                    now = held_content(b)
                    if now is not None:
                        known[b] = (now, make_block_hash_with_group_id(hashes[j], g), n)


def view_for(lookups: HashLookups, core: Any, layout: Layout) -> BlockHashView:
    """The ``BlockHashView`` of a manager over ``core`` (prefixkv's manager of ``layout``)."""
    h = layout.sizes.hash_size
    unserved = None
    if any(b != h for b in layout.sizes.sizes):
        unserved = ("groups of different block sizes: vLLM keys partial tail entries inside the "
                   "larger blocks, which prefixkv's block objects do not follow")
    elif any(spec.sparse for spec in layout.groups):
        unserved = ("Mamba groups: vLLM hashes only some of their states, which prefixkv's block objects "
                   "do not follow")
    return BlockHashView(lookups, core.held_content, len(layout.groups), unserved)
