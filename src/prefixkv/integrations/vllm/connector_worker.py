"""``ConnectorWorker``: the worker side of ``PrefixKVConnector`` (no vLLM import).

    start_load_kv   each load (``BlockRun``) goes to a fetch thread: one round trip,
                    then prefixkv's content check of every value (``StoreLink.fetch``:
                    the verified run from the first block, stopping at the first miss)
    get_finished    on the model runner's thread, the fetched payloads of finished
                    fetches are written into their device blocks; blocks past the
                    verified run are reported invalid (vLLM recomputes them); the
                    request is reported received. A finished request's final save is
                    reported sent.
    wait_for_save   after the forward pass: the blocks to save are read to host bytes
                    (one gather per layer) and handed to a ``StoreWriter`` thread

Only the model runner's thread touches the KV caches; fetch threads only talk to the
store. Saves are best effort: a full queue or a failing store drops them (a later miss).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...errors import ConfigError
from ...extra_keys import ExtraKeys
from ...store.shared import StoreLink
from ...store.writer import StoreWriter
from .connector_meta import BlockRun, PrefixKVConnectorMetadata
from .layout import BlockCopier


class WorkerStats:
    """Counts since the worker started: blocks loaded (verified and written), blocks
    that failed to load (missing, failing the check, or the store failing), blocks
    saved (handed to the writer), failed store calls (``store_errors``)."""

    def __init__(self) -> None:
        self.loaded = self.failed = self.saved = self.store_errors = 0


class ConnectorWorker:
    """``link``: this rank's store link (its layout names this rank's shard), bound with
    ``stats`` (where it counts failed calls); ``writer``: the writer thread of its
    saves; ``threads``: fetch threads."""

    def __init__(self, link: StoreLink, stats: WorkerStats, writer: StoreWriter,
                 block_bytes: int, *, threads: int = 2) -> None:
        self._link, self._writer, self._block_bytes = link, writer, block_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="prefixkv-fetch")
        self._fetches: list[tuple[BlockRun, Future[list[bytes]]]] = []
        self._invalid: set[int] = set()
        self._sent: set[str] = set()  # finished requests whose final save was handed off
        self.copier: BlockCopier | None = None
        self.stats = stats

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """``register_kv_caches``. Raises ConfigError when a block of the caches is not
        the layout's ``block_bytes`` (another model, dtype or parallel shape)."""
        copier = BlockCopier(kv_caches)
        if copier.block_bytes != self._block_bytes:
            raise ConfigError(f"the registered KV caches hold {copier.block_bytes} bytes per "
                              f"block, the store layout {self._block_bytes}")
        self.copier = copier

    def _copier(self) -> BlockCopier:
        if self.copier is None:
            raise ConfigError("register_kv_caches was not called")
        return self.copier

    def start_loads(self, meta: PrefixKVConnectorMetadata) -> None:
        """``start_load_kv``: start a fetch of each load of ``meta``."""
        for run in meta.loads:
            self._fetches.append((run, self._pool.submit(self._fetch, run)))

    def _fetch(self, run: BlockRun) -> list[bytes]:
        """The verified payloads of ``run``'s blocks, from its first (fetch thread)."""
        return self._link.fetch(run.parent, run.hashes, run.chunks, run.extras, _salted(run.salt))

    def save(self, meta: PrefixKVConnectorMetadata) -> None:
        """``wait_for_save``: read the blocks of ``meta``'s saves and final saves and
        queue their writes."""
        copier = self._copier()
        for run in (*meta.saves, *meta.finals):
            payloads = copier.read(run.block_ids)
            for i, (parent, payload) in enumerate(zip(run.parents(), payloads, strict=True)):
                op = self._link.put(run.block_ids[i], run.hashes[i], parent, run.chunks[i],
                                    run.extras[i], _salted(run.salt))
                self._writer.put(op, payload)
            self.stats.saved += len(payloads)
        self._sent.update(run.req_id for run in meta.finals)

    def finished(self, finished_req_ids: Iterable[str], wait: bool = False) -> tuple[set[str], set[str]]:
        """``get_finished``: (requests whose final save was handed off, among
        ``finished_req_ids``; requests whose load is done, written and checked).
        ``wait``: wait for every fetch in flight (shutdown, tests)."""
        copier = self._copier()
        recving: set[str] = set()
        pending = []
        for run, fut in self._fetches:
            if not (wait or fut.done()):
                pending.append((run, fut))
                continue
            payloads = fut.result()
            n = len(payloads)
            copier.write(run.block_ids[:n], payloads)
            self._invalid.update(run.block_ids[n:])
            self.stats.loaded += n
            self.stats.failed += len(run.block_ids) - n
            recving.add(run.req_id)
        self._fetches = pending
        sending = self._sent.intersection(finished_req_ids)
        self._sent -= sending
        return sending, recving

    def take_invalid(self) -> set[int]:
        """``get_block_ids_with_load_errors``: the blocks that failed to load since the
        last call."""
        out, self._invalid = self._invalid, set()
        return out

    def flush(self) -> None:
        """Wait until every queued write was sent (or counted as failed)."""
        self._writer.flush()

    def close(self) -> None:
        """Wait for the fetches in flight and the queued writes."""
        self._pool.shutdown(wait=True)
        self._writer.flush()


def _salted(salt: str | None) -> ExtraKeys | None:
    """The extra keys that name a request's key namespace (its salt)."""
    return ExtraKeys(cache_salt=salt) if salt is not None else None
