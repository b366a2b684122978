"""``ConnectorWorker``: the worker side of ``PrefixKVConnector`` (no vLLM import).

    start_load_kv   each load (``BlockRun``) becomes a store ``Fetch`` on the store's
                    fetcher threads: values read straight into a host staging buffer
                    (one row a block), prefixkv's content check of each in place, the
                    verified run from the first block, stopping at the first miss
    get_finished    on the model runner's thread, the fetched payloads of finished
                    fetches are written into their device blocks; blocks past the
                    verified run are reported invalid (vLLM recomputes them); the
                    request is reported received. A finished request's final save is
                    reported sent.
    wait_for_save   after the forward pass: the blocks to save are gathered on the
                    device (one ``index_select`` per layer, stream-ordered: the blocks
                    may be reused at once) and copied to pinned host rows without
                    waiting; a saver thread waits for the copy and hands the values
                    to a ``StoreWriter`` thread

Only the model runner's thread touches the KV caches; fetch threads only talk to the
store. Saves are best effort: a full queue or a failing store drops them (a later miss).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ...errors import ConfigError
from ...extra_keys import ExtraKeys
from ...store.fetch import FAILED, Fetch
from ...store.link import StoreLink
from ...store.writer import StoreWriter
from .connector_meta import BlockRun, PrefixKVConnectorMetadata
from .copier import BlockCopier


class WorkerStats:
    """Counts since the worker started: blocks loaded (verified and written), blocks
    that failed to load (missing, failing the check, or the store failing), blocks
    saved (handed to the writer), fetches ended by a failed call or key
    (``store_errors``) or by a value that failed the content check (``store_rejected``)."""

    def __init__(self) -> None:
        self.loaded = self.failed = self.saved = self.store_errors = self.store_rejected = 0


class ConnectorWorker:
    """``link``: this rank's store link (its layout names this rank's shard; its store's
    ``timeout`` bounds a fetch), bound with ``stats`` and the chain hash; ``writer``: the
    writer thread of its saves."""

    def __init__(self, link: StoreLink, stats: WorkerStats, writer: StoreWriter,
                 block_bytes: int) -> None:
        self._link, self._writer, self._block_bytes = link, writer, block_bytes
        self._fetches: dict[int, tuple[Fetch, BlockRun, torch.Tensor]] = {}
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="prefixkv-save")
        self._invalid: set[int] = set()
        self._sent: set[str] = set()  # finished requests whose final save was handed off
        self._told: set[str] = set()  # the finished ids ``finished`` was given last time
        self.copier: BlockCopier | None = None
        self.stats = stats
        self._closed = False

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
        """``start_load_kv``: start a fetch of each load of ``meta`` (returns at once)."""
        copier = self._copier()
        pin = copier.layers[0].is_cuda
        for run in meta.loads:
            rows = torch.empty((len(run.block_ids), self._block_bytes), dtype=torch.uint8,
                               pin_memory=pin)
            views = [[memoryview(row.numpy())] for row in rows]
            f = Fetch(run.req_id, None, 0, run.parent, run.chunks, run.extras,
                      list(run.block_ids), views, time.monotonic() + self._link.store.timeout, True)
            self._fetches[id(f)] = (f, run, rows)
            try:
                self._link.submit(f, _salted(run.salt), run.tag)
            except Exception as exc:  # the fetch threads refused (shut down): the load
                f.failed, f.stop = exc, FAILED  # fails as a whole, reported as any other
                self._link.done.append(f)  # (its blocks invalid: vLLM recomputes them)

    def save(self, meta: PrefixKVConnectorMetadata) -> None:
        """``wait_for_save``: gather the blocks of ``meta``'s saves and final saves and
        queue their writes (returns without waiting for the device)."""
        runs = [*meta.saves, *meta.finals]
        if runs:
            rows, ready = self._copier().read_rows([b for run in runs for b in run.block_ids])
            ops = [self._link.put(b, h, parent, chunk, extra, _salted(run.salt), run.tag)
                   for run in runs
                   for b, h, parent, chunk, extra in zip(run.block_ids, run.hashes, run.parents(),
                                                         run.chunks, run.extras, strict=True)]
            self._saver.submit(self._send, ops, rows, ready)
            self.stats.saved += len(ops)
        self._sent.update(run.req_id for run in meta.finals)

    def _send(self, ops: list[Any], rows: torch.Tensor, ready: Any) -> None:
        """Wait for the rows to reach host memory, then queue each value (saver thread)."""
        if ready is not None:
            ready.synchronize()
        for op, row in zip(ops, rows.numpy(), strict=True):
            self._writer.put(op, memoryview(row))

    def finished(self, finished_req_ids: Iterable[str], wait: bool = False) -> tuple[set[str], set[str]]:
        """``get_finished``: (requests whose final save was handed off, among
        ``finished_req_ids`` or those of the previous call; requests whose load is done,
        written and checked). The previous call's count too: with a speculative config,
        vLLM's model runner calls ``wait_for_save`` after ``get_finished`` (after the
        drafter), so a final save is handed off after the call whose ids name its
        request, and no later call names it again. ``wait``: wait for every fetch in
        flight (shutdown, tests)."""
        copier = self._copier()
        recving: set[str] = set()
        done = self._link.done
        while wait and len(done) < len(self._fetches):
            time.sleep(0.001)
        while done:
            f = done.popleft()
            _, run, rows = self._fetches.pop(id(f))
            self._link.ended(f, time.monotonic())
            n = f.run
            copier.write_rows(run.block_ids[:n], rows[:n])
            self._invalid.update(run.block_ids[n:])
            self.stats.loaded += n
            self.stats.failed += len(run.block_ids) - n
            recving.add(run.req_id)
        told = set(finished_req_ids)
        sending = self._sent & (told | self._told)
        self._sent -= sending
        self._told = told - sending
        return sending, recving

    def take_invalid(self) -> set[int]:
        """``get_block_ids_with_load_errors``: the blocks that failed to load since the
        last call."""
        out, self._invalid = self._invalid, set()
        return out

    def flush(self) -> None:
        """Wait until every save was sent (or counted as failed)."""
        self._saver.submit(int).result()  # (the saver runs its jobs in order)
        self._writer.flush()

    def close(self) -> None:
        """Wait for the fetches in flight (each within its deadline) and the queued
        writes, then end the worker's threads (saver, writer, fetch threads). A second
        call does nothing. (The connector closes the store's connections.)"""
        if self._closed:
            return
        self._closed = True
        if self.copier is not None:  # (else no fetch ever started)
            self.finished((), wait=True)
        self.flush()
        self._saver.shutdown()
        self._writer.close()
        self._link.store.close()


def _salted(salt: str | None) -> ExtraKeys | None:
    """The extra keys that name a request's key namespace (its salt)."""
    return ExtraKeys(cache_salt=salt) if salt is not None else None
