"""fp8 KV under SGLang 0.5.23's own controller, device and host pools (a real Redis):
SGLang's fp8 device pools store bytes (``store_dtype`` uint8), so the host pools of an
``fp8_e4m3`` and an ``fp8_e5m2`` deployment of one model are both uint8 with pages of
one size. Before, their layouts were equal and the second prefetched the first's pages
(read as the other fp8 format: other KV), content check passed."""

from __future__ import annotations

import torch

from .controller import Engine, closing  # noqa: F401
from .launched import launched
from .test_controller import redis, s  # noqa: F401


def _engine(s, url: str, kv: str) -> Engine:  # noqa: F811
    dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
    with launched("org/llama-8b", kv_cache_dtype=kv, dtype="bfloat16"):
        engine = Engine(s, url, dtype=dtype, model="llama", named=False)
    assert engine.host.dtype == torch.uint8
    return engine


def test_fp8_deployments_of_the_two_formats_never_load_each_others_pages(s, redis):  # noqa: F811
    a = _engine(s, redis.url, "fp8_e4m3")
    toks = list(range(5000, 5032))
    done, _ = a.backup(toks, seed=7)
    assert done == 32
    assert _engine(s, redis.url, "fp8_e5m2").prefetch(toks) == (0, [])
    done, loaded = _engine(s, redis.url, "fp8_e4m3").prefetch(toks)
    assert done == 32 and len(loaded) == 8
