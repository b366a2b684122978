"""An engine in one call: the tiny model, a runner and an allocator that fit each other.

    groups None   KVCacheManager (or the allocator given)  +  ModelRunner
    groups given  HybridKVCacheManager (or the one given)  +  HybridModelRunner

Both pairs run in the same ``Engine``: only the runner knows whether a sequence's block
ids are one table or one per group.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from prefixkv.allocator import Allocator
from prefixkv.core.manager import KVCacheManager
from prefixkv.groups import GroupSpec, HybridKVCacheManager
from prefixkv.hashing import HashFn

from .engine import Engine
from .hybrid import HybridModelRunner
from .model import LlamaConfig, TinyLlama
from .runner import ModelRunner


class UncachedHybridManager(HybridKVCacheManager):
    """Deprecated: ``HybridKVCacheManager(..., enable_caching=False)`` is the "caching
    off" side of an engine's cache on/off comparison (what ``build_engine`` builds).
    This name builds that manager (no content recorded, nothing found, every block
    returned empty and reused first, as vLLM's with prefix caching off) and warns."""

    def __init__(
        self, groups: Sequence[GroupSpec], num_blocks: int, block_size: int = 16, *,
        hash_mode: str | HashFn = "xxhash", seed: int | bytes | None = None,
        enable_events: bool = False, max_events: int = 1 << 16, vocab_size: int | None = None,
    ) -> None:
        """As ``HybridKVCacheManager``'s with ``enable_caching=False``; warns
        DeprecationWarning."""
        warnings.warn("UncachedHybridManager is deprecated: use HybridKVCacheManager(..., "
                      "enable_caching=False)", DeprecationWarning, stacklevel=2)
        super().__init__(groups, num_blocks, block_size, hash_mode=hash_mode, seed=seed,
                         enable_events=enable_events, max_events=max_events, vocab_size=vocab_size,
                         enable_caching=False)


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
    ``HybridKVCacheManager(groups, num_blocks, block_size, enable_caching=...)`` and a
    ``HybridModelRunner`` whose layer ``l``
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
        allocator = HybridKVCacheManager(groups, num_blocks, block_size, enable_events=enable_events,
                                         vocab_size=config.vocab_size, enable_caching=enable_caching)
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
