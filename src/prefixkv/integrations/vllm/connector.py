"""``PrefixKVConnector``: prefixkv's shared, content-checked KV store under vLLM 0.33's
own cache, as a KV connector (``KVConnectorBase_V1``) that vLLM loads by module path::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PrefixKVConnector",
        "kv_connector_module_path": "prefixkv.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"redis_url": "redis://127.0.0.1:6379/0"}}'

vLLM keeps its own scheduler and block manager; the connector adds the blocks that any
replica (or a restart) saved: the scheduler side (``ConnectorScheduler``) looks them up
and plans loads and saves, the worker side (``ConnectorWorker``) fetches, checks and
writes them. Every value is checked against the block's content (prefixkv's record:
layout, parent, tokens, extra keys, length, checksum); a wrong, stale or foreign value
is a miss that vLLM recomputes, which is why ``kv_load_failure_policy`` must be
``"recompute"``. Keys of ``kv_connector_extra_config``: ``connector_config``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ...errors import ConfigError
from ...hashing import chain_hashes, make_hash_fn
from ...store.redis_store import RedisStore
from ...store.shared import SharedStore
from ...store.writer import StoreWriter
from .connector_config import ConnectorConfig, store_layout
from .connector_lookup import Lookups
from .connector_meta import PrefixKVConnectorMetadata
from .connector_scheduler import ConnectorScheduler
from .connector_worker import ConnectorWorker, WorkerStats

if TYPE_CHECKING:
    import torch

__all__ = ["PrefixKVConnector"]


def _tp_rank(vllm_config: Any) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    return int(get_tensor_model_parallel_rank())


class PrefixKVConnector(KVConnectorBase_V1, SupportsHMA):
    """The connector vLLM makes twice: in the scheduler (``role`` SCHEDULER) and in
    each worker. Raises ConfigError for a missing or bad ``kv_connector_extra_config``,
    ``kv_load_failure_policy`` other than ``"recompute"``, or a model it does not serve
    (``store_layout``), before connecting to the store."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ConfigError("PrefixKVConnector needs kv_load_failure_policy='recompute': a "
                              "block that fails prefixkv's content check is recomputed, never "
                              "fails the request")
        cfg = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        scheduler = role == KVConnectorRole.SCHEDULER
        layout = store_layout(vllm_config, kv_cache_config, cfg.model,
                              0 if scheduler else _tp_rank(vllm_config))
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        fn, root = make_hash_fn("sha256", cfg.hash_seed)
        self.config, self.layout, self.layout_block_size = cfg, layout, block_size
        self.scheduler: ConnectorScheduler | None = None
        self.worker: ConnectorWorker | None = None
        backend: RedisStore
        if scheduler:
            backend = RedisStore(cfg.redis_url, timeout=cfg.lookup_timeout, ttl=cfg.ttl)
            store = SharedStore(backend, layout, retry_after=cfg.retry_after)
            link = store.bind("sha256", cfg.hash_seed, root, block_size, None, None)
            lookups = Lookups(backend, cfg.lookup_timeout) if cfg.lookup_thread else None
            self.scheduler = ConnectorScheduler(link, backend, block_size, fn, root,
                                                retry_after=cfg.retry_after, lookups=lookups)
        else:
            backend = RedisStore(cfg.redis_url, timeout=cfg.timeout, ttl=cfg.ttl)
            store = SharedStore(backend, layout, timeout=cfg.timeout, retry_after=cfg.retry_after,
                                connections=cfg.fetch_threads)
            stats = WorkerStats()
            link = store.bind("sha256", cfg.hash_seed, root, block_size, stats,
                              functools.partial(chain_hashes, fn))
            writer = StoreWriter(backend, max_pending=cfg.max_pending)
            self.worker = ConnectorWorker(link, stats, writer, layout.block_bytes)
        self._backend = backend

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a dropped save is a later miss, never lost output."""
        return False

    # ---- scheduler side ----

    def _sched(self) -> ConnectorScheduler:
        assert self.scheduler is not None, "a scheduler-side call on a worker connector"
        return self.scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._sched().after_alloc(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        manager = self._kv_cache_manager
        assert manager is not None, "bind_kv_cache_manager was not called"
        return self._sched().build_meta(scheduler_output, lambda r: manager.get_block_ids(r)[0])

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().on_output(set(connector_output.finished_recving or ()),
                                set(connector_output.invalid_block_ids or ()))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().finished(request, block_ids), None

    def reset_cache(self) -> bool:
        """The store's blocks saved so far are no longer found (``ConnectorScheduler
        .reset``): True."""
        return self._sched().reset()

    def has_pending_block_frees(self) -> bool:
        """False, always. A finished request's blocks that a final save still reads
        stay allocated until the workers report the save sent (``request_finished``
        returned True; vLLM frees them on ``finished_sending``), so this answer never
        decides when blocks are freed: vLLM 0.33's scheduler reads it only when an
        allocation fails, and True would make it wait instead of preempting. The held
        blocks come back one step later, and may be too few to help: waiting on them
        could stall the batch for nothing, a preemption only costs a recompute."""
        return False

    def take_events(self) -> list[Any]:
        """vLLM ``BlockStored`` events (medium ``STORAGE``, vLLM's block hashes, so that
        routers that follow vLLM's events see them) for the blocks handed to the workers
        to save since the last call. A save that is later dropped (queue full, store
        down or full) is a later miss, not a retraction."""
        from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        sched = self._sched()
        saved, sched.saved = sched.saved, []
        bs = self.layout_block_size
        events = []
        for request, start, end in saved:
            hashes = request.block_hashes[start:end]  # vLLM's own, per full block
            if len(hashes) != end - start:
                continue  # (vLLM hashes in other block sizes: nothing to name them by)
            lora = request.lora_request
            parent = maybe_convert_block_hash(request.block_hashes[start - 1]) if start else None
            events.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in hashes],
                parent_block_hash=parent, token_ids=list(request.all_token_ids[start * bs:end * bs]),
                block_size=bs, lora_id=lora.adapter_id if lora else None, medium=MEDIUM_STORAGE,
                lora_name=lora.name if lora else None, group_idx=0))
        return events

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0])

    # ---- worker side ----

    def _work(self) -> ConnectorWorker:
        assert self.worker is not None, "a worker-side call on the scheduler's connector"
        return self.worker

    def _meta(self) -> PrefixKVConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrefixKVConnectorMetadata), type(meta)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads go into blocks of requests that wait for them
        (vLLM's WAITING_FOR_REMOTE_KVS), never into this forward pass's."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing per layer: whole blocks are read after the forward pass."""

    def wait_for_save(self) -> None:
        self._work().save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_invalid()

    def shutdown(self) -> None:
        """End this side's threads (the worker's once its fetches in flight ended and
        its queued writes were sent) and close its connections to the store."""
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()
        self._backend.close()
