"""``SharedStore``: a shared KV store (L3) as the manager sees it.

The manager looks a chain's continuation up in one round trip (``fetch``) and states the
writes of blocks it computed (``put``); both go through a ``StoreBackend``. Keys are

    prefixkv:<namespace>:<hex chain hash>
    namespace = hex(sha256(layout digest, block size, hash mode, chain root, salt)[:12])

so replicas of one model, layout, hash mode and seed find each other's blocks, and
requests with different cache salts (tenants) never read each other's. Chain hashes must
be equal in every process: a store needs ``hash_mode="sha256"`` or an explicit seed.
A failing store costs misses: the error is counted, and the store is left alone for
``retry_after`` seconds (no request waits on a store known to be down), then tried again.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

from ..errors import ConfigError
from ..extra_keys import ExtraKeys
from ..hashing import make_hash_fn
from ..results import StorePut
from ..stats import StatsCounter
from .protocol import StoreBackend
from .record import StoreLayout, block_head, decode_value


class Fetched:
    """A block found in the store and checked: its chain hash, token bytes, extra-key
    bytes and KV payload (an admission's hit until a host slot takes it)."""

    __slots__ = ("hash", "chunk", "extra", "payload")

    def __init__(self, block_hash: bytes, chunk: bytes, extra: bytes, payload: bytes) -> None:
        self.hash, self.chunk, self.extra, self.payload = block_hash, chunk, extra, payload


class SharedStore:
    """A backend and what its values hold. ``max_fetch``: blocks fetched at most per
    lookup (one round trip carries up to ``max_fetch * layout.block_bytes`` bytes).
    ``retry_after``: seconds without store calls after a failure.
    Raises ConfigError for a layout that is not a StoreLayout or a limit out of range."""

    def __init__(self, backend: StoreBackend, layout: StoreLayout, *, max_fetch: int = 64,
                 retry_after: float = 1.0) -> None:
        if not isinstance(layout, StoreLayout):
            raise ConfigError(f"layout must be a StoreLayout, got {layout!r}")
        if type(max_fetch) is not int or max_fetch <= 0:
            raise ConfigError(f"max_fetch must be a positive int, got {max_fetch!r}")
        if type(retry_after) not in (int, float) or not 0 <= retry_after < float("inf"):
            raise ConfigError(f"retry_after must be a finite number >= 0, got {retry_after!r}")
        self.backend, self.layout = backend, layout
        self.max_fetch, self.retry_after = max_fetch, float(retry_after)

    def key_prefix(self, block_size: int, hash_mode: str = "sha256", seed: int | bytes | None = None,
                   cache_salt: str | None = None) -> bytes:
        """``b"prefixkv:<namespace>:"``: the keys of managers with this block size, hash
        mode and seed, for requests with ``cache_salt`` (an ACL key pattern per tenant).
        Raises ConfigError as ``bind`` and for a bad hash mode or seed."""
        _, root = make_hash_fn(hash_mode, seed)
        extra = ExtraKeys(cache_salt=cache_salt) if cache_salt is not None else None
        return self.bind(hash_mode, seed, root, block_size, None).prefix(extra)

    def bind(self, hash_mode: object, seed: object, root: bytes, block_size: int,
             stats: StatsCounter | None) -> StoreLink:
        """The link a manager uses. Raises ConfigError unless the chain hashes are the
        same in every process: ``hash_mode="sha256"``, or ``"xxhash"`` with a seed."""
        if hash_mode == "xxhash" and seed is None:
            raise ConfigError("a shared store needs block hashes that are equal in every "
                              "process: use hash_mode='sha256' or give xxhash a seed")
        if hash_mode != "xxhash" and hash_mode != "sha256":
            raise ConfigError(f"a shared store needs hash_mode 'sha256' or 'xxhash' with a "
                              f"seed (a name every process agrees on), got {hash_mode!r}")
        return StoreLink(self, hash_mode.encode(), root, block_size, stats)


class StoreLink:
    """A SharedStore bound to one manager's hash mode, root and block size. ``stats``
    has a ``store_errors`` count that failures increment."""

    def __init__(self, store: SharedStore, mode: bytes, root: bytes, block_size: int,
                 stats: StatsCounter | None) -> None:
        self._store, self._stats = store, stats
        self._backend = store.backend
        self._digest = store.layout.digest()
        self._payload = store.layout.block_bytes
        self._bs = block_size
        self._scope = self._digest + block_size.to_bytes(4, "little") + mode + b"\0" + root
        self._prefixes: dict[str | None, bytes] = {}
        self._quiet_until = 0.0
        self.max_fetch = store.max_fetch

    def prefix(self, extra: ExtraKeys | None) -> bytes:
        """``b"prefixkv:<namespace>:"`` for requests with these extra keys (their salt)."""
        salt = extra.cache_salt if extra is not None else None
        p = self._prefixes.get(salt)
        if p is None:
            if len(self._prefixes) >= 4096:  # one entry per salt seen: keep it bounded
                self._prefixes.clear()
            tag = b"-" if salt is None else b"S" + salt.encode()
            ns = hashlib.sha256(b"prefixkv-ns\0" + self._scope + b"\0" + tag).hexdigest()[:24]
            p = self._prefixes[salt] = f"prefixkv:{ns}:".encode()
        return p

    def fetch(self, parent: bytes, hashes: Sequence[bytes], chunks: Sequence[bytes],
              extras: Sequence[bytes], extra: ExtraKeys | None) -> list[bytes]:
        """The KV payloads of the longest run of blocks, from the first of ``hashes``,
        whose stored values pass the content check: one round trip; [] when the store
        fails (counted) or is being left alone after a failure."""
        if not hashes or time.monotonic() < self._quiet_until:
            return []
        prefix = self.prefix(extra)
        try:
            values = self._backend.get([prefix + h.hex().encode() for h in hashes])
            if len(values) != len(hashes):
                raise ValueError(f"the store returned {len(values)} values for {len(hashes)} keys")
        except Exception:
            self._failed()
            return []
        out = []
        for value, h, chunk, e in zip(values, hashes, chunks, extras, strict=True):
            payload = decode_value(value, block_head(self._digest, self._bs, parent, chunk, e),
                                   self._payload)
            if payload is None:
                break
            out.append(payload)
            parent = h
        return out

    def put(self, block_id: int, block_hash: bytes, parent: bytes, chunk: bytes, extra: bytes,
            keys: ExtraKeys | None) -> StorePut:
        """The write of device block ``block_id``'s content (chain hash ``block_hash``,
        parent hash ``parent``, token bytes ``chunk``, extra-key bytes ``extra``)."""
        return StorePut(block_id, self.prefix(keys) + block_hash.hex().encode(),
                        block_head(self._digest, self._bs, parent, chunk, extra))

    def _failed(self) -> None:
        if self._stats is not None:  # (None: a link made only for ``prefix``)
            self._stats.store_errors += 1
        self._quiet_until = time.monotonic() + self._store.retry_after
