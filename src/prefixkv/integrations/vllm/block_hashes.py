"""vLLM's block hashes asked of prefixkv's pool: ``BlockPool.get_cached_block`` and
``cached_block_hash_to_block``, answered read-only from prefixkv's index.

vLLM keys its cached blocks by ``BlockHash`` (a chain hash over a request's tokens and
extra keys at ``hash_block_size``, ``request.block_hashes``), with the group id appended
(``BlockHashWithGroupId``); a block of a group larger than the hash block is keyed by the
hash at its end. prefixkv finds blocks by content and never reads those hashes. A hash
names one prefix, so the view turns it back into that prefix: the request whose
``block_hashes`` hold it (at index ``j``: its first ``(j + 1) * hash_block_size`` tokens,
with its extra keys), then asks prefixkv's manager which block of each group holds that
prefix (``KVCacheManager.cached_block_id``, ``HybridKVCacheManager.cached_block_ids``).

The requests are those prefixkv's block hasher noted (``PreparedPrompts``: every
``Request`` an engine builds while prefixkv's manager exists, held weakly), so nothing is
recorded on the admission path: the map from hash to request is built when a hash is
first asked for, and grown when one is not in it (``HashedPrefixes``). Connectors ask
every block of a request every step, so each request's prompt is encoded once, into a
probe kept while the request lives (``HashLookups._probe``): a question then costs the
same whatever the request's length (benchmarks/bench_pool_view.py).

A hash no live request of those holds (its request is gone, or was built without that
hasher) cannot be turned into a prefix: ``UnsupportedByPrefixKV``, rather than an answer
that could differ from vLLM's. (vLLM answers a finished request's hash from its own
map. To do so exactly, prefixkv would have to keep, past each request, the content of
every prefix it named while cached: the prompt of each finished request whose blocks
stay cached, on every engine, for connectors that may never ask.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol
from weakref import WeakKeyDictionary, ref

from prefixkv.errors import RequestError
from prefixkv.groups.spec import FULL

from .block_hash_view import BlockHashView, view_for
from .cache_map import CacheMap, cache_map
from .layout import Layout, UnsupportedByPrefixKV
from .prepared import PreparedPrompts
from .requests import core_tokens, extra_keys_of

__all__ = ["CachedBlocks", "HashLookups", "HashedPrefixes", "lookups_for"]

class Probe(Protocol):
    """A prompt encoded once, asked about its prefixes (``KVCacheManager.block_probe``,
    ``HybridKVCacheManager.prefix_probe``)."""

    def ids(self, num_tokens: int) -> Sequence[int | None]:
        """Per group, the prefixkv block id holding the prompt's first ``num_tokens``
        tokens (its primary), or None."""

    def copies(self, num_tokens: int, g: int) -> Sequence[int]:
        """Every block id of group ``g`` holding them: the primary, then its held
        spares."""


ProbeOf = Callable[[Sequence[int], Any], Probe]
"""The manager's probe of ``tokens`` (with extra keys ``extra``)."""


class HashedPrefixes:
    """vLLM block hash -> (the live request whose ``block_hashes`` hold it, the tokens
    of the prefix it names), from the requests ``prompts`` noted.

    A hash not in the map makes a scan of the requests: each one's hashes from where the
    last scan left it (a request's hashes only grow, but where its tokens were cut: a
    chain hash, so its last one scanned then differs now), so a hash of no live request
    (a finished one's, which a connector may still ask) costs one look at each live
    request, not at each of their hashes. The map is made anew after a cut, when a hash
    it holds names no prefix now (its request gone or cut: another may hold it), and
    when it holds twice the live requests' hashes."""

    def __init__(self, prompts: PreparedPrompts, hash_block_size: int) -> None:
        self._prompts = prompts
        self.hash_block_size = self._h = hash_block_size
        self._found: dict[bytes, tuple[ref[Any], int]] = {}
        # a request -> how many of its hashes the map holds, and the last of them
        self._scanned: WeakKeyDictionary[Any, tuple[int, bytes | None]] = WeakKeyDictionary()

    def prefix(self, block_hash: bytes) -> tuple[Any, int] | None:
        """The request and token count of the prefix ``block_hash`` names, None when no
        live noted request holds it."""
        found = self._named(block_hash)
        if found is None:  # (an entry that no longer holds: another live request may)
            self._scan(block_hash in self._found)
            found = self._named(block_hash)
        return found

    def requests(self) -> list[Any]:
        """The live requests noted."""
        return self._prompts.requests()

    def _named(self, block_hash: bytes) -> tuple[Any, int] | None:
        entry = self._found.get(block_hash)
        if entry is None:
            return None
        r, j = entry[0](), entry[1]
        if r is None:
            return None
        hashes, n = r.block_hashes, (j + 1) * self._h
        # (still so: a request's tokens may be cut, its hashes with them)
        return (r, n) if j < len(hashes) and hashes[j] == block_hash and n <= r.num_tokens else None

    def _scan(self, anew: bool) -> None:
        h, scanned = self._h, self._scanned
        todo: list[tuple[Any, int, int]] = []
        live = 0
        for r in self._prompts.requests():
            hashes = r.block_hashes
            m = min(len(hashes), r.num_tokens // h)  # (a hash's prefix within the tokens)
            live += m
            k, last = scanned.get(r, (0, None))
            if k > m or (k and hashes[k - 1] != last):
                anew = True  # (its tokens were cut: hashes the map holds may be gone)
            todo.append((r, k, m))
        if anew or len(self._found) > 2 * live + 64:  # (or the map holds many gone requests')
            self._found.clear()
            scanned.clear()
            todo = [(r, 0, m) for r, _, m in todo]
        found = self._found
        for r, k, m in todo:
            if k < m:
                at, hashes = ref(r), r.block_hashes
                for j in range(k, m):
                    found[hashes[j]] = (at, j)
                scanned[r] = (m, hashes[m - 1])


class CachedBlocks:
    """``cached_block_hash_to_block`` of vLLM's pool, read-only: ``len`` (cached keys,
    one per prefix and group), truth, ``get_one_block`` and ``contain`` by
    ``BlockHashWithGroupId``, and its dict ``_cache`` (a read-only snapshot:
    cache_map.py). Any other use (``insert``, ``pop``: writes) raises
    UnsupportedByPrefixKV."""

    def __init__(self, lookups: HashLookups) -> None:
        self._lookups = lookups

    def __len__(self) -> int:
        return self._lookups.count()

    def get_one_block(self, key: bytes) -> Any:
        """The block cached under ``key`` (a block hash with its group id, 4 bytes big
        endian, appended), None when there is none."""
        block_hash, group = _split(key)
        blocks = self._lookups.get_cached_block(block_hash, (group,))
        return None if blocks is None else blocks[0]

    def contain(self, key: bytes, block_id: int) -> bool:
        """Whether ``key`` maps to the block ``block_id``: vLLM keeps every copy of a
        prefix under its key, so the primary holder or a held spare (a spare emptied
        when its request freed it holds nothing here, where vLLM keeps it cached until
        evicted: docs/groups.md)."""
        block_hash, group = _split(key)
        return block_id in self._lookups.copies(block_hash, group)

    @property
    def _cache(self) -> CacheMap:
        """vLLM's dict, read-only, built from the block objects' hashes (cache_map.py)."""
        view = self._lookups.block_view
        return cache_map(self._lookups._table, "no block hash view" if view is None else view.unserved)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (copy, pickle, hasattr of protocols: the usual answer)
            raise AttributeError(name)
        raise UnsupportedByPrefixKV(f"cached_block_hash_to_block.{name}: prefixkv's pool is not vLLM's; its "
                                    f"view answers len, get_one_block, contain and _cache only (read-only)")


def _split(key: bytes) -> tuple[bytes, int]:
    if not isinstance(key, bytes) or len(key) <= 4:
        raise RequestError(f"a block hash with group id is bytes of the hash and 4 of the group, got {key!r}")
    return key[:-4], int.from_bytes(key[-4:], "big")


class HashLookups:
    """``get_cached_block`` and the count of cached keys for one manager. ``find``: its
    question (per group, the prefixkv block id holding a prefix); ``table``: vLLM's block
    objects (vLLM id = prefixkv id + ``offset``); ``count``: cached keys, None where
    prefixkv cannot count them as vLLM does; ``blind``: group -> its block size, for the
    groups whose partial tail entries (vLLM's ``cache_partial_block``) prefixkv does not
    keep (groups/tails.py: only with events on)."""

    def __init__(self, prefixes: HashedPrefixes, probe_of: ProbeOf, table: Sequence[Any], offset: int,
                 count: Callable[[], int] | None, blind: dict[int, int]) -> None:
        self.prefixes, self._probe_of, self._table, self._offset = prefixes, probe_of, table, offset
        self._count, self._blind = count, blind
        # a request -> the block hashes it had when its probe was made, and the probe (its
        # prompt encoded once: a connector asks every block of a request, every step)
        self._probes: WeakKeyDictionary[Any, tuple[list[bytes], Probe]] = WeakKeyDictionary()
        self.block_view: BlockHashView | None = None  # (the block objects' hashes: lookups_for)

    def count(self) -> int:
        """vLLM's ``len(cached_block_hash_to_block)``: one per prefix cached in a group.
        Raises UnsupportedByPrefixKV where partial tail entries would count and
        prefixkv keeps none (``blind``) or does not count them."""
        if self._count is None:
            raise UnsupportedByPrefixKV("len(cached_block_hash_to_block): vLLM counts partial tail entries "
                                        "of full-attention groups larger than the hash block, which "
                                        "prefixkv does not count")
        return self._count()

    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[Any] | None:
        """vLLM's ``get_cached_block``: the block of each group in ``group_ids`` holding
        the prefix ``block_hash`` names, None when one of them holds none (a group id
        past the groups: None, as vLLM's). Raises RequestError for a hash that is not
        bytes or a group id that is not an int >= 0, UnsupportedByPrefixKV for a hash
        no noted live request holds, or one ending inside a block of a ``blind`` group."""
        if not isinstance(block_hash, bytes):
            raise RequestError(f"a block hash is bytes (vLLM's BlockHash), got {block_hash!r}")
        groups: list[Any]
        try:
            groups = list(group_ids)
        except TypeError:
            groups = [None]
        if any(g.__class__ is not int or g < 0 for g in groups):
            raise RequestError(f"kv_cache_group_ids must be ints >= 0, got {group_ids!r}")
        if not groups:
            return []
        probe, n = self._asked(block_hash, groups)
        ids = probe.ids(n)
        out = []
        for g in groups:
            i = ids[g] if g < len(ids) else None
            if i is None:
                return None
            out.append(self._table[i + self._offset])
        return out

    def copies(self, block_hash: bytes, g: int) -> list[int]:
        """The vLLM ids of every block of group ``g`` holding the prefix ``block_hash``
        names: the one ``get_cached_block`` gives, then its held spares, the oldest
        first. Raises as ``get_cached_block`` (a valid hash, a group ``g`` >= 0)."""
        probe, n = self._asked(block_hash, (g,))
        return [i + self._offset for i in probe.copies(n, g)]

    def _asked(self, block_hash: bytes, groups: Sequence[int]) -> tuple[Probe, int]:
        """The probe of the request whose prefix ``block_hash`` names, and its tokens;
        raises UnsupportedByPrefixKV as ``get_cached_block`` says."""
        found = self.prefixes.prefix(block_hash)
        if found is None:
            raise UnsupportedByPrefixKV(
                f"block hash {block_hash.hex()}: prefixkv finds blocks by content, and no live request "
                f"its block hasher noted holds this hash (vLLM's Requests built while prefixkv's "
                f"manager exists)")
        r, n = found
        for g in groups:
            if n % self._blind.get(g, 1):
                raise UnsupportedByPrefixKV(
                    f"block hash {block_hash.hex()} ends inside a block of group {g}: vLLM may keep a "
                    f"partial tail entry there, which prefixkv keeps only with KV events on")
        return self._probe(r, n, block_hash), n

    def probe_for(self, r: Any, n: int, block_hash: bytes) -> Probe:
        """``r``'s probe, whose first ``n`` tokens' hash is ``block_hash`` (``_probe``)."""
        return self._probe(r, n, block_hash)

    def _probe(self, r: Any, n: int, block_hash: bytes) -> Probe:
        """``r``'s probe, made anew unless the one kept was made while ``r``'s hash of its
        first ``n`` tokens was ``block_hash`` (a chain hash: then the prefix it names is the
        same, whatever ``r``'s tokens did since: cut, grown)."""
        j = n // self.prefixes.hash_block_size - 1
        kept = self._probes.get(r)
        if kept is None or j >= len(kept[0]) or kept[0][j] != block_hash:
            kept = self._probes[r] = (list(r.block_hashes), self._probe_of(
                core_tokens(r), extra_keys_of(r, self.prefixes.hash_block_size)))
        return kept[1]


def lookups_for(core: Any, layout: Layout, prompts: PreparedPrompts, table: Sequence[Any], offset: int,
                events: bool) -> HashLookups:
    """The ``HashLookups`` of a manager over ``core`` (prefixkv's manager of ``layout``;
    ``events``: built with events on, so it keeps partial tail entries)."""
    h = layout.sizes.hash_size
    tails = {g: b for g, (spec, b) in enumerate(zip(layout.groups, layout.sizes.sizes, strict=True))
             if spec.kind == FULL and b > h}
    probe_of: ProbeOf
    if layout.hybrid:
        def probe_of(tokens: Sequence[int], extra: Any) -> Probe:
            probe: Probe = core.prefix_probe(tokens, extra=extra)
            return probe
    else:
        def probe_of(tokens: Sequence[int], extra: Any) -> Probe:
            probe: Probe = core.block_probe(tokens, extra=extra)
            return probe
    count = None if tails else (lambda: int(core.num_cached_blocks))
    # (with partial hits, full attention keeps its partial entries: groups/fine.py)
    blind = {} if events or layout.sizes.partial else tails
    lookups = HashLookups(HashedPrefixes(prompts, h), probe_of, table, offset, count, blind)
    lookups.block_view = view_for(lookups, core, layout)
    return lookups
