"""``StoreLink``: a ``SharedStore`` bound to one manager (its hash mode, root, block
size and stats): key names, the writes the plan states, and the fetches, which run on
the store's executor and come back through ``done``.

A fetch that fails as a whole (the store down, or slower than the deadline) leaves the
store alone for ``retry_after`` seconds, so no request waits on a store known to be
down; a key that fails on its own (a value of another type, a refusal) costs that key,
never the store.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..extra_keys import ExtraKeys
from ..hashing import HashFn
from ..results import StorePut
from .fetch import FAILED, REJECTED, Fetch, finish, prepare, read_part
from .record import block_head

if TYPE_CHECKING:
    from .shared import SharedStore

RETIRED_MAX = 16
"""Fetches ``retire`` keeps for the fetcher threads to free at most; past it, the oldest
is freed on the caller's thread (no fetch started since: their memory stays bounded)."""


def reset_root(fn: HashFn, root: bytes, resets: int) -> bytes:
    """The root that names blocks in a shared store after the ``resets``-th reset of
    the prefix cache (``resets`` >= 1) of a process whose first root is ``root`` (chain
    hash ``fn``). A reset is taken to follow a change of the weights, so nothing saved
    before it may be found after it; as the root depends only on the first root and
    the count, processes that reset as often name blocks alike and share again.
    ``KVCacheManager`` and the vLLM connector (``StoreLink.reset``) and the SGLang
    backend put its ``reset_tag`` in their keys, their chain hashes (events, routers,
    the values' heads) unchanged: a replica of one kind shares with one of another
    that reset as often."""
    return fn(root + b"prefixkv reset " + resets.to_bytes(8, "little"))


def reset_tag(root: bytes) -> bytes:
    """What a key carries after its namespace once the cache was reset (``root``: the
    ``reset_root``): ``b"<24 hex>:"``. A block's key before any reset has none, and a
    chain hash's hex holds no colon, so no key of one reset is a key of another."""
    return root.hex()[:24].encode() + b":"


class StoreLink:
    """The manager's handle on its store. ``done``: fetches that ended, in the order
    they did (appended by the fetcher threads, drained by the manager's thread).
    ``stats``: has ``store_errors``/``store_rejected`` counts, incremented when a fetch is
    landed (the manager's thread). ``retired``: fetches the manager is done with, freed
    by the fetcher threads (``retire``)."""

    def __init__(self, store: SharedStore, mode: bytes, root: bytes, block_size: int,
                 stats: Any, chain: Callable[..., list[bytes]] | None) -> None:
        self.store, self.stats, self.chain = store, stats, chain
        self.backend = store.backend
        self.digest = store.layout.digest()
        self.payload = store.layout.block_bytes
        self.block_size = block_size
        self.max_fetch, self.cost = store.max_fetch, store.cost
        self._worth = store.cost.worth_for(self.payload, block_size)  # (checked once, here)
        self._scope = self.digest + block_size.to_bytes(4, "little") + mode + b"\0" + root
        self._root, self.resets = root, 0  # (the first root; resets: ``reset``)
        self.tag = b""  # after a reset: the reset root's ``reset_tag``, in every key after
        # the namespace (``prefix``)
        self._prefixes: dict[str | None, bytes] = {}
        self.quiet_until = 0.0
        self.done: deque[Fetch] = deque()
        self.retired: deque[tuple[Fetch, tuple[Any, ...]]] = deque()

    def prefix(self, extra: ExtraKeys | None) -> bytes:
        """``b"prefixkv:<namespace>:"`` for requests with these extra keys (their salt);
        after a reset, ``b"prefixkv:<namespace>:<reset>:"`` (``reset``), so a key
        pattern of the namespace (a tenant's ACL) still covers it."""
        salt = extra.cache_salt if extra is not None else None
        p = self._prefixes.get(salt)
        if p is None:
            if len(self._prefixes) >= 4096:  # one entry per salt seen: keep it bounded
                self._prefixes.clear()
            tag = b"-" if salt is None else b"S" + salt.encode()
            ns = hashlib.sha256(b"prefixkv-ns\0" + self._scope + b"\0" + tag).hexdigest()[:24]
            p = self._prefixes[salt] = f"prefixkv:{ns}:".encode() + self.tag
        return p

    def reset(self, fn: HashFn) -> None:
        """The prefix cache was reset (``KVCacheManager.reset_prefix_cache``): from now
        on, keys (``prefix``, ``put``) carry after the namespace the first 24 hex digits
        of ``reset_root`` of the first root and the count of resets (``fn``: the chain
        hash). A key made before has another: a write the engine was handed before
        lands where nothing after the reset looks."""
        self.resets += 1
        self.tag = reset_tag(reset_root(fn, self._root, self.resets))
        self._prefixes.clear()

    def put(self, block_id: int, block_hash: bytes, parent: bytes, chunk: bytes, extra: bytes,
            keys: ExtraKeys | None, tag: bytes = b"") -> StorePut:
        """The write of device block ``block_id``'s content (chain hash ``block_hash``,
        parent hash ``parent``, token bytes ``chunk``, extra-key bytes ``extra``).
        ``tag``: a ``reset_tag`` put after ``prefix`` (the vLLM connector's workers,
        whose link never resets: each run carries the tag its scheduler named it by)."""
        return StorePut(block_id, self.prefix(keys) + tag + block_hash.hex().encode(),
                        block_head(self.digest, self.block_size, parent, chunk, extra))

    def worth(self, num_blocks: int, now: float) -> bool:
        """Whether a fetch of ``num_blocks`` may start now: the store is not being left
        alone, and fetching beats computing (``FetchCost``)."""
        return now >= self.quiet_until and self._worth(num_blocks, now)

    def submit(self, f: Fetch, extra: ExtraKeys | None, tag: bytes = b"") -> None:
        """Start ``f`` on the executor (returns at once). Its parts go to that executor
        too, even once ``SharedStore.close`` has dropped it (its shutdown waits for them).
        ``tag``: as for ``put``."""
        ex = self.store.executor
        ex.submit(self._run, f, self.prefix(extra) + tag, ex)

    def retire(self, f: Fetch, *lists: Any) -> None:
        """The manager's thread is done with ``f`` (landed, taken by its request) and
        ``lists`` (its device blocks'): their per-block lists (the slots, the run's
        chunks, hashes and extra bytes, a copy of the token ids), whose objects are cold
        by now, are freed by the fetcher thread that starts the next fetch (a cache miss
        per object that the scheduler's thread does not pay: store-r17.md); at most
        ``RETIRED_MAX`` fetches are kept."""
        retired = self.retired
        retired.append((f, lists))
        if len(retired) > RETIRED_MAX:
            try:  # (a fetcher may have emptied it meanwhile)
                retired.popleft()
            except IndexError:
                pass

    def ended(self, f: Fetch, now: float) -> None:
        """Count what ended ``f`` (the manager's thread, when it lands ``f`` and its run
        stopped at a block that is not ``OK``; the fetcher fed the cost rule already)."""
        if f.stop == REJECTED:
            self.stats.store_rejected += 1
        elif f.stop == FAILED:
            if not f.late:  # (counted when ``poll`` gave up on it at its deadline; one
                # given up for nothing valid left, ``expired`` too, was not)
                self.stats.store_errors += 1
            if f.failed is not None:  # the whole call failed: leave the store alone
                self.quiet_until = now + self.store.retry_after

    # ---- the fetcher threads -------------------------------------------------------------

    def _run(self, f: Fetch, prefix: bytes, ex: Any) -> None:
        retired = self.retired
        while retired:  # (``retire``: freed on this thread)
            try:
                retired.popleft()
            except IndexError:  # (another fetcher thread took the last one)
                break
        try:
            assert self.chain is not None, "a link bound without a chain hash fetches nothing"
            parts = prepare(f, self.chain, self.digest, self.block_size, prefix, self.payload,
                            self.store.connections)
        except Exception as exc:  # (a caller's hash callable): the fetch fails, counted
            f.failed, f.states, f.left = exc, [FAILED] * len(f.slots), 1
            self._last(f)
            return
        for start, stop in parts[1:]:
            try:
                ex.submit(self._part, f, start, stop)
            except Exception:  # (an executor shut down refuses: read it here, else the
                self._part(f, start, stop)  # fetch never ends and its slots stay reserved)
        self._part(f, *parts[0])

    def _part(self, f: Fetch, start: int, stop: int) -> None:
        if read_part(f, self.backend, start, stop, self.payload):
            self._last(f)

    def _last(self, f: Fetch) -> None:
        finish(f, self.payload)
        self.cost.observe(f.nbytes, f.seconds, self.store.clock())  # (a fit: not the scheduler's)
        if f.ready is not None and f.run:
            try:  # (work the scheduler's thread would do at the landing: see ``Fetch.ready``)
                f.ready(f)
            except Exception:  # noqa: S110 (``filled`` stays False: the scheduler fills)
                pass
        self.done.append(f)
