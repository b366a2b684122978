"""The read-only calls of vLLM's ``KVCacheManager`` on one request's blocks: which requests
hold blocks (and prefixkv's id of each), their blocks and block ids per group and the tokens
they hold cached. None changes anything.

Each is a method of manager.py's ``KVCacheManager`` (``self``), whose class body lists it
(``key_of = queries.key_of``) and whose ``__init__`` builds what it reads: prefixkv's
manager (``core``), vLLM's block objects per group (pool.py), the request ids it tracks
and the Mamba groups' step cache (mamba.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.kv_cache_interface import AttentionSpec

from prefixkv.core.block import blocks_for
from prefixkv.errors import RequestError, check_count

if TYPE_CHECKING:
    from .manager import KVCacheManager


def key_of(self: KVCacheManager, request_id: Hashable) -> int | None:
    """prefixkv's id of the live request ``request_id``; None when it holds no blocks.
    Raises RequestError for an id that is not hashable (vLLM's are str)."""
    try:
        return self._keys.get(request_id)
    except TypeError:  # (an unhashable id: before it, no call changes anything)
        raise RequestError(f"a request id must be hashable (vLLM's are str), "
                           f"got {request_id!r}") from None


def live_request_ids(self: KVCacheManager) -> list[str]:
    """The vLLM ids of the requests holding blocks."""
    return list(self._keys)  # type: ignore[arg-type]


def num_cached_tokens(self: KVCacheManager, request_id: str) -> int:
    """Tokens of the live request in its cached (findable) full blocks; 0 when it
    holds none or caching is off."""
    key = self.key_of(request_id)
    if key is None or not self.enable_caching:
        return 0
    n: int = self.core.num_scheduled_tokens(key)
    return n // self.cache_unit * self.cache_unit


def _ids(self: KVCacheManager, key: int) -> tuple[tuple[int, ...], ...]:
    ids = self.core.get_block_ids(key)
    return ids if self._hybrid else (ids,)


def rows_of(self: KVCacheManager, request: Any) -> tuple[tuple[int, ...], ...] | None:
    """prefixkv's block ids of a request per group, None when it holds none (the block
    objects' hashes: block_hash_view.py)."""
    key = self._keys.get(request.request_id)
    return None if key is None else self._ids(key)


def get_blocks(self: KVCacheManager, request_id: str) -> KVCacheBlocks:
    """The request's blocks per group (``empty_kv_cache_blocks`` when it holds none)."""
    key = self.key_of(request_id)
    return self.empty_kv_cache_blocks if key is None else self._blocks.of(self._ids(key))


def get_block_ids(self: KVCacheManager, request_id: str) -> tuple[list[int], ...]:
    """vLLM's block ids of the request per group (empty lists when it holds none)."""
    key = self.key_of(request_id)
    if key is None:
        return tuple([] for _ in range(self.num_kv_cache_groups))
    return self._blocks.vllm_ids(self._ids(key))


def get_block_ids_for_computed_tokens(self: KVCacheManager, request_id: str, num_computed_tokens: int
                                      ) -> tuple[list[int], ...]:
    """``get_block_ids`` clipped to the blocks covering ``num_computed_tokens``, but
    for Mamba groups (either mode), whole (vLLM clips attention groups only). Raises
    RequestError for a count that is not an int >= 0."""
    if num_computed_tokens.__class__ is not int or num_computed_tokens < 0:
        check_count("num_computed_tokens", num_computed_tokens, 0, None)
    n, groups = num_computed_tokens, self.kv_cache_config.kv_cache_groups
    return tuple(ids if not isinstance(groups[g].kv_cache_spec, AttentionSpec)
                 else ids[:blocks_for(n, self.group_sizes[g])]
                 for g, ids in enumerate(self.get_block_ids(request_id)))


def get_num_common_prefix_blocks(self: KVCacheManager, running_request_id: str) -> list[int]:
    """0 per group, as vLLM's (cascade attention is gone from vLLM)."""
    return [0] * self.num_kv_cache_groups
