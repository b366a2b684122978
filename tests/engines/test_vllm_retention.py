"""vLLM's ``prefix_cache_retention_interval`` (integrations/vllm/retention.py): the
plug-in takes and refuses it where vLLM's own manager does, built side by side on the
same ``KVCacheConfig``, and refuses by name the intervals it does not apply. Needs vllm
installed."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import pytest

from prefixkv import ConfigError

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")


def _full(bs: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _window(bs: int, tokens: int = 32) -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=tokens)


def _mamba(bs: int) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=bs, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align")


LAYOUTS = {
    "full": (_full(16),),
    "window": (_window(16),),
    "full+window": (_full(16), _window(16)),
    "full32+window8": (_full(32), _window(8)),  # (vLLM's test: scheduler 32, hashes 8)
    "full+mamba": (_full(16), _mamba(16)),
}
INTERVALS = (None, 0, 16, 32, 33, 64, -16, -32)


def _build(which: str, specs: tuple[Any, ...], interval: int | None) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Vllms
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    cfg = KVCacheConfig(num_blocks=40, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
                        prefix_cache_retention_interval=interval)
    sizes = [s.block_size for s in specs]
    cls = Ours if which == "prefixkv" else Vllms
    return cls(cfg, max_model_len=8192, enable_caching=True, hash_block_size=math.gcd(*sizes),
               scheduler_block_size=math.lcm(*sizes))


def _outcome(which: str, specs: tuple[Any, ...], interval: int | None) -> Any:
    try:
        return _build(which, specs, interval)
    except ValueError as e:
        return e


@pytest.mark.parametrize("interval", INTERVALS)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_interval_is_taken_and_refused_where_vllms_manager_does(name, interval):
    """vLLM's refusal (a ValueError naming what is wrong) is prefixkv's ConfigError with
    vLLM's words; an interval vLLM takes, prefixkv takes (the coordinator's
    ``retention_interval`` vLLM's) or, when positive beside a window or Mamba group,
    refuses by name (UnsupportedByPrefixKV: prefixkv caches those groups densely).
    Before retention.py, prefixkv took every interval and its coordinator had no
    ``retention_interval``."""
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV

    specs = LAYOUTS[name]
    vllms, ours = _outcome("vllm", specs, interval), _outcome("prefixkv", specs, interval)
    if isinstance(vllms, ValueError):
        assert type(ours) is ConfigError, (vllms, ours)
        words = ("no sliding-window or Mamba" if "no sliding-window or Mamba" in str(vllms)
                 else "must be non-negative and a multiple of scheduler_block_size")
        assert words in str(vllms) and words in str(ours), (vllms, ours)
        return
    sparse = name != "full" and interval  # (vLLM's sparse retention of a window or Mamba group)
    if sparse:
        assert isinstance(ours, UnsupportedByPrefixKV), ours
        assert f"prefix_cache_retention_interval={interval}" in str(ours)
        return
    assert not isinstance(ours, Exception), ours
    assert ours.coordinator.retention_interval == vllms.coordinator.retention_interval == interval


@pytest.mark.parametrize("bad", [16.0, "16", True])
def test_an_interval_not_an_int_is_a_config_error(bad):
    """A float, a string or a bool is refused with ConfigError (vLLM's own check would
    take ``True`` as 1 and fail on a string with a TypeError)."""
    with pytest.raises(ConfigError, match="must be an int or None"):
        _build("prefixkv", LAYOUTS["full+window"], bad)


def test_a_refusal_changes_nothing_of_the_config():
    """The check reads the config and builds nothing from it (before any state)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from prefixkv.integrations.vllm import KVCacheManager

    cfg = KVCacheConfig(num_blocks=40, kv_cache_tensors=[], prefix_cache_retention_interval=16,
                        kv_cache_groups=[KVCacheGroupSpec(["l"], _full(16))])
    before = dataclasses.replace(cfg)
    with pytest.raises(ConfigError, match="no sliding-window or Mamba"):
        KVCacheManager(cfg, max_model_len=8192, scheduler_block_size=16, hash_block_size=16)
    assert cfg == before
