"""SGLang 0.5.23's own ``RadixCache`` (``sglang/srt/mem_cache/radix_cache.py``, from the
wheel), driven the way its scheduler drives it, for side-by-side tests with prefixkv.

Loading. SGLang's package ``__init__`` files pull in its whole server; this loads only
the radix cache's modules (as examples/sglang_storage.py does for HiCache) and stands in
for these modules, and only these, each listed with why:

- ``sglang.srt.utils.common``: the real one imports orjson, psutil, PIL, starlette, ...
  (not installed: SGLang is installed --no-deps). The radix cache's import chain reads
  six names from it: ``ceil_align`` and ``next_power_of_2`` (arithmetic, written here),
  ``is_cuda``/``is_hip`` (False: a CPU machine), ``get_bool_env_var`` (reads the
  environment as SGLang's does) and ``get_num_new_pages`` (the paged allocator's, never
  called here).
- ``sglang.srt.mem_cache.memory_pool``: registers SGLang's compiled KV-store torch ops at
  import, which do not exist here; the radix cache only names its ``ReqToTokenPool``
  type in an annotation.
- ``sglang.srt.observability.metrics_collector``: imports the whole distributed stack;
  the radix cache uses it only with metrics on (here off).
- the token-to-KV allocator: ``Slots`` below (SGLang's paged allocator frees and
  allocates whole pages of token slots; the radix cache calls only ``free_segment`` and
  reads ``device``).

Driving (what ``scheduler.py`` / ``mem_cache/common.py`` do per request): admission
matches ``tokens[:-1]`` (one prompt token always left to compute) page-aligned, locks the
matched node, takes pages for the rest (evicting unlocked leaves, LRU, when short), or for
a first chunk of it (chunked prefill; ``extend`` the next ones); after each prefill chunk
the tree is checkpointed (``checkpoint``: insert the computed page-aligned
tokens, free the pages another request inserted first, re-lock); decode takes a page
when the sequence crosses a page boundary, caching nothing; at finish the computed
tokens (prompt and outputs but the last sampled one) are checkpointed and the row's
pages past the tree's part freed, and the lock released.
"""

from __future__ import annotations

import os
import runpy
import sys
import types
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sglang_storage.py"


def _stand_ins() -> None:
    """Register the stand-in modules listed in the module docstring."""
    common = types.ModuleType("sglang.srt.utils.common")
    common.ceil_align = lambda x, a: (x + a - 1) // a * a  # type: ignore[attr-defined]
    common.next_power_of_2 = lambda n: 1 << (n - 1).bit_length() if n > 0 else 1  # type: ignore[attr-defined]
    common.is_cuda = common.is_hip = lambda: False  # type: ignore[attr-defined]
    common.get_bool_env_var = (  # type: ignore[attr-defined]
        lambda name, default="false": os.getenv(name, default).lower() in ("true", "1"))

    def get_num_new_pages(*args: Any, **kwargs: Any) -> int:
        raise NotImplementedError("the paged allocator's, not driven here")

    common.get_num_new_pages = get_num_new_pages  # type: ignore[attr-defined]
    sys.modules[common.__name__] = common
    sys.modules["sglang.srt.utils"].__getattr__ = lambda name: getattr(common, name)  # type: ignore[attr-defined]
    pool = types.ModuleType("sglang.srt.mem_cache.memory_pool")
    pool.ReqToTokenPool = type("ReqToTokenPool", (), {})  # type: ignore[attr-defined]
    sys.modules[pool.__name__] = pool
    import sglang.srt.observability  # noqa: F401  (the real package, bare)

    metrics = types.ModuleType("sglang.srt.observability.metrics_collector")
    metrics.STAT_LOGGER_ROLE_RADIX_CACHE = "radix_cache"  # type: ignore[attr-defined]
    metrics.RadixCacheMetricsCollector = object  # type: ignore[attr-defined]
    metrics.radix_cache_metric_labels = metrics.resolve_collector_class = None  # type: ignore[attr-defined]
    sys.modules[metrics.__name__] = metrics


def load() -> types.SimpleNamespace:
    """SGLang's radix cache modules; skips when SGLang is not installed."""
    if "sglang.srt.mem_cache.radix_cache" not in sys.modules:
        try:
            runpy.run_path(str(_EXAMPLE))["load"]()
        except ImportError as exc:
            pytest.skip(str(exc))
        _stand_ins()
    from sglang.srt.mem_cache import base_prefix_cache, radix_cache

    return types.SimpleNamespace(RadixCache=radix_cache.RadixCache, RadixKey=radix_cache.RadixKey,
                                 Insert=base_prefix_cache.InsertParams,
                                 Match=base_prefix_cache.MatchPrefixParams,
                                 Evict=base_prefix_cache.EvictParams)


class Slots:
    """SGLang's paged token-to-KV allocator, in the two calls the radix cache makes: pages
    of ``page_size`` token slots, allocated and freed whole."""

    device = "cpu"

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_pages = list(range(num_pages))

    def alloc(self, n: int) -> list[int] | None:
        """Slots of ``n`` new pages, None when fewer are free."""
        if n > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return [p * self.page_size + i for p in pages for i in range(self.page_size)]

    def free_segment(self, slots: Any, start_pos: int = 0) -> None:
        """Free the pages of ``slots`` (page-aligned; a list or an int64 tensor)."""
        firsts = slots[::self.page_size]
        self.free_pages += [s // self.page_size for s in getattr(firsts, "tolist", lambda: firsts)()]


@dataclass
class Req:
    tokens: list[int]  # with KV computed (the model's view: image placeholders padded)
    extra_key: str | None
    salt: str | None
    row: list[int] = field(default_factory=list)  # a slot per token with KV (and the tail page)
    protected: int = 0  # tokens of ``row`` the tree owns
    node: Any = None
    todo: list[int] = field(default_factory=list)  # prompt tokens a chunked prefill has left


class Radix:
    """SGLang's ``RadixCache`` over ``num_pages`` pages, driven as its scheduler does."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.sgl = load()
        self.P, self.num_pages = page_size, num_pages
        self.slots = Slots(num_pages, page_size)
        self.tree = self.sgl.RadixCache.create_simulated(mock_allocator=self.slots, page_size=page_size)
        self.reqs: dict[str, Req] = {}

    def _key(self, r: Req, tokens: list[int]) -> Any:
        return self.sgl.RadixKey(array("q", tokens), r.extra_key, cache_salt=r.salt)

    def _pages_for(self, r: Req, n: int) -> list[int] | None:
        """Slots of the pages ``r`` needs for ``n`` more tokens, evicting unlocked leaves
        when short (SGLang's ``evict(num_tokens)`` before
        ``alloc_paged_token_slots_extend``); None, evicting nothing, when even evicting
        every unlocked leaf would leave it short (its scheduler checks that first)."""
        need = -(-(len(r.tokens) + n) // self.P) - len(r.row) // self.P
        short = need - len(self.slots.free_pages)
        if short > self.tree.evictable_size() // self.P:  # (the scheduler's check first)
            return None
        if short > 0:
            self.tree.evict(self.sgl.Evict(num_tokens=short * self.P))
        return self.slots.alloc(need)

    def admit(self, rid: str, tokens: list[int], extra_key: str | None, salt: str | None,
              chunk: int | None = None) -> int | None:
        """Admit a request and compute its prompt, or its first ``chunk`` tokens past the
        hit (chunked prefill: ``extend`` computes the rest); returns the hit (tokens),
        None when the pool cannot hold it even after evicting (nothing held then)."""
        r = Req([], extra_key, salt)
        m = self.tree.match_prefix(self.sgl.Match(key=self._key(r, tokens[:-1])))
        hit = m.device_prefix_len
        r.node = m.last_device_node
        self.tree.inc_lock_ref(r.node)
        r.row = [int(x) for x in self.tree.path_device_indices(r.node)]
        r.tokens, r.protected = list(tokens[:hit]), hit
        n = len(tokens) - hit if chunk is None else min(chunk, len(tokens) - hit)
        new = self._pages_for(r, n)
        if new is None:
            self.tree.dec_lock_ref(r.node)
            return None
        r.row += new
        r.tokens, r.todo = list(tokens[:hit + n]), list(tokens[hit + n:])
        self.reqs[rid] = r
        self._checkpoint(r)
        return hit

    def extend(self, rid: str, n: int) -> bool:
        """The next ``n`` prompt tokens of a chunked prefill are computed (then
        checkpointed, as after every prefill chunk); False (nothing changed) when no
        page is left for them."""
        r = self.reqs[rid]
        new = self._pages_for(r, n)
        if new is None:
            return False
        r.row += new
        r.tokens += r.todo[:n]
        del r.todo[:n]
        self._checkpoint(r)
        return True

    def decode(self, rid: str, token: int) -> bool:
        """``token`` (sampled) is appended and its KV computed in a decode step. False
        (nothing changed) when no page is left for it."""
        r = self.reqs[rid]
        assert not r.todo, "decode before the prefill's end"
        if len(r.tokens) == len(r.row):
            new = self._pages_for(r, 1)
            if new is None:
                return False
            r.row += new
        r.tokens.append(token)
        return True

    def _checkpoint(self, r: Req) -> None:
        """SGLang's ``checkpoint(req, up_to=<computed>)``: ``_insert_cache`` (insert the
        page-aligned computed tokens, free the pages the tree already had), then
        re-match and move the lock to the new last node."""
        import torch

        key = self._key(r, r.tokens).page_aligned(self.P)
        values = torch.tensor(r.row[:len(key)], dtype=torch.int64)
        res = self.tree.insert(self.sgl.Insert(key=key, value=values))
        if res.prefix_len > r.protected:
            self.slots.free_segment(r.row[r.protected:res.prefix_len])
        m = self.tree.match_prefix(self.sgl.Match(key=key))
        ids = [int(x) for x in self.tree.path_device_indices(m.last_device_node)]
        assert len(ids) == len(key), (len(ids), len(key))
        r.row[r.protected:len(ids)] = ids[r.protected:]
        r.protected = len(ids)
        self.tree.dec_lock_ref(r.node)
        r.node = m.last_device_node
        self.tree.inc_lock_ref(r.node)

    def finish(self, rid: str) -> None:
        """The request finished (or was aborted after its last step): its computed tokens
        are checkpointed, its pages past the tree's part freed, its lock released."""
        r = self.reqs.pop(rid)
        self._checkpoint(r)
        if len(r.row) > r.protected:
            self.slots.free_segment(r.row[r.protected:])
        self.tree.dec_lock_ref(r.node)

    def reset(self) -> bool:
        """``flush_cache``: only when no request runs; the tree and the allocator
        restart empty."""
        if self.reqs:
            return False
        self.tree.reset()
        self.slots.free_pages = list(range(self.num_pages))
        return True

    def free_pages(self) -> int:
        """Pages neither held nor cached, plus cached pages no request holds (what an
        admission could take)."""
        return len(self.slots.free_pages) + self.tree.evictable_size() // self.P
