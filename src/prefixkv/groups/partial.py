"""vLLM's fine-grained partial hits in the sized manager (``BlockSizes.partial``;
docs/groups.md "Partial hits"), the subset served: Mamba groups of one block size larger
than the hash block, every other group full attention of the hash block's size, no
``peek``.

    tokens        | 0 .. h-1 | h .. 2h-1 | 2h .. 3h-1 | 3h .. 4h-1 |
    full (h)      | block 0  | block 1   | block 2    | block 3    |  keyed nodes[0..3]
    Mamba (4h)    |              block 0 (state at its end)         |  keyed nodes[3]
                                          ^ a partial entry: the state at 3h, keyed nodes[2]

Hits and caching go at the hash block (``BlockSizes.unit``): the hit is the longest
multiple of ``h`` at which every full-attention group finds every block and every Mamba
group finds a block under the prefix id of the whole hit (``longest_hit``). A step that
ends exactly at the prompt's last hash boundary inside a Mamba block records that block
under the boundary's prefix id (a partial entry: ``tail``); the request that computed it
owns it. A state found inside a block is copied on write: a request admitted on it takes
one more block, first of its group's new ones, in the source's place in its table
(``on_hit``), and the owner's next growth takes one more block too, first, to which the
source's entry moves while the owner keeps writing the source (``moved``). Each copy
(source, copy) is queued with ``take_kv_ops`` and both blocks stay held until
``release_copies`` (vLLM's scheduler frees them once the copy ran). Checked against
vLLM's manager through tests/sized_model.py (``partial``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ..core.block import Block, blocks_for
from ..errors import ConfigError, RequestError
from . import partial_full
from .prefixes import Prefix
from .results import GroupBlockCopy
from .spec import FULL, GroupSpec

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager
    from .request import GroupRequest
    from .sizes import BlockSizes

    # request id -> the request and the partial entries (group, block index, block) it owns
    Owners = dict[Hashable, tuple[GroupRequest, list[tuple[int, int, Block]]]]


def check_partial(specs: Sequence[GroupSpec], sizes: BlockSizes) -> None:
    """Raises ConfigError unless partial hits are served on groups ``specs`` of
    ``sizes``: Mamba groups, all of one size larger than the hash block, every other
    group full attention, each a multiple of the hash block, of one size larger than it
    (partial_full.py) at most, beside which others may be of the hash block's size."""
    h = sizes.hash_size
    mamba = {b for s, b in zip(specs, sizes.sizes, strict=True) if s.sparse}
    rest = {(s.kind, b) for s, b in zip(specs, sizes.sizes, strict=True) if not s.sparse}
    if len(mamba) != 1 or min(mamba) <= h or len({b for _, b in rest if b > h}) > 1 \
            or any(k != FULL or b % h for k, b in rest):
        raise ConfigError(f"partial hits are served with Mamba groups of one block size larger than "
                          f"the hash block ({h}) and full-attention groups, each a multiple of the hash "
                          f"block, of one size larger than it at most, got {[s.kind for s in specs]} of "
                          f"{list(sizes.sizes)} (docs/groups.md)")


def longest_hit(self: HybridKVCacheManager, nodes: Sequence[Prefix], limit: int) -> int:
    """The hit in hash blocks: the most of ``nodes`` (at most ``limit``) that every
    full-attention group finds whole and at whose last every Mamba group finds a block
    (full attention larger than the hash block: ``partial_full.longest_hit``)."""
    if self._fine:
        return partial_full.longest_hit(self, nodes, limit)
    find, top = self._index.find, min(limit, len(nodes))
    for g, spec in enumerate(self.groups):
        if not spec.sparse:
            k = 0
            for found in self._index.finds(g, nodes[:top]):
                if not found:
                    break
                k += 1
            top = k
    for k in range(top, 0, -1):  # (``mamba_hit``, inlined: one call less an admission)
        if all(find(g, nodes[k - 1]) is not None for g in self._sparse):
            return k
    return 0


def mamba_hit(self: HybridKVCacheManager, nodes: Sequence[Prefix], top: int) -> int:
    """The most of ``nodes[:top]`` at whose last every Mamba group finds a block."""
    find = self._index.find
    for k in range(top, 0, -1):
        if all(find(g, nodes[k - 1]) is not None for g in self._sparse):
            return k
    return 0


def hit_rows(self: HybridKVCacheManager, nodes: Sequence[Prefix], cuts: list[int],
             rows: list[list[Block]]) -> None:
    """A hit inside a Mamba block: each Mamba group's row is the block found under the
    hit's last prefix id (its cut, the entries below it, unchanged); inside a block of
    full attention larger than the hash block: partial_full.rows."""
    hit = len(nodes) * self._hash_size
    if self._fine and hit % self._group_sizes[self._fine[0]]:
        partial_full.rows(self, nodes, rows)
    for g in self._sparse:
        b = self._group_sizes[g]
        if hit % b and cuts[g] == (hit - 1) // b:
            rows[g] = [self._index.find(g, nodes[-1])]  # type: ignore[list-item]


def cows(self: HybridKVCacheManager, hit: int, cuts: Sequence[int],
         hits: Sequence[Sequence[Block]]) -> set[int]:
    """The Mamba groups, and full-attention groups larger than the hash block, whose
    hit of ``hit`` tokens ends inside their block (a copy on write: one more block
    each)."""
    return {g for g in (*self._sparse, *self._fine) if hit % self._group_sizes[g] and hits[g]
            and cuts[g] + len(hits[g]) == blocks_for(hit, self._group_sizes[g])}


def on_hit(self: HybridKVCacheManager, req: GroupRequest, g: int, j: int, copy: Block) -> None:
    """``copy`` (just taken) replaces the hit's source block ``j`` of group ``g`` in the
    request's table; the copy is queued, both held until ``release_copies``."""
    source = req.tables[g][j]
    assert source is not None
    req.tables[g][j] = copy
    copy.refs += 1
    _queue(self, g, source, copy)


def tail(self: HybridKVCacheManager, req: GroupRequest) -> None:
    """A step ended at ``req.num_scheduled``: when that is the prompt's last hash
    boundary before its last token (with ``sizes.eagle``, one hash block below its last
    hash boundary, where vLLM's EAGLE hit resumes: vLLM's
    ``get_mamba_prefill_checkpoint_position`` with ``drop_eagle_block``), inside a Mamba
    block, record the block under the
    boundary's prefix id (vLLM's ``cache_partial_block``); the request owns the entry
    (``moved`` at its next growth). With ``sizes.shared_prefix``, also when the step
    ended at the request's junction (``req.marks[1:]``), a hash boundary of its prompt
    (vLLM's shared-prefix checkpoint: a sibling's EAGLE hit resumes there)."""
    h, n, p = self._hash_size, req.num_scheduled, req.num_prompt
    if n != self.sizes.replay_at(p, self._tail_gap) or not n:
        if not (self.sizes.shared_prefix and n in req.marks[1:] and n <= p and not n % h):
            return
    node = req.nodes[n // h - 1]
    for g in self._sparse:
        b, table = self._group_sizes[g], req.tables[g]
        j = blocks_for(n, b) - 1
        x = table[j] if n % b and j < len(table) else None
        if x is None or node.lost or self._index.nodes[x.block_id] is node:
            continue
        if self._index.nodes[x.block_id] is not None:  # (a shorter entry: replaced)
            self._index.drop_one(x)
        # (announced as vLLM's ``cache_partial_block`` does: one hash block, the last)
        i = n // h - 1
        self._index.store(g, [x], [node], i, req.tokens, [req.keys.for_event(i, h)], h)
        owners = _owners(self)
        owners.setdefault(req.request_id, (req, []))[1].append((g, j, x))


def pending(self: HybridKVCacheManager, req: GroupRequest) -> list[tuple[int, int, Block]]:
    """The entries ``req`` owns that its next growth moves (none: empty)."""
    owners = self._owners
    got = owners.get(req.request_id) if owners else None
    return got[1] if got is not None and got[0] is req else []


def moved(self: HybridKVCacheManager, req: GroupRequest, g: int, copy: Block) -> None:
    """The owner's growth took ``copy`` (first of group ``g``'s new blocks): the entry
    of its source moves there, the owner keeps the source; the copy is queued, both held
    until ``release_copies``."""
    owners = _owners(self)
    entries = owners[req.request_id][1]
    i = next(i for i, e in enumerate(entries) if e[0] == g)
    _, _, source = entries.pop(i)
    if not entries:
        del owners[req.request_id]
    index = self._index
    node = index.nodes[source.block_id]
    if node is not None:  # (still its entry: move it, in the source's place)
        index.own(g, [copy])
        index.nodes[source.block_id], index.nodes[copy.block_id] = None, node
        copy.key, copy.content_id, copy.hash = source.key, source.content_id, source.hash
        copy.twin = source.twin
        source.key, source.twin = None, False
        if source.event is not None:  # (moved silently, as vLLM's ``move_block_hashes``)
            copy.event, source.event = replace(source.event, block_ids=(copy.block_id,)), None
        if copy.twin:
            listed = index.twins[g][node.pid]
            listed[listed.index(source)] = copy
        else:
            index.entries[g][node.pid] = copy
    source.refs += 1
    _queue(self, g, source, copy)


def num_pending_copies(self: HybridKVCacheManager, request_id: Hashable) -> int:
    """Blocks the request's next growth takes beyond what its tables cover: one per
    partial entry it owns, moved there (0 without partial hits). Raises RequestError
    for an unknown id."""
    return len(pending(self, self._get(request_id)))


def owned_entries(self: HybridKVCacheManager, request_id: Hashable) -> list[tuple[int, int]]:
    """The partial entries the request owns, ``(group, block id)``, in the order
    recorded: those its next growth moves (none: empty). Raises RequestError for an
    unknown id."""
    return [(g, x.block_id) for g, _, x in pending(self, self._get(request_id))]


def forget(self: HybridKVCacheManager, request_id: Hashable) -> None:
    """The request leaves: it owns no entry any more."""
    if self._owners:
        self._owners.pop(request_id, None)


def release_copies(self: HybridKVCacheManager, copies: Sequence[GroupBlockCopy]) -> None:
    """Give back the blocks the copies ``copies`` (from ``take_kv_ops``, copied on write)
    held, once they ran: each copy's source, then its copy, as vLLM's ``free_blocks``
    (a block whose last reference goes joins the free queue). Raises RequestError,
    before any change, for a copy that holds none (not one, or given back already)."""
    held = self._held_copies or []
    left = list(held)
    try:
        copies = list(copies)
    except TypeError:
        raise RequestError(f"copies must be a sequence of GroupBlockCopy, got {copies!r}"[:200]) from None
    for c in copies:
        if c not in left:
            raise RequestError(f"{c!r} holds no blocks (not a copy on write, or given back already)")
        left.remove(c)
    blocks = self._pool.blocks
    order = [blocks[i] for c in copies for i in (c.src, c.dst)]
    held[:] = left
    # (vLLM's order: cached ones evicted in the order given, empty ones reused in the
    # order given, as the pool's ``free``; a spare going returns empty among them, and
    # its primary, if free, takes the spare's place among the cached ones: groups/index.py)
    self._pool.free(order)


def _queue(self: HybridKVCacheManager, g: int, source: Block, copy: Block) -> None:
    op = GroupBlockCopy(source.block_id, copy.block_id, group_idx=g)
    self._kv_ops.append(op)
    if self._held_copies is None:
        self._held_copies = []
    self._held_copies.append(op)


def _owners(self: HybridKVCacheManager) -> Owners:
    if self._owners is None:
        self._owners = {}
    return self._owners
