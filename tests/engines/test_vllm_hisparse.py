"""HiSparse (vLLM 0.33's host-backed sparse-MLA KV) and prefixkv: the refusal names why,
and the facts it rests on still hold in vLLM's wheel (docs/integration.md, "HiSparse").
Needs vllm installed."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from . import skip_module_without_vllm
from .hisparse_model import BS

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

REASON = r"HiSparseCoordinator .* docs/integration\.md, \"HiSparse\""


def hisparse_config(num_blocks: int = 32, host_blocks: int | None = 16, *, hot_blocks: int = 2,
                    resident_groups: int = 1) -> Any:
    """A HiSparse layout as vLLM builds one: the source group (full attention, on the host
    pool), the indexer (full attention, on the device pool), then a resident and a hot
    group per ``resident_groups``."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiSparseHotSpec,
        HiSparseResidentSpec,
        KVCacheConfig,
        KVCacheGroupRole,
        KVCacheGroupSpec,
    )

    attention = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["src"], attention, host_resident=True, role=KVCacheGroupRole.HISPARSE_SOURCE),
              KVCacheGroupSpec(["idx"], attention, role=KVCacheGroupRole.HISPARSE_INDEXER)]
    for g in range(resident_groups):
        groups += [KVCacheGroupSpec([f"res{g}"], HiSparseResidentSpec(block_size=BS, page_size=4 * BS)),
                   KVCacheGroupSpec([f"hot{g}"], HiSparseHotSpec(block_size=BS, page_size=4 * BS,
                                                                 blocks_per_request=hot_blocks))]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                         hisparse_host_num_blocks=host_blocks)


def vllm_manager(cfg: Any, **kw: Any) -> Any:
    """vLLM's own manager on ``cfg``."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    kw = {"max_model_len": 128, "scheduler_block_size": BS, "hash_block_size": BS,
          "enable_caching": False, **kw}
    return KVCacheManager(cfg, **kw)


def test_a_hisparse_layout_outside_the_binding_is_refused_naming_why() -> None:
    """Refused at construction, with the reason and where the docs explain it: HiSparse
    specs without a host pool (read_layout). (A host pool with prefix caching on is
    served since session 29: test_vllm_hisparse_cache.py.)"""
    from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV

    with pytest.raises(UnsupportedByPrefixKV, match=REASON):
        KVCacheManager(hisparse_config(host_blocks=None), max_model_len=128,
                       scheduler_block_size=BS, hash_block_size=BS)


def test_the_layout_here_is_one_vllm_runs_as_hisparse() -> None:
    """The refused layout is a real HiSparse one: vLLM's manager builds it with its
    HiSparse managers (the host group on a pool of its own), and its coordinator binds."""
    from vllm.v1.core.single_type_kv_cache_manager import (
        HiSparseHotManager,
        HiSparseResidentManager,
        HiSparseSourceManager,
    )
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    theirs = vllm_manager(hisparse_config(num_blocks=32, host_blocks=16))
    kinds = [type(m) for m in theirs.coordinator.single_type_managers]
    assert kinds[0] is HiSparseSourceManager and kinds[2:] == [HiSparseResidentManager, HiSparseHotManager]
    coordinator = get_hisparse_coordinator(theirs)
    assert coordinator.host_manager.block_pool.num_gpu_blocks == 16
    assert coordinator.gpu_pool is theirs.block_pool


def test_vllms_hisparse_binds_only_to_its_own_managers() -> None:
    """What the refusal rests on (docs/integration.md, "HiSparse"): vLLM's connector and
    tests reach HiSparse through ``get_hisparse_coordinator(manager)``, which takes a
    ``coordinator`` one of ``manager.coordinator.single_type_managers`` holds only if it
    is a ``HiSparseCoordinator``, and builds one only over vLLM's own HiSparse managers.
    If vLLM 0.3x opens this (a protocol), this fails: the refusal is then to be
    revisited."""
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator, get_hisparse_coordinator

    cfg = hisparse_config()
    views = tuple(SimpleNamespace(block_size=BS) for _ in cfg.kv_cache_groups)
    with pytest.raises(TypeError, match="resident cache managers"):
        HiSparseCoordinator(cfg, views, 128, num_reprefillable_tokens=0)
    held = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=(
        SimpleNamespace(coordinator=object()),)))
    with pytest.raises(AssertionError):
        get_hisparse_coordinator(held)  # type: ignore[arg-type]


# The seam a prefixkv HiSparse would fill, and the calls it would have to answer (session 26's
# re-check, docs/integration.md, "HiSparse": "The seam, re-checked").

# What vLLM 0.33's HiSparse connector (its scheduler side) reads of the coordinator: the whole
# call surface a coordinator of prefixkv's serves in an engine (the tests read more).
CONNECTOR_CALLS = {"advance_scheduled", "all_context_pages_resident", "build_offload_command",
                   "build_row_mirrors", "finish_host_import", "get_host_block_pool",
                   "has_pending_reclamation", "has_pending_work", "host_group_id", "pending_spills",
                   "release_completed_host_copies", "take_host_block_copies",
                   "take_residency_updates", "update_spills"}


def test_the_seam_is_a_coordinator_on_one_of_prefixkvs_group_views() -> None:
    """``get_hisparse_coordinator`` returns the ``coordinator`` that an entry of
    ``manager.coordinator.single_type_managers`` holds once it is a ``HiSparseCoordinator``:
    a subclass of prefixkv's, set on one of the plug-in's own ``GroupView`` objects, passes
    its assert without vLLM's ``__init__`` ever running (nothing of vLLM's state is built).
    So the binding is not what blocks: what the subclass must answer from prefixkv's state is
    (the connector's calls below, and the internals vLLM's tests read)."""
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator, get_hisparse_coordinator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from prefixkv.integrations.vllm import KVCacheManager

    class Seam(HiSparseCoordinator):
        def __init__(self) -> None:  # (vLLM's not called: none of its state exists)
            self.built_by = "prefixkv"

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], spec)])
    ours = KVCacheManager(cfg, max_model_len=128, scheduler_block_size=BS, hash_block_size=BS)
    seam = Seam()
    assert not hasattr(seam, "request_states")
    ours.coordinator.single_type_managers[0].coordinator = seam
    assert get_hisparse_coordinator(ours) is seam


def test_the_connector_reads_these_calls_of_the_coordinator() -> None:
    """The names vLLM's HiSparse connector reads of ``coordinator.`` in its source: a
    coordinator of prefixkv's would answer these in an engine. Fails when a vLLM bump adds or
    drops one (then the list here and the doc's are to be revisited)."""
    import inspect
    import re

    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import connector

    read = set(re.findall(r"coordinator\.(\w+)", inspect.getsource(connector)))
    assert read == CONNECTOR_CALLS
