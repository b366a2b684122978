"""SGLang 0.5.23's own cache controllers, device pools, allocator and host pools on a
CPU, with prefixkv's backend made by its ``dynamic`` factory: the storage threads
(prefetch, prefetch I/O, prefetch sync, backup) are SGLang's, and call the backend as
they do in a server.

What runs as shipped: ``HybridCacheController`` (the class a 0.5.23 server builds for
every model, over a ``HostPoolGroup`` of one KV entry made by SGLang's
``build_pool_entry``, as its ``build_kv_only_group`` does) and its base
``HiCacheController`` (attach, its storage config, the hit query
``_storage_hit_query``, ``_page_transfer`` batch by batch, ``_page_backup``, the
zero-copy and generic page functions, ``terminate_prefetch``), ``MHATokenToKVPool`` /
``MLATokenToKVPool`` (device pools, on the CPU), ``PagedTokenToKVPoolAllocator``,
``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` (host pools, every host layout
whose flat pages SGLang implements), ``get_storage_hash_str`` (page keys, salted per
tenant) and ``StorageBackendFactory``.

Stand-ins, each for a part that does not import on a CPU without SGLang's server
dependencies (``pip install --no-deps``):

- ``orjson`` (only when it is not installed): ``dumps``/``loads`` over ``json``; SGLang's
  utilities import it at the top, the code run here never calls it.
- ``sglang.srt.mem_cache.deepseek_v4_memory_pool``: a module with an empty
  ``DeepSeekV4TokenToKVPool`` class. The controller only asks ``isinstance`` of it
  (rank-replicated compressed MLA); the real module imports DeepGEMM's wrappers and,
  through them, the multimodal configs (torchvision).
- ``sglang.srt.observability.metrics_collector`` (when no test registered it, the same
  as tests/engines/sglang_radix.py's): the four names ``base_prefix_cache`` imports;
  the real module imports the model configs (their quantization methods). Metrics are
  off here.
- The host pool is built with the arguments SGLang's ``build_kv_host_pool`` passes, read
  from its launch flags there (``get_memory()``, not published here): ratio 4, the
  test's layout.
- The scheduler's side (``UnifiedRadixCache``, which imports the whole server):
  ``Engine.prefetch`` does what its ``_drain_and_alloc_storage_hit``,
  ``_drain_ack_prefetch`` and ``check_prefetch_progress`` do with one operation: take
  the hit from ``prefetch_hit_queue``, allocate host indices for it, hand it to
  ``prefetch_buffer``, fold the acks' ``completed_tokens`` in, and, by the prefetch
  policy, terminate it at once (``best_effort``), after a deadline (``timeout``) or
  never (``wait_complete``); the tail past ``completed_tokens`` goes back to the pool
  on the final ack. ``Engine.backup`` allocates host indices, writes the KV there (the
  device-to-host copy) and calls ``write_storage``.
- No process groups: one rank (``tp_group`` None: the rank reductions have no group
  to reduce over); the rank and width of a test's engine are set with
  ``get_parallel().override`` while the controller attaches its backend.

Two package ``__init__`` files run lazily (``sglang.srt.configs``,
``sglang.srt.layers.quantization``: each name they import is imported on first use),
so that the configs of every model are not imported for the few used here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import itertools
import queue
import sys
import threading
import time
import types
from typing import Any

import pytest
import torch

from waiting import PATIENCE as WAIT

from .engine import _EXAMPLE

STAND_INS = ("orjson (when missing)", "sglang.srt.mem_cache.deepseek_v4_memory_pool",
             "sglang.srt.observability.metrics_collector",
             "the scheduler's side of a prefetch and a backup (Engine)")


def _lazy(name: str) -> None:
    """Register package ``name`` whose ``__init__`` imports run on first use of a name."""
    parent, _, leaf = name.rpartition(".")
    spec = importlib.machinery.PathFinder.find_spec(leaf, sys.modules[parent].__path__)
    if spec is None or spec.origin is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not installed")
    names = {}
    with open(spec.origin) as f:
        for node in ast.walk(ast.parse(f.read())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    names[alias.asname or alias.name] = (node.module, alias.name)
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec

    def __getattr__(attr: str) -> Any:
        if attr not in names:
            raise AttributeError(attr)
        value = getattr(importlib.import_module(names[attr][0]), names[attr][1])
        setattr(module, attr, value)
        return value

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = module


def _real_utils() -> None:
    """SGLang's ``sglang.srt.utils`` as shipped (``load`` registers it bare), and the
    real modules in place of tests/engines/sglang_radix.py's stand-ins, when a test of
    this process registered them (modules without a file)."""
    for name in ("sglang.srt.utils.common", "sglang.srt.mem_cache.memory_pool"):
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) is None:
            del sys.modules[name]
    module = sys.modules["sglang.srt.utils"]
    module.__dict__.pop("__getattr__", None)
    if "is_cuda" in module.__dict__:
        return
    spec = importlib.machinery.PathFinder.find_spec("__init__", module.__path__)
    assert spec is not None and spec.origin is not None
    with open(spec.origin) as f:
        exec(compile(f.read(), spec.origin, "exec"), module.__dict__)  # noqa: S102


def load() -> types.SimpleNamespace:
    """SGLang's controller, pools and allocator; skips when SGLang is not installed."""
    sgl = _EXAMPLE["load"]()  # (registers the bare packages; checks the version)
    try:
        importlib.import_module("orjson")
    except ImportError:
        stand_in = types.ModuleType("orjson")
        import json

        stand_in.dumps = lambda obj, *a, **k: json.dumps(obj).encode()  # type: ignore[attr-defined]
        stand_in.loads = lambda data, *a, **k: json.loads(data)  # type: ignore[attr-defined]
        sys.modules["orjson"] = stand_in
    _real_utils()
    if "sglang.srt.configs" not in sys.modules:
        _lazy("sglang.srt.configs")
    importlib.import_module("sglang.srt.layers")
    if "sglang.srt.layers.quantization" not in sys.modules:
        _lazy("sglang.srt.layers.quantization")
    name = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
    if name not in sys.modules:
        stand_in = types.ModuleType(name)
        stand_in.DeepSeekV4TokenToKVPool = type("DeepSeekV4TokenToKVPool", (), {})  # type: ignore[attr-defined]
        sys.modules[name] = stand_in
    name = "sglang.srt.observability.metrics_collector"
    if name not in sys.modules:
        importlib.import_module("sglang.srt.observability")  # (the real package, bare)
        stand_in = types.ModuleType(name)
        stand_in.STAT_LOGGER_ROLE_RADIX_CACHE = "radix_cache"  # type: ignore[attr-defined]
        stand_in.RadixCacheMetricsCollector = object  # type: ignore[attr-defined]
        stand_in.radix_cache_metric_labels = None  # type: ignore[attr-defined]
        stand_in.resolve_collector_class = None  # type: ignore[attr-defined]
        sys.modules[name] = stand_in
    try:
        from sglang.srt.managers import cache_controller
        from sglang.srt.mem_cache import memory_pool, utils
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller, hybrid_pool_assembler
        from sglang.srt.mem_cache.pool_host import HostPoolGroup
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
        from sglang.srt.runtime_context import get_parallel
    except ImportError as exc:
        pytest.skip(f"SGLang's cache controller does not import here: {exc}")
    try:
        utils.get_storage_hash_str([1], None, page_size=1)  # (built on first use)
    except RuntimeError as exc:
        pytest.skip(f"SGLang's native page hash could not be built: {exc.__cause__ or exc}")
    return types.SimpleNamespace(
        sgl=sgl, cc=cache_controller, memory_pool=memory_pool, utils=utils,
        Hybrid=hybrid_cache_controller.HybridCacheController, Handle=CacheRequestHandle,
        entry=hybrid_pool_assembler.build_pool_entry, Group=HostPoolGroup, KV=PoolName.KV,
        Allocator=PagedTokenToKVPoolAllocator, MHAHost=MHATokenToKVPoolHost,
        MLAHost=MLATokenToKVPoolHost, get_parallel=get_parallel)


_rids = itertools.count()


@pytest.fixture(autouse=True)
def closing() -> Any:
    """Close every Engine a test made (each holds four SGLang storage threads, which
    would otherwise poll their queues for the rest of the process)."""
    yield
    while Engine.live:
        Engine.live[-1].close()


class Engine:
    """One SGLang rank's KV tiers: device pool, allocator, host pool and the cache
    controller with prefixkv's backend attached (``dynamic``), as a scheduler builds
    them. ``mla``: DeepSeek-style latent KV (``kv_lora_rank`` 16 + rope 8), else MHA
    (2 KV heads of 8). ``layout``: the host pool's (``--hicache-mem-layout``).
    ``hybrid``: the server's ``HybridCacheController`` over a ``HostPoolGroup``, else
    the base ``HiCacheController`` over the host pool itself. ``named``: ``model`` names
    the weights in the extra config too (no launch flags are published here, and the
    backend takes none from SGLang), else it is SGLang's model name only, as a server
    launches it."""

    def __init__(self, s: types.SimpleNamespace, url: str, *, page: int = 4,
                 layout: str = "layer_first", mla: bool = False, model: str = "test/model",
                 tp_rank: int = 0, tp_size: int = 1, interface_v1: int = 1,
                 dtype: torch.dtype = torch.bfloat16, layers: int = 2, tokens: int = 64,
                 hybrid: bool = True, named: bool = True, **extra: Any) -> None:
        self.s, self.page, self.hybrid = s, page, hybrid
        if mla:
            device = s.memory_pool.MLATokenToKVPool(tokens, page, dtype, 16, 8, layers, "cpu", False)
            info = device.get_device_pool_infos()[0].buffer_info
            host = s.MLAHost(info, 4.0, 0, page, layout, pin_memory=False, device="cpu",
                             device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
                             target_layer_num=layers)
        else:
            device = s.memory_pool.MHATokenToKVPool(tokens, page, dtype, 2, 8, layers, "cpu",
                                                    False, enable_alt_stream=False)
            info = device.get_device_pool_infos()[0].buffer_info
            host = s.MHAHost(info, 4.0, 0, page, layout, pin_memory=False, device="cpu",
                             device_capacity_tokens=tokens, start_layer=0, end_layer=layers)
        self.host = host
        allocator = s.Allocator(tokens, page, dtype, "cpu", device, need_sort=False)
        config = {"backend_name": "prefixkv", "module_path": "prefixkv.integrations.sglang.storage",
                  "class_name": "PrefixKVStorage", "interface_v1": interface_v1,
                  "redis_url": url, "retry_after": 0, "timeout": 10.0,
                  **({"model": model} if named else {}), **extra}
        with s.get_parallel().override(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                       attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
            if hybrid:
                group = s.Group([s.entry(name=s.KV, host_pool=host, device_pool=device,
                                         layer_mapping={i: i for i in range(layers)},
                                         transfer_layer_id_max=layers, is_anchor=True)])
                self.cc = s.Hybrid(allocator, group, page, None, threading.Event(),
                                   io_backend="direct", storage_backend="dynamic",
                                   model_name=model, storage_backend_extra_config=config,
                                   transfer_layer_id_max=layers)
            else:
                self.cc = s.cc.HiCacheController(
                    allocator, host, page, None, threading.Event(), io_backend="direct",
                    storage_backend="dynamic", model_name=model,
                    storage_backend_extra_config=config)
        self.backend = self.cc.storage_backend
        Engine.live.append(self)

    live: list[Engine] = []
    """Engines not closed yet (``closing`` closes them after each test)."""

    def close(self) -> None:
        """Detach the backend (SGLang's detach: stops the storage threads, closes it)."""
        if self in Engine.live:
            Engine.live.remove(self)
            self.cc.detach_storage_backend()

    def fill(self, host_indices: torch.Tensor, seed: int) -> None:
        """Random KV in the host rows ``host_indices`` (what a device-to-host copy writes)."""
        g = torch.Generator().manual_seed(seed)
        for index in host_indices.view(-1, self.page)[:, 0].tolist():
            page = self.host.get_data_page(index, flat=False)
            page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))

    def pages(self, host_indices: torch.Tensor) -> list[torch.Tensor]:
        """A copy of each host page that ``host_indices`` covers (flat)."""
        return [self.host.get_data_page(i, flat=True).clone()
                for i in host_indices.view(-1, self.page)[:, 0].tolist()]

    def backup(self, tokens: list[int], seed: int, salt: str | None = None
               ) -> tuple[int, list[torch.Tensor]]:
        """Back ``tokens`` up as a server does after a request (host, then storage):
        the tokens backed up (SGLang's count, whole pages from the first) and the pages
        written."""
        host_indices = self.cc.mem_pool_host.alloc(len(tokens))
        assert host_indices is not None
        self.fill(host_indices, seed)
        written = self.pages(host_indices)
        hashes = self.hashes(tokens, salt)
        op_id = self.cc.write_storage(host_indices, tokens, hash_value=hashes)
        op = self.cc.ack_backup_queue.get(timeout=WAIT)
        assert op.id == op_id
        self.cc.mem_pool_host.free(host_indices)
        return op.completed_tokens, written

    def hashes(self, tokens: list[int], salt: str | None = None) -> list[str]:
        """SGLang's storage page keys of ``tokens`` (a tenant's ``cache_salt`` seeds them)."""
        seed = self.s.utils.storage_namespace_seed(None, salt)
        return list(self.s.utils.get_storage_hash_str(tokens, seed, page_size=self.page))

    def prefetch(self, tokens: list[int], policy: str = "wait_complete",
                 salt: str | None = None, timeout: float = 0.0,
                 on_hit: Any = None) -> tuple[int, list[torch.Tensor]]:
        """Prefetch ``tokens`` from storage into the host pool as the scheduler drives it
        under ``policy``: the tokens SGLang takes as loaded (its rank-agreed
        ``completed_tokens``) and the host pages they landed in, in order.
        ``on_hit``: called after the hit query, before the pages are read."""
        seed = self.s.utils.storage_namespace_seed(None, salt)
        rid = f"r{next(_rids)}"
        op = self.cc.prefetch(self.s.Handle(rid, 0) if self.hybrid else rid, tokens,
                              last_hash=seed)
        hit = self.cc.prefetch_hit_queue.get(timeout=WAIT)
        assert hit is op
        if op.storage_hit_count == 0:
            return 0, []
        if on_hit is not None:
            on_hit()
        host_indices = self.cc.mem_pool_host.alloc(op.storage_hit_count)
        assert host_indices is not None
        op.host_indices = host_indices
        self.cc.prefetch_buffer.put(op)
        deadline = time.monotonic() + timeout
        terminated = False
        while True:
            if policy == "best_effort" or (policy == "timeout" and time.monotonic() > deadline):
                if not terminated:
                    self.cc.terminate_prefetch(op)
                    terminated = True
            try:
                ack = self.cc.ack_prefetch_queue.get(timeout=0.01 if policy != "wait_complete"
                                                     else WAIT)
            except queue.Empty:
                continue
            assert ack.operation is op
            if ack.completed_tokens is not None:
                assert op.completed_tokens <= ack.completed_tokens
                if not terminated:  # the scheduler stops reading acks once it terminated
                    op.completed_tokens = ack.completed_tokens
            if ack.completed_req:
                break
        done = op.completed_tokens
        loaded = self.pages(host_indices[:done])
        self.cc.mem_pool_host.free(host_indices)
        return done, loaded
