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

Nothing is recorded on the admission path. What a block holds is named by its content
id (never reused), and a content id is kept with vLLM's hash of that prefix
(``_by_content``) from the blocks of a request (a request's block at position ``j`` holds
its prefix to ``(j + 1) * hash_block_size``): at the manager's free of the request
(``gone``: finished, aborted, preempted, popped; so a block whose requests are all gone
reads its hash, as vLLM keeps it until the block is evicted) once anything has read a
block's hash in this manager (a connector that reads them, an inspector: before the first
read a free keeps nothing and costs what it did, ~5x less for a long request; a block
freed then, whose requests are all gone before the first read, is refused by name), and at
a first read
(``_live``: each live request's block ids from the manager's request map, from where its
last pass stopped; then all of them anew, then the probes of the requests prefixkv's block
hasher noted, block_hashes.py). Only the full-attention groups' blocks are read: every
group's block of one prefix holds the same id, a window's released ones too. Each costs
the manager's ``held_contents`` and a dict update a group, no bytecodes a block
(benchmarks/plugin_block_hash_reads.py). A block holding content no request prefixkv's
block hasher noted ever named (one built without it) is refused with
UnsupportedByPrefixKV, as a hash of no noted request is.

Served where every group's block is the hash block and none is Mamba, and with vLLM's
fine-grained partial hits beside full attention of the hash block's size (a Mamba
block's one entry is its content, ``held_content``), a larger one's beside it too (its
blocks' contents are kept from the rows of the hash block's size, which hold every
prefix a request computed; the scan skips them), and beside Mamba's chunk-end checkpoint
blocks at one block size (a Mamba block holds the state at its own end, keyed as full
attention's block: tests/engines/test_vllm_one_size_checkpoints.py). Not with full attention larger than
the hash block alone: a block holding a whole prefix and a partial entry beside it is
listed by the probes of both, and the scan may take the entry's hash (found: tests/
engines/test_vllm_fine_full.py, full4+mamba4). Elsewhere vLLM
keys partial tail entries inside larger blocks and Mamba's sparse states, which this
view does not follow: there every block reads None, as before this view
(docs/integration.md lists it; a refusal there failed vLLM's connectors that ask a
request's blocks whether they are hashed, which ran before).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from .layout import Layout, UnsupportedByPrefixKV

if TYPE_CHECKING:
    from .block_hashes import HashLookups

__all__ = ["BlockHashView", "Held", "view_for"]

Held = Callable[[int], "tuple[int, int] | None"]
"""prefixkv's ``held_content`` of a block id: (group, content id), or None."""

Contents = Callable[[Sequence[int]], list[int]]
"""prefixkv's ``held_contents`` of block ids: each one's content id, 0 for none."""


class BlockHashView:
    """``hash_entry(core_id)`` (block_objects.py's ``HashSource``) over ``lookups``'
    noted requests and probes; ``held``: the manager's ``held_content``, ``contents``:
    its ``held_contents``; ``groups``: the number of groups; ``unserved``: why no hash is
    served in this layout (every block reads None), or None; ``rows``: the groups whose
    blocks ``gone`` reads (full attention); ``num_blocks``: the manager's."""

    def __init__(self, lookups: HashLookups, held: Held, contents: Contents, groups: int,
                 unserved: str | None, rows: Sequence[int] = (0,), num_blocks: int = 0) -> None:
        self._lookups, self._held, self._groups, self.unserved = lookups, held, groups, unserved
        self._contents = contents
        # prefixkv block id -> (what it held: group and content id, vLLM's hash with group
        # id, tokens)
        self._known: dict[int, tuple[tuple[int, int], bytes, int]] = {}
        # content id -> (vLLM's hash of that prefix, without group id; its tokens), kept
        # from the requests' blocks (``gone``, ``_live``) of the groups ``rows`` (full
        # attention: every prefix a request holds; all groups where none is)
        self._by_content: dict[int, tuple[bytes, int]] = {}
        self._rows, self._num_blocks = rows, num_blocks
        self._limit = 2 * num_blocks
        # a live request -> how far ``_live`` kept its blocks' contents, and its hash there
        self._seen: WeakKeyDictionary[Any, tuple[int, bytes]] = WeakKeyDictionary()
        # a live request's prefixkv block ids per group, None when it holds none (set by
        # the manager: its request map)
        self.rows_of: Callable[[Any], Sequence[Sequence[int]] | None] = lambda r: None
        # whether any block's hash was read: ``gone`` keeps a freed request's from then on
        self.read = False
        # the groups whose blocks ``_scan`` notes from the probes (not full attention
        # larger than the hash block: a block holding a whole prefix and a partial entry
        # is listed under both; its content is kept from the rows of the hash block's size)
        self.scanned: Sequence[int] = range(groups)

    def hash_entry(self, core_id: int) -> tuple[bytes, int] | None:
        """(vLLM's ``BlockHashWithGroupId``, the tokens it covers) of block ``core_id``,
        None while it holds no findable content, and in a layout not served. Raises
        UnsupportedByPrefixKV for content no noted request named (live, or freed:
        ``gone``)."""
        if self.unserved is not None:
            return None
        self.read = True
        held = self._held(core_id)
        if held is None:
            return None
        known = self._known.get(core_id)
        if known is None or known[0] != held:
            known = self._find(core_id, held)
        return known[1], known[2]

    def _find(self, core_id: int, held: tuple[int, int]) -> tuple[tuple[int, int], bytes, int]:
        """Block ``core_id``'s entry, holding ``held``, not known yet: from the contents
        kept, else after noting the live requests' blocks past what was noted of each
        (``_live``), else all of them again, else their probes (``_scan``)."""
        for find in (self._kept, self._live, self._live_anew, self._scan):
            find(core_id, held)
            known = self._known.get(core_id)
            if known is not None and known[0] == held:
                return known
        raise UnsupportedByPrefixKV(
            f"KVCacheBlock.block_hash of prefixkv block {core_id}: it holds content no request "
            f"prefixkv's block hasher noted named (a request built without it, or one freed before "
            f"anything read a block's hash: freed requests' hashes are kept from the first read on), "
            f"so vLLM's hash of it is not known here")

    def gone(self, request: Any, ids: Sequence[Sequence[int]]) -> None:
        """``request`` goes (the manager frees it: finished, aborted, preempted, popped)
        from blocks ``ids`` (per group, prefixkv's ids in token order, not yet freed): the
        content each of its full-attention blocks holds (a prefix of it, the one every
        group's block of that prefix holds: a window's released ones too) is kept with
        the request's hash of that prefix, for a later first read no live request may
        answer then. No bytecodes a block here (the manager's ``held_contents`` and a
        dict update, in C); the kept entries are swept of contents no block holds when
        they outgrow twice the pool. Nothing until a block's hash was first read (from then
        on a 128-block request's free costs ~50 us more, measured here)."""
        if self.read and self.unserved is None:
            self._note_rows(request.block_hashes, ids, 0)

    def keeping(self) -> bool:
        """Whether ``gone`` keeps anything now: a hash was read, in a layout served."""
        return self.read and self.unserved is None

    def _note_rows(self, hashes: Sequence[bytes], ids: Sequence[Sequence[int]], start: int) -> int:
        """Keep the content of each block of ``ids``' full-attention rows from position
        ``start`` with its prefix's hash in ``hashes``; the first position whose block held
        none (the end where all did)."""
        m = len(hashes)
        h, kept, first = self._lookups.prefixes.hash_block_size, self._by_content, m
        for g in self._rows:
            row = ids[g][start:m]
            contents = self._contents(row)
            tokens = range((start + 1) * h, (start + len(row) + 1) * h, h)  # (hashes may run past it)
            kept.update(zip(contents, zip(hashes[start:], tokens, strict=False), strict=True))
            first = min(first, start + (contents.index(0) if 0 in contents else len(row)))
        kept.pop(0, None)
        if len(kept) > self._limit:
            held = set(self._contents(range(self._num_blocks)))
            self._by_content = {c: e for c, e in kept.items() if c in held}
            self._limit = 2 * len(self._by_content) + self._num_blocks
        return first

    def _kept(self, core_id: int, held: tuple[int, int]) -> None:
        """Note block ``core_id``'s hash from the content kept, if kept."""
        g, cid = held
        entry = self._by_content.get(cid)
        if entry is not None:
            self._known[core_id] = (held, make_block_hash_with_group_id(entry[0], g), entry[1])

    def _live(self, core_id: int, held: tuple[int, int], anew: bool = False) -> None:
        """Keep what the live requests' blocks hold, each from where the last pass found
        one of its blocks holding nothing (the blocks before hold what they held then,
        unless evicted: ``anew`` starts each at 0), then look again."""
        seen, rows_of, h = self._seen, self.rows_of, self._lookups.prefixes.hash_block_size
        for r in self._lookups.prefixes.requests():
            hashes = r.block_hashes
            k, last = seen.get(r, (0, b""))
            if anew or (k and (k > len(hashes) or hashes[k - 1] != last)):  # (its tokens cut)
                k = 0
            elif k >= min(len(hashes), r.num_tokens // h):
                continue  # (no block past those kept can hold a prefix yet)
            ids = rows_of(r)
            if ids is not None and k < min(len(hashes), len(ids[self._rows[0]])):
                k = self._note_rows(hashes, ids, k)
                seen[r] = (k, hashes[k - 1] if k else b"")
        self._kept(core_id, held)

    def _live_anew(self, core_id: int, held: tuple[int, int]) -> None:
        self._live(core_id, held, True)

    def _scan(self, core_id: int, held: tuple[int, int]) -> None:
        """Note the hash of every block holding a prefix of the noted live requests,
        through their probes, one request at a time, until block ``core_id`` is found
        holding ``held``."""
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
        held_content, known, groups = self._held, self._known, self.scanned
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
    pairs = list(zip(layout.groups, layout.sizes.sizes, strict=True))
    fine = [g for g, (spec, b) in enumerate(pairs) if not spec.sparse and b > h]
    plain = [g for g, (spec, b) in enumerate(pairs) if not spec.sparse and b == h]
    if layout.sizes.partial and (not fine or plain):  # (a Mamba block's one entry is its content:
        pass  # groups/partial.py; beside full attention of the hash block's size, a larger one's too)
    elif layout.sizes.checkpoints and not fine:  # (one size: a Mamba block holds the state at its end)
        pass
    elif any(b != h for b in layout.sizes.sizes):
        unserved = ("groups of different block sizes: vLLM keys partial tail entries inside the "
                   "larger blocks, which prefixkv's block objects do not follow")
    elif any(spec.sparse for spec in layout.groups):
        unserved = ("Mamba groups: vLLM hashes only some of their states, which prefixkv's block objects "
                   "do not follow")
    rows = [g for g, spec in enumerate(layout.groups) if not spec.releases and g not in fine] \
        or range(len(layout.groups))
    view = BlockHashView(lookups, core.held_content, core.held_contents, len(layout.groups), unserved,
                         rows, core.num_blocks)
    view.scanned = [g for g in range(len(layout.groups)) if g not in fine]
    return view
