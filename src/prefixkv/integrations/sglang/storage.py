"""``PrefixKVStorage``: an SGLang 0.5.23 HiCache storage backend (L3) on prefixkv's
shared store, every page content-checked (see ``pages``). The only module of prefixkv
that imports SGLang (and torch: SGLang's host pools are torch tensors).

SGLang loads it by module path::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "prefixkv",
            "module_path": "prefixkv.integrations.sglang.storage",
            "class_name": "PrefixKVStorage", "interface_v1": 1,
            "redis_url": "redis://127.0.0.1:6379/0"}'

Its cache controller then calls ``batch_exists`` (how many pages of a prefix the store
holds), ``batch_get_v1``/``batch_set_v1`` (pages straight between the store and host
memory, with ``interface_v1``) or ``batch_get``/``batch_set`` (through flat page
tensors, without it), from its prefetch and backup threads, never the scheduler's.
Keys are SGLang's own page hashes. A page that fails the content check is reported as
not loaded, so SGLang stops its prefetch there and computes the rest. Not offered: the
``*_v2`` calls of hybrid models (Mamba, SWA, DSA pools): their side pools are refused
when SGLang registers them, so such a model does not attach the backend.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)

from ...errors import ConfigError
from ...store.record import StoreLayout
from ...store.redis_store import RedisStore
from .arguments import (
    PageLike,
    check_keys,
    check_places,
    described,
    flat_page_like,
    host_page_starts,
    is_page,
    page_keys,
    page_text,
)
from .identity import layout_text, published
from .pages import PageStore

__all__ = ["PrefixKVStorage"]

_log = logging.getLogger(__name__)


def _page_bytes(page: torch.Tensor) -> bytes:
    """The bytes of a page tensor (any dtype), in its flat element order."""
    return page.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


class PrefixKVStorage(HiCacheStorage):
    """The backend SGLang makes as ``PrefixKVStorage(storage_config, kwargs)``.
    ``storage_config.extra_config`` keys: ``redis_url`` (required), ``ttl`` (seconds a
    page lives, 86400), ``timeout`` (seconds per store call, 0.25; a read also gets its
    bytes' time at ``read_rate``, bytes a second, 1e8), ``retry_after``
    (seconds without store calls after a failure, 1.0), ``model`` (the model's name in
    the layout, default ``storage_config.model_name``: set a revision here when weights
    change under one name or path). Beside it the layout names what SGLang published of
    the weights in this process (``identity``: model path and revision unless ``model``
    is set, quantization, config overrides, KV cache and model dtypes, KV scales file,
    a packed draft model).
    SGLang's own keys of the ``dynamic`` backend
    (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, and
    ``file_storage_path``, which it adds) are allowed.
    Raises ConfigError for a missing ``redis_url``, a value out of range, a key that
    is none of these (a misspelt key would be ignored), decode context parallelism
    (``dcp_size`` > 1: a rank holds a slice of each page), or a process where SGLang
    published no launch flags and ``model`` is not set (nothing would tell other
    weights under one served name apart), before connecting."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        check_keys(extra)
        url = extra.get("redis_url")
        if type(url) is not str or not url:
            raise ConfigError("PrefixKVStorage needs extra_config['redis_url'], e.g. "
                              "'redis://127.0.0.1:6379/0'")
        if getattr(storage_config, "dcp_size", 1) != 1:
            raise ConfigError(f"PrefixKVStorage does not take decode context parallelism "
                              f"(dcp_size {storage_config.dcp_size}): a DCP rank holds a "
                              "slice of each page (SGLang 0.5.23 offers L3 with DCP on its "
                              "file and Mooncake backends only)")
        named = extra.get("model")
        if named is not None and (type(named) is not str or not named):
            raise ConfigError(f"extra_config['model'] must be a non-empty str, got {named!r}")
        self._flags = published()
        if self._flags is None and named is None:
            raise ConfigError("PrefixKVStorage: SGLang published no launch flags in this process "
                              "(sglang.srt.runtime_context), so nothing tells the weights behind "
                              f"model name {storage_config.model_name!r}: set extra_config['model'] "
                              "to a name that changes whenever the weights, quantization, config "
                              "overrides, KV cache dtype or KV scales do")
        model = named if named is not None else storage_config.model_name
        if type(model) is not str or not model:
            raise ConfigError(f"a model name is needed (extra_config['model']), got {model!r}")
        self.config = storage_config
        self._model, self._named = model, named is not None
        self._retry_after = extra.get("retry_after", 1.0)
        if type(self._retry_after) not in (int, float) or not 0 <= self._retry_after < float("inf"):
            raise ConfigError(f"retry_after must be a finite number >= 0, got {self._retry_after!r}")
        self.backend_timeout = extra.get("timeout", 0.25)
        self._read_rate = extra.get("read_rate", 1e8)
        if type(self._read_rate) not in (int, float) or not 0 < self._read_rate < float("inf"):
            raise ConfigError(f"read_rate must be a positive finite number of bytes a second, "
                              f"got {self._read_rate!r}")
        self.backend = RedisStore(url, timeout=self.backend_timeout, ttl=extra.get("ttl", 86400))
        self._pages: PageStore | None = None
        self._page_like: PageLike = (torch.uint8, 0)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the host pool whose pages this backend moves: its dtype, page size,
        layout, page bytes and page format tag (``storage_format_tag``, when it has
        one) enter the StoreLayout (and so every key and value head), with SGLang's
        published flags (``identity.layout_text``; a draft model's only when the pool's
        pages hold draft layers).
        Raises ConfigError (SGLang's attach then fails) for a host pool that cannot hand
        out flat pages (``arguments.flat_page_like``: a ``page_unified`` layout, SGLang's
        MXFP8 pool): every page call would raise in SGLang's storage threads."""
        like = flat_page_like(mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)
        c = self.config
        ranks = "mla" if c.is_mla_model else f"tp{c.tp_rank}/{c.tp_size}"
        text = (f"sglang|{self._model}|{ranks}|pp{c.pp_rank}/{c.pp_size}"
                f"|cp{c.attn_cp_rank}/{c.attn_cp_size}|{mem_pool_host.layout}")
        tag = getattr(mem_pool_host, "storage_format_tag", None)
        if tag is not None:  # (SGLang tags its model name with it; ``model`` replaces that)
            text += f"|format={tag}"
        if self._flags is not None:
            target = getattr(mem_pool_host, "target_layer_num", mem_pool_host.layer_num)
            text += layout_text(self._model, self._flags, named=self._named,
                                draft_layers=mem_pool_host.layer_num > target)
        self._page_like = like
        page_bytes = like[1] * torch.empty(0, dtype=like[0]).element_size()
        layout = StoreLayout(text, str(mem_pool_host.dtype), page_bytes)
        self._pages = PageStore(self.backend, layout, mem_pool_host.page_size,
                                timeout=self.backend_timeout, retry_after=self._retry_after,
                                read_rate=self._read_rate)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take SGLang's KV pool (its hybrid controller registers every pool of its host
        pool group, the KV anchor included); raise ConfigError (SGLang's attach then
        fails) for any other pool (Mamba, SWA, DSA indexer, draft SWA): its pages move
        through the ``*_v2`` calls, which this backend does not offer, so every hit
        query and side-pool transfer of that model would raise in SGLang's threads."""
        if host_pool_name != PoolName.KV:
            raise ConfigError(f"PrefixKVStorage stores KV pages only; the model's "
                              f"{str(host_pool_name)!r} host pool needs SGLang's *_v2 "
                              "storage calls (hybrid models: Mamba, SWA, DSA)")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    @property
    def pages(self) -> PageStore:
        """The page store (its counters: hits, misses, rejected, failed_reads, written,
        failed_writes, failed_calls: see ``PageStore``;
        ``get_stats`` stays SGLang's: its collector takes only its own StorageMetrics).
        Raises ConfigError before ``register_mem_pool_host``."""
        if self._pages is None:
            raise ConfigError("PrefixKVStorage: register_mem_pool_host was not called")
        return self._pages

    def exists(self, key: str) -> bool:
        return self.pages.held([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, the store holds (one round trip)."""
        return self.pages.held(page_keys(keys))

    def _starts(self, keys: list[str], host_indices: Any) -> list[int]:
        """Each page's first host index; ConfigError as ``arguments.host_page_starts``."""
        return host_page_starts(len(page_keys(keys)), host_indices, self.pages.page_size,
                                self.mem_pool_host.size)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each page written into its flat target tensor (``get_dummy_flat_data_page``),
        or a new flat tensor where none is given; None where it is not a checked hit.
        Raises ConfigError (nothing read or written) when the targets are not one a page,
        or one is neither None nor a contiguous page tensor of the host pool's dtype and
        element count."""
        pages, keys = self.pages, page_keys(keys)  # (ConfigError before register_mem_pool_host)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        check_places(len(keys), targets, "target locations")
        for i, t in enumerate(targets):
            if t is not None and not (is_page(t, self._page_like) and t.is_contiguous()):
                raise ConfigError(f"target location {i} must be a contiguous "
                                  f"{page_text(self._page_like)}, got {described(t)}")
        out: list[torch.Tensor | None] = []
        for payload, target in zip(pages.get(keys), targets, strict=True):
            if payload is None:
                out.append(None)
                continue
            if target is None:
                target = self.mem_pool_host.get_dummy_flat_data_page()
            target.view(-1).copy_(torch.frombuffer(payload, dtype=target.dtype))
            out.append(target)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store each page tensor under its key; True when the store took them all.
        Raises ConfigError (nothing stored) when the values are not one a page, or one
        is not a page tensor of the host pool's dtype and element count (a page of
        another dtype with the same bytes would read back as other KV)."""
        pages, keys = self.pages, page_keys(keys)  # (ConfigError before register_mem_pool_host)
        check_places(len(keys), values, "values")
        for i, v in enumerate(values):
            if not is_page(v, self._page_like):
                raise ConfigError(f"value {i} must be a {page_text(self._page_like)}, "
                                  f"got {described(v)}")
        return pages.put([(k, _page_bytes(v)) for k, v in zip(keys, values, strict=True)])

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Page ``i`` read into the host pool at ``host_indices[i * page_size]``; True
        for each page that was a checked hit. Raises ConfigError (nothing read or
        written) unless ``host_indices`` has ``page_size`` entries a page, each a whole
        page inside the pool, none named twice."""
        pool, starts = self.mem_pool_host, self._starts(keys, host_indices)
        dtype = self._page_like[0]
        done = []
        for start, payload in zip(starts, self.pages.get(keys), strict=True):
            if payload is not None:  # (the checked buffer itself: one copy, into the pool)
                pool.set_from_flat_data_page(start, torch.frombuffer(payload, dtype=dtype))
            done.append(payload is not None)
        return done

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Page ``i`` written from the host pool at ``host_indices[i * page_size]``; True
        for each page the store holds after the call (``PageStore.put_pages``: a partly
        refused batch answers per page). Raises ConfigError (nothing stored) unless
        ``host_indices`` has ``page_size`` entries a page, each a whole page inside the
        pool, none named twice."""
        pool, starts = self.mem_pool_host, self._starts(keys, host_indices)
        items = [(k, _page_bytes(pool.get_data_page(start, flat=True)))
                 for start, k in zip(starts, keys, strict=True)]
        return self.pages.put_pages(items)

    def clear(self) -> None:
        """Leave every page stored before unfound by this backend (``PageStore.clear``:
        its keys carry a tag of the count of clears after the namespace; nothing
        is deleted, as the store is shared and never scanned: old pages expire after
        ``ttl``). SGLang calls it on ``POST /hicache/storage-backend/clear`` (after an
        in-place weight update) and on a PD role switch: replicas share again once
        they have cleared as often; until then each misses the others' pages, never
        serves them. Raises ConfigError before ``register_mem_pool_host``."""
        self.pages.clear()
        _log.info("PrefixKVStorage.clear: pages of %s stored before are unfound from now on "
                  "(%d clears: replicas that cleared as often share pages)", self._model,
                  self.pages.clears)

    def close(self) -> None:
        self.backend.close()
