"""``ConnectorConfig``: the keys of ``kv_connector_extra_config`` that
``PrefixKVConnector`` reads, and the ``StoreLayout`` of a vLLM configuration.

    redis_url      the store (required): redis://host:port/db, rediss://..., unix://...
    ttl            seconds a block lives in the store (86400)
    timeout        seconds a worker's store call may take (fetch, save) (0.25)
    lookup_timeout seconds a lookup (EXISTS) may take once sent (0.02)
    lookup_thread  a bool: look up on the connector's own thread, the scheduler told
                   "not yet" until the answer is back (True); False: on the
                   scheduler's thread, which waits for it (up to lookup_timeout)
    retry_after    seconds without store calls after a failure (1.0)
    hash_seed      an int: the sha256 chain's seed, equal on every replica (None: fixed)
    model          the model's name in the layout (default: vLLM's model and revision;
                   set it when weights change under one name)
    max_pending    block writes queued at most per worker, then dropped (1024)
    fetch_threads  fetch threads per worker (2)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from ...store.record import StoreLayout

_NUMBERS = {"ttl": 86400, "timeout": 0.25, "lookup_timeout": 0.02, "retry_after": 1.0,
            "max_pending": 1024, "fetch_threads": 2}
_INTS = ("ttl", "max_pending", "fetch_threads")


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings (see the module docstring)."""

    redis_url: str
    ttl: int
    timeout: float
    lookup_timeout: float
    lookup_thread: bool
    retry_after: float
    hash_seed: int | None
    model: str | None
    max_pending: int
    fetch_threads: int

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Read ``kv_connector_extra_config``. Raises ConfigError for a missing
        ``redis_url``, an unknown key, or a value of the wrong type or range."""
        extra = dict(extra or {})
        known = {"redis_url", "hash_seed", "model", "lookup_thread", *_NUMBERS}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        url = extra.get("redis_url")
        if type(url) is not str or not url:
            raise ConfigError("PrefixKVConnector needs kv_connector_extra_config['redis_url'], "
                              "e.g. 'redis://127.0.0.1:6379/0'")
        values: dict[str, Any] = {}
        for key, default in _NUMBERS.items():
            v = extra.get(key, default)
            typed = type(v) is int if key in _INTS else type(v) in (int, float)
            # (retry_after may be 0: retry at once)
            if not typed or not ((0 <= v if key == "retry_after" else 0 < v) and v < float("inf")):
                bound = ">= 0" if key == "retry_after" else "> 0"
                raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a finite "
                                  f"{'int' if key in _INTS else 'number'} {bound}, got {v!r}")
            values[key] = v
        seed, model = extra.get("hash_seed"), extra.get("model")
        thread = extra.get("lookup_thread", True)
        if type(thread) is not bool:
            raise ConfigError(f"lookup_thread must be a bool, got {thread!r}")
        if seed is not None and (type(seed) is not int or seed < 0):
            raise ConfigError(f"hash_seed must be an int >= 0 or None, got {seed!r}")
        if model is not None and (type(model) is not str or not model):
            raise ConfigError(f"model must be a non-empty str, got {model!r}")
        return cls(redis_url=url, hash_seed=seed, model=model, lookup_thread=thread, **values)


def store_layout(vllm_config: Any, kv_cache_config: Any, model: str | None, tp_rank: int) -> StoreLayout:
    """The layout of TP rank ``tp_rank``'s blocks: the model (name and revision, or
    ``model``), the tensor-parallel shape, the attention spec (heads, head sizes, block
    size), the layers, what else changes the model's KV (quantization, ``hf_overrides``,
    the model's dtype under a cache of another, a platform's KV cache dtype) and a draft
    model of its own weights, so that a value written under another of these never serves.
    Raises ConfigError for what the connector does not support: several KV-cache
    groups (hybrid models), an attention spec other than full attention, pipeline
    parallelism."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"PrefixKVConnector supports models with one KV-cache group "
                          f"(full attention), this one has {len(groups)}")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind != "FullAttentionSpec" or getattr(spec, "sliding_window", None) is not None:
        raise ConfigError(f"PrefixKVConnector supports full attention only, got {kind}")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("PrefixKVConnector does not support pipeline parallelism")
    mc = vllm_config.model_config
    name = model if model is not None else f"{mc.model}@{mc.revision}"
    layers = len(groups[0].layer_names)
    text = (f"vllm|{name}|tp{tp_rank}/{parallel.tensor_parallel_size}|layers{layers}"
            f"|H{spec.num_heads}|N{spec.block_size}|K{spec.head_size}|V{spec.head_size_v}"
            f"|{spec.kv_quant_mode}{_custom_format(vllm_config)}"
            f"{_computed_by(mc, spec.dtype)}{_draft(vllm_config)}")
    return StoreLayout(text, str(spec.dtype), layers * spec.unpadded_page_size_bytes)


def _draft(vllm_config: Any) -> str:
    """A draft model of its own weights (EAGLE, a draft model): its KV layers share the
    connector's one KV-cache group with the target's, so its blocks hold the draft's KV
    too. Empty without one, and for drafts of the target's own weights (MTP, n-gram)."""
    draft = getattr(getattr(vllm_config, "speculative_config", None), "draft_model_config", None)
    mc = vllm_config.model_config
    if draft is None or (draft.model, draft.revision) == (mc.model, mc.revision):
        return ""
    q = getattr(draft, "quantization", None)
    return f"|draft={draft.model}@{draft.revision}" + (f"|dq={q}" if q is not None else "")


def _custom_format(vllm_config: Any) -> str:
    """A ``--kv-cache-dtype`` a platform registered (``register_kv_cache_dtype``) by its
    name: its bytes are its own, and its quant mode may say nothing of them
    (``KVQuantMode.CUSTOM`` is an alias of ``OCTAVE_K3V4``: both 12). Empty for vLLM's
    own dtypes, whose mode, torch dtype and page size tell them apart. vLLM 0.33's KV
    scales are per layer and static (from the checkpoint, named with its quantization,
    or 1.0), or per token and head inside the page: none is computed apart from a
    block at runtime."""
    from vllm.config.cache import get_kv_cache_dtype_handler

    name = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    return f"|kv={name}" if get_kv_cache_dtype_handler(str(name)) is not None else ""


def _computed_by(mc: Any, kv_dtype: Any) -> str:
    """What changes the KV of one model name and revision besides the cache's shape:
    the weights' quantization, Hugging Face config overrides (RoPE, ...), and the
    model's dtype where the cache has another (an fp8 cache). Empty for a model run as
    it comes, so that its layout, and the keys of its stored blocks, stay as they were."""
    out = ""
    quantization = getattr(mc, "quantization", None)
    if quantization is not None:
        out += f"|q={quantization}"
    overrides = getattr(mc, "hf_overrides", None)
    if callable(overrides):
        out += f"|hf={overrides.__module__}.{overrides.__qualname__}"
    elif overrides:
        text = json.dumps(overrides, sort_keys=True, default=repr)
        out += f"|hf={hashlib.sha256(text.encode()).hexdigest()[:16]}"
    dtype = getattr(mc, "dtype", kv_dtype)
    if str(dtype) != str(kv_dtype):
        out += f"|compute={dtype}"
    return out
