"""vLLM 0.33's lookahead hashing (``num_hash_lookahead_tokens`` = L > 0, its default for
EAGLE/EAGLE3/MTP drafters with prefix caching and no connector) on one full-attention
group: ``LookaheadKVCacheManager``, which ``manager.KVCacheManager`` becomes for such
arguments (docs/lookahead.md).

Its core is prefixkv's ``core.lookahead.LookaheadKVCacheManager``: a block's content
covers the L tokens after it. vLLM caches a request's blocks below
``min(computed - (P - 1), num_tokens - L)`` (P: ``num_prefill_lookahead``); the plug-in
keys (schedules, in prefixkv's terms) up to the same bound: each call's tokens past
``num_tokens - L`` enter as late tokens, as multi-module MTP's re-prefillable ones do
(``reprefill_tokens``, read by slots.admit and growth.grow_live, raised for the call),
and are keyed by a later call once the tokens after them are known. The request's known
tokens reach the core first (``add_tokens``), so it holds each block's lookahead tokens
when it keys the block. A hit needs the L tokens after its last block to be the
reader's own (no EAGLE block drop: vLLM's scheduler passes ``use_eagle=False``).

KV events: each ``BlockStored`` carries ``lookahead_token_ids`` and the extra keys over
each block and the L tokens after it, as vLLM's (``events.to_vllm_events``); its hashes
are prefixkv's chain hashes, which cover those tokens (``core.lookahead_events``).

Beside Mamba groups with vLLM's fine-grained partial hits (``options.lookahead_beside_mamba``)
its core is the hybrid manager with ``hash_lookahead_tokens`` (groups/lookahead.py): the
calls schedule as without lookahead (a Mamba state is where vLLM's step ends), and the
core gives a block its prefix id once the L tokens after it are known: the request's
known tokens reach it (``know_tokens``) at ``cache_blocks`` and after an
``allocate_slots`` that grew the request (as vLLM, which frees the Mamba blocks no step
reads before it caches: a state whose hash comes later than that is never cached). The
prompt's last Mamba boundary and a checkpoint sit ``max(1, L)`` tokens back (``_tail_gap``, read by mamba.py,
checkpoints.py, coordinator.py); multi-module MTP's re-prefillable tokens change nothing
there (vLLM's hybrid coordinator applies them to EAGLE's dropping groups only:
settings.py). No KV events there (refused).

Refused by name (UnsupportedByPrefixKV): beside other groups (``options.check_options``),
with ``use_eagle``, a hash block other than the block, ``delay_cache_blocks`` (a
connector's loads; vLLM keeps the plain hashes beside a connector).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

from prefixkv.errors import check_count

from .layout import UnsupportedByPrefixKV
from .manager import KVCacheManager
from .requests import core_tokens

__all__ = ["LookaheadKVCacheManager"]


class LookaheadKVCacheManager(KVCacheManager):
    """``manager.KVCacheManager`` with lookahead hashing (module docstring); built by
    ``KVCacheManager(...)`` for ``num_hash_lookahead_tokens`` > 0 with caching on."""

    hash_lookahead_tokens: int
    _serves_lookahead = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hash_lookahead_tokens = self.core.hash_lookahead_tokens
        if self._hybrid:  # (beside Mamba: module docstring)
            self._tail_gap = max(1, self.hash_lookahead_tokens)

    def _known(self, request: Request) -> None:
        """The request's known tokens, to its core request (unscheduled), if live."""
        key = self._keys.get(request.request_id)
        if key is not None and self._hybrid:
            self.core.know_tokens(key, core_tokens(request))
        elif key is not None:
            held = self.core.num_tokens(key)
            tokens = core_tokens(request)
            if len(tokens) > held:
                self.core.add_tokens(key, tokens[held:])

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       *args: Any, **kwargs: Any) -> KVCacheBlocks | None:
        """``KVCacheManager.allocate_slots``, keying up to vLLM's bound (module
        docstring); UnsupportedByPrefixKV for ``delay_cache_blocks``."""
        if delay_cache_blocks:
            raise UnsupportedByPrefixKV("prefixkv does not offer delay_cache_blocks with lookahead "
                                        "hashing (vLLM keeps plain hashes beside a KV connector)")
        if self._hybrid:  # (the core keys what it knows, after the step's release: module docstring)
            out = super().allocate_slots(request, num_new_tokens, num_new_computed_tokens,
                                         new_computed_blocks, num_lookahead_tokens,
                                         num_external_computed_tokens, delay_cache_blocks, *args, **kwargs)
            if out is not None:
                self._known(request)
            return out
        late = self.reprefill_tokens
        try:
            cache_to = (request.num_computed_tokens + num_new_computed_tokens
                        + num_external_computed_tokens + num_new_tokens)
            self._known(request)
            self.reprefill_tokens = max(late, cache_to - request.num_tokens + self.hash_lookahead_tokens)
        except TypeError:  # (a bad count: the base call's error)
            pass
        try:
            return super().allocate_slots(request, num_new_tokens, num_new_computed_tokens,
                                          new_computed_blocks, num_lookahead_tokens,
                                          num_external_computed_tokens, delay_cache_blocks, *args, **kwargs)
        finally:
            self.reprefill_tokens = late

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """``KVCacheManager.cache_blocks``, up to vLLM's bound (module docstring)."""
        if num_computed_tokens.__class__ is not int or num_computed_tokens < 0:
            check_count("num_computed_tokens", num_computed_tokens, 0, None)
        self._known(request)
        if self._hybrid:
            super().cache_blocks(request, num_computed_tokens)
            return
        bound = request.num_tokens - self.hash_lookahead_tokens + self.reprefill_tokens
        super().cache_blocks(request, max(0, min(num_computed_tokens, bound)))
