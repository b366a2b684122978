"""An engine in one call: the tiny model, a runner and an allocator that fit each other.

    groups None   KVCacheManager (or the allocator given)  +  ModelRunner
    groups given  HybridKVCacheManager (or the one given)  +  HybridModelRunner

Both pairs run in the same ``Engine``: only the runner knows whether a sequence's block
ids are one table or one per group.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from prefixkv.allocator import Allocator
from prefixkv.core.manager import KVCacheManager
from prefixkv.core.prompt import Prompt
from prefixkv.extra_keys import ExtraKeys
from prefixkv.groups import GroupAdmission, GroupSpec, HybridKVCacheManager
from prefixkv.hashing import HashFn

from .engine import Engine
from .hybrid import HybridModelRunner
from .model import LlamaConfig, TinyLlama
from .runner import ModelRunner


class UncachedHybridManager(HybridKVCacheManager):
    """A ``HybridKVCacheManager`` that never serves a hit: every admission computes its
    whole prompt (``read_cache=False``) and ``lookup`` finds nothing. Full blocks are
    still indexed as they fill and evicted as usual, which nobody reads: the "caching
    off" side of an engine's cache on/off comparison."""

    def __init__(
        self, groups: Sequence[GroupSpec], num_blocks: int, block_size: int = 16, *,
        hash_mode: str | HashFn = "xxhash", seed: int | bytes | None = None,
        enable_events: bool = False, max_events: int = 1 << 16, vocab_size: int | None = None,
    ) -> None:
        """As ``HybridKVCacheManager``'s (stated here: a wrong argument's TypeError names
        this class)."""
        super().__init__(groups, num_blocks, block_size, hash_mode=hash_mode, seed=seed,
                         enable_events=enable_events, max_events=max_events, vocab_size=vocab_size)

    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int] | Prompt, *,
                    extra: ExtraKeys | None = None, num_new_tokens: int | None = None,
                    resumed: bool = False, read_cache: bool = True, num_lookahead_tokens: int = 0,
                    require_full_fit: bool = False, keep_free: int = 0,
                    num_external_tokens: int = 0, max_hit_tokens: int | None = None,
                    peek: bool | Sequence[bool] = False,
                    num_prompt_tokens: int | None = None, junction: int = 0,
                    hold_tail: bool = True) -> GroupAdmission | None:
        """As ``HybridKVCacheManager.add_request`` with ``read_cache=False``."""
        return super().add_request(request_id, prompt_token_ids, extra=extra,
                                   num_new_tokens=num_new_tokens, resumed=resumed,
                                   read_cache=False, num_lookahead_tokens=num_lookahead_tokens,
                                   require_full_fit=require_full_fit, keep_free=keep_free,
                                   num_external_tokens=num_external_tokens,
                                   max_hit_tokens=max_hit_tokens, peek=peek,
                                   num_prompt_tokens=num_prompt_tokens, junction=junction,
                                   hold_tail=hold_tail)

    def lookup(self, prompt_token_ids: Sequence[int] | Prompt, *,
               extra: ExtraKeys | None = None, max_hit_tokens: int | None = None,
               peek: bool | Sequence[bool] = False) -> int:
        """0, after checking the input as ``HybridKVCacheManager.lookup`` does."""
        super().lookup(prompt_token_ids, extra=extra, max_hit_tokens=max_hit_tokens, peek=peek)
        return 0


def build_engine(config: LlamaConfig | None = None, *, num_blocks: int = 256, block_size: int = 16,
                 enable_caching: bool = True, allocator: Allocator | HybridKVCacheManager | None = None,
                 groups: Sequence[GroupSpec] | None = None, layer_groups: Sequence[int] | None = None,
                 device: torch.device | str = "cpu", backend: str | None = None,
                 enable_events: bool = False, host_blocks: int = 0, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, chunked_prefill: bool = False,
                 max_model_len: int | None = None) -> Engine:
    """A TinyLlama engine in one call: model from ``config`` (defaults), a runner with
    ``num_blocks`` x ``block_size`` caches on ``device`` and ``host_blocks`` host slots,
    and ``allocator`` or a fresh ``KVCacheManager(num_blocks, block_size,
    enable_caching=..., host_blocks=...)``. ``max_num_seqs``, ``max_num_batched_tokens``,
    ``chunked_prefill``, ``max_model_len``: as ``Engine``'s.

    A hybrid model: ``groups`` (``GroupSpec`` per group of layers) gives a fresh
    ``HybridKVCacheManager(groups, num_blocks, block_size)`` (``UncachedHybridManager``
    when ``enable_caching`` is False) and a ``HybridModelRunner`` whose layer ``l``
    belongs to group ``layer_groups[l]`` (default ``l % len(groups)``); a
    ``HybridKVCacheManager`` given as ``allocator`` brings its own groups.
    Raises ValueError for ``groups`` beside an allocator, a host tier with groups, or
    ``layer_groups`` without groups.
    """
    config = config or LlamaConfig()
    if groups is not None and allocator is not None:
        raise ValueError("pass groups or an allocator (which brings its own groups), not both")
    if groups is not None:
        if host_blocks:
            raise ValueError(f"a hybrid manager has no host tier, got host_blocks={host_blocks}")
        cls = HybridKVCacheManager if enable_caching else UncachedHybridManager
        allocator = cls(groups, num_blocks, block_size, enable_events=enable_events,
                        vocab_size=config.vocab_size)
    elif allocator is None:
        allocator = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching,
                                   enable_events=enable_events, vocab_size=config.vocab_size,
                                   host_blocks=host_blocks)
    model = TinyLlama(config)
    runner: HybridModelRunner | ModelRunner
    if isinstance(allocator, HybridKVCacheManager):
        specs = allocator.groups
        layers = layer_groups if layer_groups is not None else [
            layer % len(specs) for layer in range(config.num_layers)]
        runner = HybridModelRunner(model, specs, layers, allocator.num_blocks,
                                   allocator.block_size, device=device, backend=backend,
                                   poison=False)
    elif layer_groups is not None:
        raise ValueError("layer_groups needs groups (or a HybridKVCacheManager as allocator)")
    else:
        runner = ModelRunner(model, allocator.num_blocks, allocator.block_size, device=device,
                             backend=backend, host_blocks=host_blocks)
    return Engine(runner, allocator, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens,
                  chunked_prefill=chunked_prefill, max_model_len=max_model_len)
