"""A reference of vLLM 0.33's HiSparse page life-cycle, checked against vLLM's own
``KVCacheManager`` and ``HiSparseCoordinator`` (from the wheel), step by step on random
streams. prefixkv refuses HiSparse (docs/integration.md, "HiSparse"); this reference is
the specification a prefixkv HiSparse must meet. It tests no prefixkv code.

Scope: one request at a time (freed, then a new one), prefix caching off, no hits and no
external loads (so no host publication, copies or restores), one resident and one hot
group; a prompt computed in chunks, the workers confirming the page copies planned (any
subset, any time), and other users of the GPU pool taking and giving back blocks. The
rules (``Model``):

- a step to ``T`` tokens takes, in group order, the host blocks (from the host pool: when
  it lacks them the step fails, whatever the GPU pool holds), the indexer's and the
  resident row's blocks up to ``cdiv(T, bs)``, and the hot group's ``blocks_per_request``
  once the request was asked to move to host reads; all or nothing, against the GPU
  pool's free count (unpinned pages count as free);
- blocks come from the head of the free queue; a block given back uncached goes to its
  head (LIFO), an unpinned page to its tail; handing out an unpinned page loses it: the
  row reads it from host from then on (null), and the request must hold a hot region;
- after a step, every sealed page with a GPU copy and no host copy yet gets a copy
  planned (in page order, at most ``max_model_len // bs`` waiting to be sent); then, if
  the request holds its hot region, its clean pages are unpinned, tail first, but the
  row's last two; if not, it is asked to take one when the pool's free count is below
  ``max(blocks_per_request, num_blocks // 10)`` or its row holds the admission window
  (``cdiv(min(max_in_flight_tokens, max_model_len), bs)`` pages);
- a confirmed copy makes its page clean (unpinned at once when the request holds its hot
  region and the page is not among the row's last two);
- freeing: ``Model.free``; a page in flight keeps its blocks until its copy is confirmed.
Needs vllm installed."""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hisparse import BS, hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_plugin import request as make_request  # noqa: E402

MAX_LEN = 128
TAIL = 2  # the row's last pages never unpinned (vLLM's ACTIVE_TAIL_PAGES)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Model:
    """What vLLM's manager and coordinator hold for the one request, by the rules above."""

    num_blocks: int
    host_blocks: int
    hot_blocks: int
    window: int  # the admission window, in pages
    gpu: deque[int] = field(default_factory=deque)
    host: deque[int] = field(default_factory=deque)
    computed: int = 0
    host_row: list[int] = field(default_factory=list)
    indexer: list[int] = field(default_factory=list)
    row: list[int] = field(default_factory=list)  # 0: the page is read from host
    hot: list[int] = field(default_factory=list)
    hot_required: bool = False
    valid: set[int] = field(default_factory=set)
    pending: dict[int, int] = field(default_factory=dict)  # transfer id -> page
    # the transfers of freed requests: transfer id -> (GPU block, host block)
    orphans: dict[int, tuple[int, int]] = field(default_factory=dict)
    pinned_clean: set[int] = field(default_factory=set)
    unpinned: dict[int, int] = field(default_factory=dict)  # block -> page
    to_send: list[int] = field(default_factory=list)  # transfers planned, not yet sent
    next_transfer: int = 0
    ready: int = 0
    taken: list[int] = field(default_factory=list)  # blocks other users hold
    seen: dict[str, int] = field(default_factory=dict)  # events, that a scenario is not vacuous

    def __post_init__(self) -> None:
        self.gpu = deque(range(1, self.num_blocks))
        self.host = deque(range(1, self.host_blocks))

    def note(self, event: str) -> None:
        self.seen[event] = self.seen.get(event, 0) + 1

    def can_read_from_host(self) -> bool:
        return len(self.hot) == self.hot_blocks

    def pop(self, n: int) -> list[int]:
        out = [self.gpu.popleft() for _ in range(n)]
        for block in out:
            page = self.unpinned.pop(block, None)
            if page is not None:  # lost: read from host from now on
                self.note("lost")
                self.row[page] = 0
                self.hot_required = True
        return out

    def step(self, total: int) -> bool:
        pages = cdiv(total, BS)
        if pages - len(self.host_row) > len(self.host):
            self.note("host full")
            return False
        need = (pages - len(self.indexer)) + (pages - len(self.row))
        need += self.hot_blocks - len(self.hot) if self.hot_required else 0
        if need > len(self.gpu):
            self.note("gpu full")
            return False
        self.host_row += [self.host.popleft() for _ in range(pages - len(self.host_row))]
        self.indexer += self.pop(pages - len(self.indexer))
        self.row += self.pop(pages - len(self.row))
        if self.hot_required:
            self.hot += self.pop(self.hot_blocks - len(self.hot))
        self.plan(total // BS)
        self.update_residency()
        self.computed = total
        return True

    def plan(self, sealed: int) -> None:
        budget = max(MAX_LEN // BS - len(self.to_send), 0)
        busy = set(self.pending.values())
        for page in range(self.ready, sealed):
            if budget == 0:
                break
            if page in busy or page in self.valid or not self.row[page]:
                continue
            self.pending[self.next_transfer] = page
            self.to_send.append(self.next_transfer)
            self.next_transfer += 1
            budget -= 1

    def update_residency(self) -> None:
        if not self.can_read_from_host():
            if len(self.gpu) < max(self.hot_blocks, self.num_blocks // 10) or len(self.row) >= self.window:
                self.hot_required = True
                self.note("asked for hot")
            return
        for page in sorted(self.pinned_clean, reverse=True):
            self.unpin(page)

    def unpin(self, page: int) -> None:
        if page in self.pending.values() or page not in self.valid:
            return
        if page >= len(self.row) - TAIL or not self.row[page]:
            return
        self.unpinned[self.row[page]] = page
        self.gpu.append(self.row[page])
        self.pinned_clean.discard(page)
        self.note("unpinned")

    def block_of(self, tid: int) -> int:
        """The GPU block of transfer ``tid``."""
        return self.orphans[tid][0] if tid in self.orphans else self.row[self.pending[tid]]

    def confirm(self, transfers: list[int]) -> None:
        # (the coordinator's dict order: planned order) first the GPU blocks' references
        # go, then the host blocks'; a freed request's are the last: to the head
        for tid in sorted(t for t in transfers if t in self.orphans):
            self.gpu.appendleft(self.orphans[tid][0])
        for tid in sorted(transfers):
            if tid in self.orphans:
                self.host.appendleft(self.orphans.pop(tid)[1])
                continue
            page = self.pending.pop(tid)
            self.valid.add(page)
            self.pinned_clean.add(page)
            if self.can_read_from_host():
                self.unpin(page)
        while self.ready in self.valid:
            self.ready += 1

    def free(self) -> None:
        """The request goes (then a new one comes, with a new id). The coordinator first
        lets go of its clean pages, tail first: unpinned ones stay where they are, the
        others not in flight are unpinned (to the tail, no longer the request's); then
        each group gives back what it holds, in group order, tail first, to the head:
        the host blocks, the indexer's, the row's pages neither unpinned nor in flight,
        the hot region. A page in flight keeps its blocks until its copy is confirmed."""
        busy = {page: tid for tid, page in self.pending.items()}
        for page in reversed(range(len(self.row))):
            block = self.row[page]
            if not block or page in busy:
                continue
            if block in self.unpinned:
                del self.unpinned[block]
            elif page in self.valid:
                self.gpu.append(block)
            else:
                continue
            self.row[page] = 0
        for tid, page in self.pending.items():
            self.orphans[tid] = (self.row[page], self.host_row[page])
            self.note("freed in flight")
        self.host.extendleft([b for p, b in enumerate(self.host_row) if p not in busy])
        self.gpu.extendleft(self.indexer)
        self.gpu.extendleft([b for p, b in enumerate(self.row) if b and p not in busy])
        self.gpu.extendleft(self.hot)
        self.computed = self.ready = 0
        self.host_row, self.indexer, self.row, self.hot = [], [], [], []
        self.hot_required = False
        self.valid, self.pending, self.pinned_clean = set(), {}, set()

    def take(self, n: int) -> list[int]:
        out = self.pop(n)
        self.taken += out
        return out

    def give_back(self) -> None:
        for block in reversed(self.taken):
            self.gpu.appendleft(block)
        self.taken = []


def vllm_state(manager: Any, coordinator: Any, rid: str) -> dict[str, Any]:
    """What the model predicts, read from vLLM's manager and coordinator."""
    host, indexer, resident, hot = coordinator.managers
    state = coordinator.request_states.get(rid)
    return {"host_row": [b.block_id for b in host.req_to_blocks.get(rid, [])],
            "indexer": [b.block_id for b in indexer.req_to_blocks.get(rid, [])],
            "row": [b.block_id for b in resident.get_residency_row(rid)],
            "hot": [b.block_id for b in hot.req_to_blocks.get(rid, [])],
            "hot_required": rid in hot.hot_required,
            "valid": set(state.valid_pages) if state else set(),
            "pending": sorted(state.pending_pages) if state else [],
            "pinned_clean": set(state.pinned_clean) if state else set(),
            "unpinned": set(state.unpinned_pages) if state else set(),
            "gpu_free": manager.block_pool.get_num_free_blocks(),
            "host_free": coordinator.host_manager.block_pool.get_num_free_blocks(),
            "in_flight": len(coordinator.pending_spills), "work": coordinator.has_pending_work()}


def model_state(m: Model) -> dict[str, Any]:
    return {"host_row": m.host_row, "indexer": m.indexer, "row": m.row, "hot": m.hot,
            "hot_required": m.hot_required, "valid": m.valid, "pending": sorted(m.pending.values()),
            "pinned_clean": m.pinned_clean, "unpinned": set(m.unpinned.values()),
            "gpu_free": len(m.gpu), "host_free": len(m.host),
            "in_flight": len(m.pending) + len(m.orphans), "work": bool(m.to_send or m.pending or m.orphans)}


def run(num_blocks: int, host_blocks: int, hot_blocks: int, in_flight: int, prompt: int,
        ops: list[tuple[str, int]]) -> Model:
    """``ops`` on vLLM's manager and on the model side by side, their states compared
    after each; the model at the end."""
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    manager = vllm_manager(hisparse_config(num_blocks, host_blocks, hot_blocks=hot_blocks),
                           max_model_len=MAX_LEN, max_in_flight_tokens=in_flight)
    coordinator = get_hisparse_coordinator(manager)
    req = make_request("r", list(range(prompt)))
    m = Model(num_blocks, host_blocks, hot_blocks, cdiv(min(in_flight, MAX_LEN), BS))
    taken: list[Any] = []
    for i, (op, arg) in enumerate(ops):
        if op == "step":
            total = min(m.computed + arg, prompt)
            if total == m.computed:
                continue
            got = manager.allocate_slots(req, total - m.computed)
            if got is not None:
                coordinator.advance_scheduled([(req.request_id, total)])
                req.num_computed_tokens = total
            assert (got is not None) == m.step(total), (i, op, arg)
        elif op == "confirm":  # every transfer sent; those of ``arg``'s bits confirmed
            sent = coordinator.build_offload_command().page_transfers
            assert [(t.transfer_id, t.resident_block_ids) for t in sent] == [
                (t, (m.block_of(t),)) for t in m.to_send], (i, op, arg)
            m.to_send = []
            chosen = [t for k, t in enumerate(sorted([*m.pending, *m.orphans])) if arg >> (k % 16) & 1]
            coordinator.update_spills({t: 1 for t in chosen}, {t: 1 for t in chosen})
            m.confirm(chosen)
        elif op == "free":
            manager.free(req)
            m.free()
            req = make_request(f"r{i}", list(range(prompt)))
        elif op == "take":
            n = min(arg, manager.block_pool.get_num_free_blocks())
            got = manager.block_pool.get_new_blocks(n)
            assert [b.block_id for b in got] == m.take(n), (i, op, arg)
            taken += got
        else:
            manager.block_pool.free_blocks(taken)
            taken = []
            m.give_back()
        assert vllm_state(manager, coordinator, req.request_id) == model_state(m), (i, op, arg)
    return m


ALL = 2**16 - 1
# (pool, host pool, hot blocks, max_in_flight_tokens, prompt), ops, what must happen
SCENARIOS = {
    "others-take-unpinned-pages": ((16, 12, 1, 16, 96), [
        ("step", 16), ("step", 16), ("step", 32), ("confirm", ALL), ("take", 12), ("give_back", 0),
        ("step", 32), ("confirm", ALL)], {"asked for hot", "unpinned", "lost"}),
    "own-growth-takes-unpinned-pages": ((12, 12, 1, 16, 96), [
        ("step", 16), ("step", 16), ("step", 32), ("confirm", ALL), ("step", 32), ("confirm", ALL)],
        {"unpinned", "lost"}),
    # pages clean before the hot region are unpinned at once when it comes, tail first:
    # the pool hands out page 2's block first
    "unpins-tail-first": ((24, 12, 1, 64, 128), [
        ("step", 48), ("confirm", ALL), ("step", 16), ("step", 16), ("take", 13)], {"unpinned", "lost"}),
    # the pool's free count at the watermark (3 of 32) asks for nothing; below it, it asks
    "pool-at-watermark": ((32, 12, 1, MAX_LEN, 128), [
        ("step", 96), ("take", 14), ("step", 16), ("step", 16)], {"asked for hot"}),
    # freed with a page in flight (its blocks wait for the copy), one unpinned (stays in
    # the pool, no one's), clean ones (unpinned now) and dirty ones; then a new request
    "free-mid-flight": ((16, 12, 1, 16, 96), [
        ("step", 16), ("step", 16), ("step", 32), ("confirm", 0b0111), ("step", 16), ("confirm", 0b10),
        ("free", 0), ("step", 48), ("confirm", ALL), ("take", 12), ("step", 16), ("confirm", ALL)],
        {"unpinned", "freed in flight"}),
    "host-pool-full": ((32, 3, 1, MAX_LEN, 64), [("step", 48), ("step", 32), ("step", 16)], {"host full"}),
    "pool-below-watermark": ((12, 12, 2, MAX_LEN, 96), [
        ("step", 64), ("step", 16), ("confirm", 5), ("step", 16), ("take", 1), ("give_back", 0),
        ("step", 16), ("confirm", ALL)], {"asked for hot", "gpu full"}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenarios_follow_the_reference(name: str) -> None:
    shape, ops, expected = SCENARIOS[name]
    m = run(*shape, ops)
    assert expected <= set(m.seen), m.seen


STEP = st.tuples(st.just("step"), st.integers(1, 40))
CONFIRM = st.tuples(st.just("confirm"), st.integers(0, ALL))
OPS = st.lists(st.one_of(STEP, CONFIRM, STEP, CONFIRM, st.tuples(st.just("take"), st.integers(1, 12)),
                         st.tuples(st.just("give_back"), st.just(0)), st.tuples(st.just("free"), st.just(0))),
               min_size=4, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(10, 32), host_blocks=st.integers(4, 12), hot_blocks=st.integers(1, 3),
       in_flight=st.sampled_from([16, 32, 64, MAX_LEN]), prompt=st.integers(40, MAX_LEN), ops=OPS)
def test_random_streams_follow_the_reference(num_blocks: int, host_blocks: int, hot_blocks: int,
                                             in_flight: int, prompt: int, ops: list[tuple[str, int]]) -> None:
    run(num_blocks, host_blocks, hot_blocks, in_flight, prompt, ops)
