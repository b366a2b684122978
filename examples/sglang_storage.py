"""Two SGLang 0.5.23 HiCache storage backends share one Redis through prefixkv: the second
reads the pages the first wrote, under SGLang's own page keys, each page content-checked.

    python examples/sglang_storage.py [--pages 8]

The backends are made as SGLang's cache controller makes them (its
``StorageBackendFactory``, ``--hicache-storage-backend dynamic``, the extra config naming
``prefixkv.integrations.sglang.storage``), and called as it calls them
(``batch_exists``, ``batch_set_v1``, ``batch_get_v1``). The tests in
tests/engines/sglang_hicache use this module's ``load``, ``page_hashes`` and ``HostPool``.

SGLang's own code, imported light: its storage interface and its page hash.

``pip install --no-deps sglang==0.5.23`` (``make test`` does it) puts SGLang's Python
sources on the path without its dependencies. Two package ``__init__`` files are not run
(``sglang`` starts its frontend language and patches transformers; ``sglang.srt.utils``
pulls its server utilities): their packages are registered bare, so that the modules
the tests name, ``sglang.srt.mem_cache.hicache_storage``,
``sglang.srt.mem_cache.storage.backend_factory``,
``sglang.srt.mem_cache.cpp_utils.native_hash`` and ``sglang.srt.utils.cpp_extension_loader``,
run as shipped. SGLang's page hash is its C++ extension, built on first use by SGLang's
loader (torch's JIT build: g++, ninja and OpenSSL's headers).

Stand-in: the host pool (``HostPool`` below). SGLang's ``MHATokenToKVPoolHost`` imports
SGLang's compiled kvcache kernels; the stand-in keeps its ``layer_first`` page layout
(``[2, layers, tokens, heads, head_dim]``) and the calls a storage backend makes on it.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import sys
import types

import torch

VERSION = "0.5.23"


def _bare(name: str) -> None:
    """Register package ``name`` without running its ``__init__``."""
    parent, _, leaf = name.rpartition(".")
    where = sys.modules[parent].__path__ if parent else None
    spec = importlib.machinery.PathFinder.find_spec(leaf, where)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"sglang=={VERSION} is not installed (make test installs it --no-deps)")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    sys.modules[name] = module


def load() -> types.SimpleNamespace:
    """SGLang's modules used here. Raises ImportError when SGLang is not installed."""
    if "sglang" not in sys.modules:
        _bare("sglang")
        import sglang.srt  # noqa: F401  (a namespace package)
        _bare("sglang.srt.utils")
    from importlib.metadata import version

    assert version("sglang") == VERSION, version("sglang")
    from sglang.srt.mem_cache import hicache_storage
    from sglang.srt.mem_cache.cpp_utils import native_hash
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    return types.SimpleNamespace(storage=hicache_storage, factory=StorageBackendFactory,
                                 native_hash=native_hash)


def page_hashes(sgl: types.SimpleNamespace, tokens: list[int], page_size: int,
                prior: str | None = None) -> list[str]:
    """SGLang's page keys of ``tokens`` (its ``get_hash_str``: the native hash)."""
    prior_digest = bytes.fromhex(prior) if prior else None
    return list(sgl.native_hash.get_native_hash(tokens, prior_digest, page_size))


class HostPool:
    """Host pages shaped as SGLang's MHA host pool in its ``layer_first`` layout."""

    layout = "layer_first"

    def __init__(self, size: int, page_size: int, layers: int = 2, heads: int = 2,
                 head_dim: int = 8, dtype: torch.dtype = torch.bfloat16) -> None:
        self.size, self.page_size, self.dtype, self.device = size, page_size, dtype, "cpu"
        self.layer_num, self.head_num, self.head_dim = layers, heads, head_dim
        self.kv_buffer = torch.zeros(2, layers, size, heads, head_dim, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index:index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        self.kv_buffer[:, :, index:index + self.page_size] = data_page.reshape(shape)


def backend(sgl: types.SimpleNamespace, url: str, pool: HostPool, model: str,
            **extra: object) -> object:
    """A PrefixKVStorage made as SGLang's cache controller makes it (its factory, the
    ``dynamic`` backend, the extra config naming ours), bound to ``pool``. ``model`` is
    SGLang's model name and the weights' (``extra_config['model']``): outside an SGLang
    server no launch flags are published, and the backend refuses to start unnamed."""
    config = sgl.storage.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model, extra_config={
            "backend_name": "prefixkv", "class_name": "PrefixKVStorage",
            "module_path": "prefixkv.integrations.sglang.storage", "interface_v1": 1,
            "redis_url": url, "model": model, **extra})
    made = sgl.factory.create_backend("dynamic", config, pool)
    made.register_mem_pool_host(pool)
    return made


def main(argv: list[str] | None = None) -> None:
    from prefixkv.store.server import LocalRedis

    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--pages", type=int, default=8)
    n = args.parse_args(argv).pages
    sgl, page = load(), 16
    keys = page_hashes(sgl, [(i * 13) % 5000 + 1 for i in range(n * page)], page)
    with LocalRedis() as redis:
        pools = [HostPool(4 * n * page, page) for _ in range(2)]
        # a generous bound (0.25 s by default): this machine's CPUs may be shared
        (a, apool), (b, bpool) = [(backend(sgl, redis.url, pool, "example/model", timeout=10.0),
                                   pool) for pool in pools]
        apool.kv_buffer.copy_(torch.randn(apool.kv_buffer.shape))
        wrote = a.batch_set_v1(keys, torch.arange(n * page))
        held = b.batch_exists(keys)
        got = b.batch_get_v1(keys, torch.arange(n * page, 2 * n * page))
        same = torch.equal(bpool.kv_buffer[:, :, n * page:2 * n * page], apool.kv_buffer[:, :, :n * page])
        print(f"backend: {type(a).__name__}; page keys: SGLang's (first {keys[0][:16]}...)")
        print(f"A wrote {sum(wrote)} pages; B found {held} held and read {sum(got)}, "
              f"checked ({b.pages.rejected} rejected)")
        print(f"pages read equal pages written: {same}")


if __name__ == "__main__":
    main()
