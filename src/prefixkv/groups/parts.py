"""The hybrid manager's construction and the helpers every path through it shares:
functions ``HybridKVCacheManager``'s body lists (``self`` the manager).

The parts, set once at construction: the group specs, the shared pool, the prefix-id
table, the per-group index, the requests, the hasher and the event log. The helpers: the
full blocks' data (``_prepare``: token chunks, extra bytes and, when events are on,
chain hashes, computed before any change) and their recording in every group's index
(``_record``); the blocks that new table entries take (``_num_fresh``); a request's
block ids, tokens' encoding and lookup by id.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ..core.pool import BlockPool
from ..core.prompt import Prompt
from ..errors import MAX_BLOCKS, ConfigError, check_flag, check_positive, live_request
from ..event_log import EventLog, NullSink
from ..hashing import HashFn, encode_tokens, make_hash_fn, token_bytes
from ..index import Hasher
from ..index.announce import Prepared
from ..stats import StatsCounter
from . import lookahead, spec_blocks
from .index import GroupIndex
from .prefixes import Prefix, PrefixTable
from .request import GroupRequest
from .sizes import BlockSizes, manager_sizes
from .spec import MAMBA, SLIDING, GroupSpec, group_specs
from .spec_blocks import aheads

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager


def construct(
    self: HybridKVCacheManager, groups: Sequence[GroupSpec], num_blocks: int, block_size: int | BlockSizes,
    hash_mode: str | HashFn, seed: int | bytes | None, enable_events: bool, max_events: int,
    vocab_size: int | None, enable_caching: bool = True, hash_lookahead_tokens: int = 0,
) -> None:
    """``HybridKVCacheManager.__init__``: check every argument, then build the parts (see
    there for the arguments and what raises)."""
    specs = group_specs(groups)
    check_positive("num_blocks", num_blocks, MAX_BLOCKS)
    sizes = manager_sizes(specs, block_size)
    if not sizes.one_size and not all(s.cached for s in specs):
        raise ConfigError(f"uncached windows (GroupSpec.cached False) are served at one block "
                          f"size only, got {sizes}")
    _check_retention(specs, sizes)
    retains = any(s.retention is not None for s in specs)  # (served at one size by the sized calls too)
    if hash_lookahead_tokens.__class__ is not int or hash_lookahead_tokens < 0:
        raise ConfigError(f"hash_lookahead_tokens must be an int >= 0, got {hash_lookahead_tokens!r}")
    if hash_lookahead_tokens and enable_events:
        raise ConfigError("prefixkv's hybrid manager does not offer lookahead keys "
                          "(hash_lookahead_tokens) with events on")
    sized = retains or sizes.checkpoints or not sizes.one_size or hash_lookahead_tokens  # (lookahead.py)
    if sized and not self._serves_sizes:
        from .manager import HybridKVCacheManager
        from .sized import SizedHybridKVCacheManager
        if type(self) is not HybridKVCacheManager:  # (a subclass of the one-size manager)
            raise ConfigError(f"{type(self).__name__} serves one block size without a window's "
                              f"retention, got {sizes}")
        self.__class__ = SizedHybridKVCacheManager  # (its calls over the same state)
    check_flag("enable_events", enable_events, ConfigError)
    check_flag("enable_caching", enable_caching, ConfigError)
    check_positive("max_events", max_events)
    if vocab_size is not None:
        check_positive("vocab_size", vocab_size)
    reserved = int(any(s.releases for s in specs))
    if num_blocks <= reserved:
        raise ConfigError(f"num_blocks must leave a block beside the null block, got {num_blocks}")
    self.groups = specs
    self.num_blocks = num_blocks
    self.sizes = sizes
    self.block_size = sizes.align
    self._hash_size, self._group_sizes = sizes.hash_size, sizes.sizes
    self.vocab_size = vocab_size
    fn, root = make_hash_fn(hash_mode, seed)
    self._hasher = Hasher(fn, root, callable(hash_mode))
    self._events = EventLog(max_events) if enable_events else NullSink()
    self._table = PrefixTable()
    self._index = GroupIndex(specs, num_blocks, self._table, self._events, enable_caching)
    self._pool = BlockPool(num_blocks, self._index)
    self._null = self._pool.take(1)[0] if reserved else None
    self._requests = {}
    self._stats = StatsCounter()
    self._released = [0] * len(specs)
    self._hit_blocks = [0] * len(specs)
    self._kv_ops = []
    self._nothing = ((),) * len(specs)
    self._sparse = tuple(g for g, s in enumerate(specs) if s.sparse)
    self._ahead, self._ahead0 = aheads(specs), specs[0].ahead
    if self._ahead is not None:  # (the one-token path checks them: the common case runs as before)
        spec_blocks.serve(self)
    if sizes.partial:  # (groups/partial_full.py)
        self._fine = tuple(g for g, (s, b) in enumerate(zip(specs, sizes.sizes, strict=True))
                           if not s.sparse and b > sizes.hash_size)
        plain = tuple(g for g, s in enumerate(specs) if not s.sparse and g not in self._fine)
        if self._fine and plain:  # (full attention of the hash block's size too: looked up in vLLM's order)
            self._fine_plain = (plain, ()) if plain[0] < self._fine[0] else ((), plain)
    self._uncached = not all(s.cached for s in specs)
    self._retains = any(s.retention is not None for s in specs) or sizes.checkpoints \
        or sizes.shared_prefix  # (GroupRequest.marks)
    self._least_new = 0 if self._uncached else 1  # (add_request's num_new_tokens)
    self._record_kinds = tuple(_SPARSE if s.sparse else 0 if s.cached else _UNCACHED for s in specs) \
        if enable_caching else (_UNCACHED,) * len(specs)  # (caching off: nothing recorded)
    # what ``prepare`` reads, fixed from here on (as ``KVCacheManager``'s)
    self._config = (sizes.hash_size, vocab_size, fn, root)
    if hash_lookahead_tokens:  # (groups/lookahead.py)
        self._lookahead, self._tail_gap = hash_lookahead_tokens, max(1, hash_lookahead_tokens)
    self._prompt_hasher = self._hasher if self._index.hashing else None


def _check_retention(specs: Sequence[GroupSpec], sizes: BlockSizes) -> None:
    """Raises ConfigError for a window's or Mamba group's ``retention`` where it is not
    served: beside ``peek`` (vLLM's EAGLE) but a Mamba group's beside ``eagle`` or a
    window's with groups of different block sizes (vLLM's EAGLE moves a peeking window's
    tails a block up: ``BlockSizes.caches``), or an uncached window; a window's beside
    partial hits; a Mamba group's at one block size but beside
    checkpoints (``BlockSizes.checkpoints``: the sized calls serve it); or not a
    multiple of ``sizes.align`` (vLLM's ``scheduler_block_size``). A window's at one block
    size too: the sized manager's calls serve it (groups/sized.py)."""
    got = [s.retention for s in specs if s.retention is not None]
    if not got:
        return
    kinds = {s.kind for s in specs if s.retention is not None}
    if sizes.peek and not (sizes.eagle and kinds == {MAMBA} or not sizes.partial and not sizes.one_size
                           and kinds == {SLIDING}) \
            or not all(s.cached for s in specs) \
            or sizes.partial and kinds - {MAMBA} \
            or sizes.one_size and MAMBA in kinds and not sizes.checkpoints:
        raise ConfigError(f"retention is served without peek and uncached windows, a window's without "
                          f"partial hits, a Mamba group's with groups of different block sizes, got {sizes}")
    if any(r % sizes.align for r in got):
        raise ConfigError(f"a window's retention must be a multiple of align {sizes.align}, got {got}")


def _prepare(self: HybridKVCacheManager, req: GroupRequest, first: int, last: int, parent: Prefix | None,
             prompt: Prompt | None = None) -> Prepared:
    """Token chunks, extra bytes and (when events are on) chain hashes of full (hash)
    blocks ``first..last-1`` (taken from ``prompt`` when it was prepared with them).
    Changes nothing; raises ConfigError if a hash_mode callable fails."""
    extras = req.keys.of_blocks(first, last)
    if self._lookahead:
        lookahead.check_keyed(self, req, last)
    if prompt is not None and last <= len(prompt.chunks):
        chunks = prompt.chunks[first:last]
        if prompt.hashes is not None and self._index.hashing:
            assert parent is None or parent.hash == prompt.hashes[first - 1], \
                "a prepared prompt's chain hashes are those of the prefixes it hits"
            return chunks, extras, prompt.hashes[first:last]
    else:
        h = self._hash_size
        bs4 = 4 * h
        data = token_bytes(req.tokens[first * h:last * h])
        chunks = [data[o:o + bs4] for o in range(0, len(data), bs4)]
    hashes = None
    if self._index.hashing:
        root = parent.hash if parent is not None else self._hasher.root
        assert root is not None, "while hashing, every prefix has its chain hash"
        hashes = self._hasher.chain(root, chunks, extras)
    return chunks, extras, hashes


_SPARSE, _UNCACHED = 1, 2
"""``_record_kinds``: how ``_record`` treats a group's blocks (0: it records them all)."""


def _record(self: HybridKVCacheManager, req: GroupRequest, first: int, prepared: Prepared) -> None:
    """Give full blocks ``first..`` their prefix ids and index them in every cached group
    (in a sparse group, only the block ending where the step ends, at
    ``num_scheduled``: the others hold a state from before their end; none from
    the request's ``tainted_from`` on); move the request's hold to its new last
    block."""
    chunks, extras, hashes = prepared
    last = first + len(chunks)
    sound = last if req.tainted_from is None else max(first, req.tainted_from // self.block_size)
    old = req.nodes[-1] if req.nodes else None
    cut = old is not None and not old.lost and self._index.cut_off(req.tables, first - 1)
    nodes = self._table.extend(old, chunks, extras, hashes, cut)
    events = ([req.keys.for_event(j, self.block_size) for j in range(first, last)]
              if self._index.hashing else None)
    ends = req.num_scheduled == last * self.block_size
    kinds = self._record_kinds
    for g, table in enumerate(req.tables):
        if kinds[g]:
            if kinds[g] == _UNCACHED:  # (never cached nor looked up)
                continue
            part = table[first:last]  # (sparse: a block a step ran past holds the state it had then)
            part = [None if j < len(part) - 1 or not ends else b for j, b in enumerate(part)]
            if req.states:  # (a load's state block: groups/loads.py)
                part = [b if (g, first + j) in req.states else x for j, (x, b) in
                        enumerate(zip(part, table[first:last], strict=True))]
        else:
            part = table[first:last]
        if sound < last:  # (its KV read lost KV: never findable)
            part = part[:sound - first] + [None] * (last - sound)
        self._index.store(g, part, nodes, first, req.tokens, events, self.block_size)  # type: ignore[arg-type]
    self._table.hold(nodes[-1])
    self._table.unhold(old)
    req.nodes += nodes


def _num_fresh(self: HybridKVCacheManager, per_group: int) -> int:
    """Blocks that ``per_group`` new entries in every group's table take: one in a
    sparse group (its last entry; none for none), ``per_group`` in the others."""
    if per_group <= 0:
        return 0
    return sum(1 if s.sparse else per_group for s in self.groups)


def _ids(self: HybridKVCacheManager, req: GroupRequest) -> list[list[int]]:
    null = self.null_block_id
    return [[null if b is None else b.block_id for b in t] for t in req.tables]  # type: ignore[misc]


def _step_encode(self: HybridKVCacheManager, token_ids: Sequence[int]) -> array[int]:
    return encode_tokens(token_ids, self.vocab_size)


def _get(self: HybridKVCacheManager, request_id: Hashable) -> GroupRequest:
    try:
        return self._requests[request_id]
    except Exception:  # unknown, unhashable, or a __hash__ that raises
        return live_request(self._requests, request_id)
