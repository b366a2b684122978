"""One tenant floods a shared pool. What SPEC and security.md promise (section 8: no
quotas; a tenant may evict others' *cached* blocks, never blocks in use):

- the blocks a live request of another tenant holds keep their ids and content;
- host slots pinned for another tenant's loads are not overwritten by the flood's
  offloads in the same step's plan (offloads run before loads);
- shortage is a ``None`` for whoever asks, with nothing changed, never an exception; a
  request that could never fit is a ``PromptTooLongError`` for its own sender only;
- reserved store-fetch slots do not make another tenant's admission fail.

A small engine (``_Engine``) runs each step's plan and writes each computed block's KV
as (keys, tokens up to the block's end), so a block served with another tenant's KV is
seen."""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv import (
    Admission,
    BlockCopy,
    BlockLoads,
    BlockOffloads,
    ExtraKeys,
    KVCacheManager,
    PromptTooLongError,
    StoreWait,
)

BS = 4
A, B = ExtraKeys(cache_salt="tenant-a"), ExtraKeys(cache_salt="tenant-b")


class _Engine:
    """Plays the engine: runs plans, writes KV, checks each live request's blocks."""

    def __init__(self, m: KVCacheManager, num_blocks: int, host_blocks: int) -> None:
        self.m = m
        self.kv: list[Any] = [None] * num_blocks
        self.host: list[Any] = [None] * host_blocks
        self.live: dict[str, tuple[list[int], ExtraKeys | None, int]] = {}

    def step(self) -> None:
        """The plan (offloads, loads, copies, in order), then the forward pass."""
        for op in self.m.take_kv_ops():
            if isinstance(op, BlockOffloads):
                for s, d in zip(op.src, op.dst, strict=True):
                    self.host[d] = self.kv[s]
            elif isinstance(op, BlockLoads):
                for s, d in zip(op.src, op.dst, strict=True):
                    self.kv[d] = self.host[s]
            elif isinstance(op, BlockCopy):
                self.kv[op.dst] = self.kv[op.src]
        for rid, (tokens, extra, start) in self.live.items():
            blocks = self.m.get_block_ids(rid)
            for j in range(start // BS, len(tokens) // BS):
                self.kv[blocks[j]] = (extra, tuple(tokens[:(j + 1) * BS]))
            self.live[rid] = (tokens, extra, len(tokens) // BS * BS)

    def admit(self, rid: str, tokens: list[int], extra: ExtraKeys | None) -> Admission | None:
        adm = self.m.add_request(rid, tokens, extra=extra)
        assert not isinstance(adm, StoreWait)
        if adm is not None:
            self.live[rid] = (tokens, extra, adm.num_cached_tokens)
        return adm

    def free(self, rid: str) -> None:
        self.m.free(rid)
        del self.live[rid]

    def check(self) -> None:
        """Every full block a live request has computed or hit holds its own KV."""
        for rid, (tokens, extra, done) in self.live.items():
            blocks = self.m.get_block_ids(rid)
            for j in range(done // BS):
                assert self.kv[blocks[j]] == (extra, tuple(tokens[:(j + 1) * BS])), (rid, j)
        self.m.check_invariants()


def _prompt(base: int, blocks: int = 3) -> list[int]:
    return [base + i for i in range(blocks * BS + 1)]


def test_a_flood_takes_no_block_another_tenant_holds_and_gets_none_not_an_error():
    m = KVCacheManager(12, BS, hash_mode="sha256")
    e = _Engine(m, 12, 0)
    held = e.admit("a", _prompt(1000), A)
    assert held is not None
    e.step()
    mine = m.get_block_ids("a")
    n = 0
    while e.admit(f"b{n}", _prompt(2000 + 100 * n), B) is not None:  # the flood
        e.step()
        n += 1
    assert n == 2  # 12 blocks: a holds 4, each flood request takes 4
    assert m.get_block_ids("a") == mine
    e.check()
    assert m.append_tokens("a", list(range(5000, 5008))) is None  # short: None, unchanged
    assert m.get_block_ids("a") == mine
    with pytest.raises(PromptTooLongError):  # can never fit: its sender's error alone
        m.add_request("huge", _prompt(9000, 12), extra=B)
    e.free("b0")
    assert m.append_tokens("a", list(range(5000, 5008))) is not None
    e.check()


def test_a_flood_may_evict_another_tenants_cached_blocks_tail_first():
    """security.md section 4: salts separate content, not capacity. The evicted tenant's
    hit falls block by block from the tail: the volume channel the page describes."""
    m = KVCacheManager(8, BS, hash_mode="sha256")
    e = _Engine(m, 8, 0)
    e.admit("a", _prompt(1000), A)
    e.step()
    e.free("a")
    assert m.lookup(_prompt(1000), extra=A) == 12
    hits = []
    for n in range(8):  # one-block requests of b's, held: the pool's 5 empty blocks first
        assert e.admit(f"b{n}", [3000 + 10 * n + i for i in range(BS)], B) is not None
        e.step()
        hits.append(m.lookup(_prompt(1000), extra=A))
    assert hits == [12] * 5 + [8, 4, 0], hits
    e.check()


def test_host_slots_pinned_for_one_tenants_loads_survive_another_tenants_offloads():
    """Tenant a's blocks went down to the host tier (tenant b's admission evicted them);
    a's re-admission loads them into device blocks it takes by evicting b's cached
    blocks, whose offloads need slots in the same step's plan: every slot is pinned for
    a's loads, and offloads run before loads, so b's KV must not land in them."""
    m = KVCacheManager(4, BS, hash_mode="sha256", host_blocks=3)
    e = _Engine(m, 4, 3)
    e.admit("a", _prompt(1000), A)
    e.step()
    e.free("a")
    e.admit("b", _prompt(2000), B)  # evicts a's three blocks into the three slots
    e.step()
    e.free("b")
    assert m.lookup(_prompt(1000), extra=A) == 12  # from the host tier
    assert e.admit("a2", _prompt(1000), A).num_cached_tokens == 12  # evicts b's blocks
    ops = m.take_kv_ops(pending=True)
    loads = [op for op in ops if isinstance(op, BlockLoads)]
    offloads = [op for op in ops if isinstance(op, BlockOffloads)]
    assert loads and len(loads[0].src) == 3
    assert not offloads or not set(offloads[0].dst) & set(loads[0].src), ops
    m.kv_ops_done()
    for op in ops:  # (the plan, run as ``_Engine.step`` runs it)
        if isinstance(op, BlockOffloads):
            for src, dst in zip(op.src, op.dst, strict=True):
                e.host[dst] = e.kv[src]
        elif isinstance(op, BlockLoads):
            for src, dst in zip(op.src, op.dst, strict=True):
                e.kv[dst] = e.host[src]
    e.step()
    e.check()
    assert e.admit("b2", _prompt(2000), B) is None  # a2 holds the whole pool: shortage


def test_a_flood_of_store_fetches_does_not_fail_another_tenants_admission():
    """Tenant b's admissions reserve every host slot for their store fetches (still
    running); tenant a's admission then finds no slot to fetch into: it is admitted
    and computes (or waits for a slot), never an error, and its device hit is served."""
    from prefixkv.store import FetchCost, SharedStore
    from test_tenant_store import LAYOUT, DictStore, _computed, _shared

    class _Held:
        """An executor that keeps each job until ``run`` (fetches stay in flight)."""

        def __init__(self) -> None:
            self.jobs: list[Any] = []

        def submit(self, fn: Any, *args: Any) -> None:
            self.jobs.append((fn, args))

        def run(self) -> None:
            while self.jobs:
                fn, args = self.jobs.pop(0)
                fn(*args)

    backend = DictStore()
    writer = KVCacheManager(16, BS, hash_mode="sha256", host_blocks=4, store=_shared(backend))
    for i in range(2):
        _computed(writer, backend, f"w{i}", _prompt(2000 + 100 * i), B)
    held = _Held()
    shared = SharedStore(backend, LAYOUT, cost=FetchCost(1.0), executor=held)
    m = KVCacheManager(16, BS, hash_mode="sha256", host_blocks=4, store=shared)
    assert isinstance(m.add_request("a", _prompt(1000), extra=A), StoreWait)  # (a miss)
    held.run()
    assert m.poll_store() == ["a"]
    assert isinstance(m.add_request("a", _prompt(1000), extra=A), Admission)
    m.take_kv_ops()
    m.free("a")
    waits = [m.add_request(f"b{i}", _prompt(2000 + 100 * i), extra=B) for i in range(2)]
    assert all(isinstance(w, StoreWait) for w in waits)  # 3 + 1 slots reserved: none free
    again = m.add_request("a2", _prompt(1000), extra=A)
    assert isinstance(again, Admission) and again.num_cached_tokens == 12
    other = m.add_request("a3", _prompt(1500), extra=A)
    assert other is None or isinstance(other, (Admission, StoreWait))
    held.run()
    assert sorted(m.poll_store()) == ["b0", "b1"]
    m.check_invariants()
