"""``SharedStore``: a shared KV store (L3) as managers see it (a backend, a layout, how
fetches run); ``bind`` gives one manager its ``StoreLink``. Keys are

    prefixkv:<namespace>:<hex chain hash>
    namespace = hex(sha256(layout digest, block size, hash mode, chain root, salt)[:12])

so replicas of one model, layout, hash mode and seed find each other's blocks, and
requests with different cache salts (tenants) never read each other's. Chain hashes must
be equal in every process: a store needs ``hash_mode="sha256"`` or an explicit seed.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import ConfigError, check_positive
from ..extra_keys import ExtraKeys
from ..hashing import make_hash_fn
from .cost import FetchCost
from .link import StoreLink
from .protocol import StoreBackend
from .record import StoreLayout
from .threads import FetchThreads


def _check_number(name: str, value: object, low: float, strict: bool) -> None:
    ok = isinstance(value, (int, float)) and type(value) is not bool and \
        value < float("inf") and (value > low if strict else value >= low)
    if not ok:
        raise ConfigError(f"{name} must be a finite number {'>' if strict else '>='} {low}, got {value!r}")


class SharedStore:
    """A backend and what its values hold. ``max_fetch``: blocks fetched at most per
    request. ``timeout``: seconds a fetch may take in all (one deadline for the whole
    fetch, however the store trickles its answer); past it, the blocks are computed.
    ``retry_after``: seconds without fetches after a fetch failed as a whole (down, too
    slow). ``connections``: parts a fetch is read in, in parallel (one connection each).
    ``cost``: the fetch-or-compute rule (``FetchCost``; its default states the engine's
    prefill throughput). ``executor``: what runs fetches (anything with
    ``submit(fn, *args)``; default: ``connections`` ``FetchThreads``, started when a
    manager binds the store). ``clock``: the monotonic clock deadlines are read from.
    Raises ConfigError for a layout that is not a StoreLayout or a figure out of range."""

    def __init__(self, backend: StoreBackend, layout: StoreLayout, *, max_fetch: int = 64,
                 timeout: float = 1.0, retry_after: float = 1.0, connections: int = 2,
                 cost: FetchCost | None = None, executor: Any = None) -> None:
        if not isinstance(layout, StoreLayout):
            raise ConfigError(f"layout must be a StoreLayout, got {layout!r}")
        for name, v in (("max_fetch", max_fetch), ("connections", connections)):
            if type(v) is not int or v <= 0:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        _check_number("timeout", timeout, 0, True)
        _check_number("retry_after", retry_after, 0, False)
        if cost is not None and not isinstance(cost, FetchCost):
            raise ConfigError(f"cost must be a FetchCost, got {cost!r}")
        self.backend, self.layout = backend, layout
        self.max_fetch, self.timeout, self.retry_after = max_fetch, float(timeout), float(retry_after)
        self.connections = connections
        self.cost = cost if cost is not None else FetchCost()
        self._executor = executor
        self.clock = time.monotonic

    @property
    def executor(self) -> Any:
        """What runs the fetches (``FetchThreads``, started on first use)."""
        if self._executor is None:
            self._executor = FetchThreads(self.connections)
        return self._executor

    def key_prefix(self, block_size: int, hash_mode: str = "sha256", seed: int | bytes | None = None,
                   cache_salt: str | None = None) -> bytes:
        """``b"prefixkv:<namespace>:"``: the keys of managers with this block size, hash
        mode and seed, for requests with ``cache_salt`` (an ACL key pattern per tenant).
        Raises ConfigError as ``bind``, for a bad hash mode or seed, and for a block size
        that is not a positive int."""
        check_positive("block_size", block_size)
        fn, root = make_hash_fn(hash_mode, seed)
        extra = ExtraKeys(cache_salt=cache_salt) if cache_salt is not None else None
        return self.bind(hash_mode, seed, root, block_size, None, None).prefix(extra)

    def bind(self, hash_mode: object, seed: object, root: bytes, block_size: int, stats: Any,
             chain: Any) -> StoreLink:
        """The link a manager uses (``chain``: its ``Hasher.chain``). Raises ConfigError
        unless the chain hashes are the same in every process: ``hash_mode="sha256"``,
        or ``"xxhash"`` with a seed, and for a ``block_size`` past what a value's head
        names (4 bytes: below 2**32)."""
        if not 0 < block_size < 1 << 32:
            raise ConfigError(f"a shared store names a block_size in 4 bytes: block_size must be "
                              f"below 2**32, got {block_size}")
        if hash_mode == "xxhash" and seed is None:
            raise ConfigError("a shared store needs block hashes that are equal in every "
                              "process: use hash_mode='sha256' or give xxhash a seed")
        if hash_mode not in ("xxhash", "sha256"):
            raise ConfigError(f"a shared store needs hash_mode 'sha256' or 'xxhash' with a "
                              f"seed (a name every process agrees on), got {hash_mode!r}")
        link = StoreLink(self, hash_mode.encode(), root, block_size, stats, chain)
        if chain is not None:
            self.executor  # noqa: B018 (its threads start with the manager, not a fetch)
        return link

    def close(self) -> None:
        """Stop the fetch threads once the fetches under way end (a later fetch starts
        new ones)."""
        ex, self._executor = self._executor, None
        if ex is not None and hasattr(ex, "shutdown"):
            ex.shutdown(wait=True)
