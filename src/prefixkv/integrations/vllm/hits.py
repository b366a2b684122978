"""The hit a waiting request would reuse: vLLM's ``KVCacheManager`` calls that find it
(``get_computed_blocks`` and its connector's variant, ``truncate_computed_blocks``,
``prefix_cache_lookup_enabled``) and how prefixkv's lookup finds it (``lookup``): the
longest prefix every group serves, EAGLE's shortened hit (``eagle_hit``), or the other
groups' beside an uncached window (``uncached_hit``). None changes anything but the
metrics collector's notes. The hit is prefixkv's own lookup: found and verified by
content, so ``request.block_hashes`` is not read; the prompt it looks up is admission's
(``slots.admission_prompt``).

The calls are methods of manager.py's ``KVCacheManager`` (``self``), whose class body
lists them (``get_computed_blocks = hits.get_computed_blocks``); the functions below them
take the manager as ``m`` and hold no state of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from prefixkv.core.prompt import Prompt
from prefixkv.errors import RequestError
from prefixkv.extra_keys import ExtraKeys

from . import sessions
from .layout import UnsupportedByPrefixKV
from .mamba import junction
from .requests import reads_cache
from .slots import admission_prompt

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["TruncationError", "create_kv_cache_blocks", "eagle_hit", "get_computed_blocks",
           "get_computed_blocks_for_connector", "lookup", "prefix_cache_lookup_enabled",
           "truncate_computed_blocks", "uncached_hit"]


def prefix_cache_lookup_enabled(self: KVCacheManager, request: Request) -> bool:
    """Whether the request's admission reads the cache: caching is on and the request
    does not ask for every position computed (prompt logprobs, pooling)."""
    return self.enable_caching and reads_cache(request)


def get_computed_blocks(self: KVCacheManager, request: Request, max_cache_hit_length: int | None = None
                        ) -> tuple[KVCacheBlocks, int, int]:
    """The cached prefix a waiting request would reuse now: its blocks per group (vLLM's
    null block where a window no longer reads one), its tokens (a multiple of
    block_size, at most ``num_tokens - 1``) and the shared-prefix boundary (beside
    a Mamba group, vLLM's junction: ``mamba.junction``; else 0). Changes nothing.
    The hit is the longest every group serves within ``max_cache_hit_length``; with
    ``use_eagle``, less its last block (vLLM's EAGLE recomputes it)."""
    if self._watch_sessions and getattr(request, "session_id", None) is not None:  # (the first of a session)
        sessions.seen(self, request.session_id)
    blocks, n = lookup(self, request, max_cache_hit_length)
    return blocks, n, junction(self, request, n, max_cache_hit_length)


def get_computed_blocks_for_connector(self: KVCacheManager, request: Request,
                                      max_cache_hit_length: int | None = None
                                      ) -> tuple[KVCacheBlocks, int, int, bool]:
    """``get_computed_blocks`` and False: hits never diverge between groups here.
    Raises UnsupportedByPrefixKV beside a Mamba group (vLLM's per-group hits)."""
    if self._mamba.groups:
        raise UnsupportedByPrefixKV("prefixkv does not offer a connector's per-group hits "
                                    "beside a Mamba group")
    return *self.get_computed_blocks(request, max_cache_hit_length), False


class TruncationError(RequestError, AssertionError):
    """``truncate_computed_blocks`` at a point a group's blocks cannot be cut at: not a
    multiple of the group's block size, or past the blocks a group (not Mamba's) holds.
    A RequestError that is also the AssertionError vLLM's manager raises there."""


def truncate_computed_blocks(self: KVCacheManager, blocks: KVCacheBlocks, num_computed_tokens: int
                             ) -> KVCacheBlocks:
    """``blocks`` cut to the first ``num_computed_tokens`` (a multiple of each group's
    block size): each group's first ``num_computed_tokens // its block size``; a Mamba
    group may hold fewer (its state may come from a connector), and keeps those. Never
    changes ``blocks``. Raises TruncationError, as vLLM's (an assert), where a group
    cannot be cut there."""
    out = []
    for g, (group, b) in enumerate(zip(blocks.blocks, self.group_sizes, strict=True)):
        n, odd = divmod(num_computed_tokens, b)
        if odd or (n > len(group) and g not in self._mamba.groups):
            raise TruncationError(f"truncate_computed_blocks: group {g} (block size {b}) holds "
                                  f"{len(group)} blocks; it cannot be cut at {num_computed_tokens} tokens")
        out.append(list(group[:n]))
    return KVCacheBlocks(tuple(out))


def create_kv_cache_blocks(self: KVCacheManager, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
    """vLLM's ``KVCacheBlocks`` of ``blocks`` (one list per group; the manager's shared
    empty one when every group is empty, as vLLM's). Builds a result and changes
    nothing: a hit built here is checked where it is used (``allocate_slots`` takes
    only the hit ``get_computed_blocks`` reports). Raises RequestError when ``blocks``
    is not one list (or tuple) per group."""
    if not isinstance(blocks, (tuple, list)) or len(blocks) != self.num_kv_cache_groups \
            or not all(isinstance(g, (tuple, list)) for g in blocks):
        raise RequestError(f"create_kv_cache_blocks takes one list of blocks per group "
                           f"({self.num_kv_cache_groups}), got {blocks!r}")
    return KVCacheBlocks(tuple(blocks)) if any(blocks) else self.empty_kv_cache_blocks


def lookup(m: KVCacheManager, request: Request, max_cache_hit_length: int | None
           ) -> tuple[KVCacheBlocks, int]:
    """``get_computed_blocks`` (its contract is above) less its last 0: the hit's
    blocks per group and tokens, noted to the metrics collector; none when the request
    does not read the cache. The hit is the longest within ``max_cache_hit_length``
    (None: no cap); with ``m.use_eagle``, as vLLM's EAGLE finds it (``eagle_hit``);
    beside an uncached window (SWA bounded replay), the other groups' (``uncached_hit``)."""
    if not m.prefix_cache_lookup_enabled(request):
        return m.empty_kv_cache_blocks, 0
    prompt, extra = admission_prompt(m, request)
    if m._odd_hit:  # (EAGLE's, beside an uncached window, or inside a full-attention block: never two)
        if m._hit_caps is not None:  # (hit_caps.py)
            return m._hit_caps.lookup(m, request, prompt, extra, max_cache_hit_length)
        ids = (eagle_hit(m, prompt, extra, request.num_tokens, max_cache_hit_length) if m.use_eagle
               else uncached_hit(m, prompt, extra, max_cache_hit_length))
    else:
        hit = m.core.lookup_block_ids(prompt, extra=extra, max_hit_tokens=max_cache_hit_length)
        ids = hit if m._hybrid else (hit,)  # a window's unread blocks: the null block
    g = m.hit_group
    n, blocks = len(ids[g]) * m.group_sizes[g], m._blocks.of(ids)
    if n:
        m._telemetry.on_accessed(blocks)
    return blocks, n


def uncached_hit(m: KVCacheManager, prompt: Sequence[int] | Prompt, extra: ExtraKeys | None,
                 cap: int | None) -> tuple[tuple[int, ...], ...]:
    """``lookup``'s hit blocks per group beside an uncached window (vLLM's SWA bounded
    replay, never looked up): the other groups', and none for the window, as vLLM's."""
    hit = m.core.lookup_block_ids(prompt, extra=extra, max_hit_tokens=cap)
    return tuple(i if c else () for i, c in zip(hit, m.cached_groups, strict=True))


def eagle_hit(m: KVCacheManager, prompt: Sequence[int] | Prompt, extra: ExtraKeys | None,
              num_tokens: int, cap: int | None) -> tuple[tuple[int, ...], ...]:
    """The hit's blocks per group as vLLM 0.33's EAGLE finds it (``options.eagle_layout``
    says where): a group matches one block past the hit and drops it. With one group
    (vLLM's unitary coordinator) that block lies within the cap (``num_tokens - 1`` by
    default): one full-attention group drops the last block of its hit; with several,
    the hit is within the cap and the block after it may be the prompt's last full one
    (``peek``, in ``m.eagle_groups``)."""
    if not m._hybrid:
        hit = m.core.lookup_block_ids(prompt, extra=extra, max_hit_tokens=cap)
        return (hit[:-1],)
    if m.num_kv_cache_groups == 1 and any(m.eagle_groups):
        bs = m.block_size
        cap = max(0, ((num_tokens - 1 if cap is None else cap) // bs - 1) * bs)
    out: tuple[tuple[int, ...], ...] = m.core.lookup_block_ids(prompt, extra=extra, max_hit_tokens=cap,
                                                               peek=m.eagle_groups)
    return out
