"""The model of tests/engines/test_vllm_hisparse_reference.py (and of test_hisparse_row.py):
what vLLM 0.33's ``KVCacheManager`` and ``HiSparseCoordinator`` hold for a HiSparse request, by the rules
below (read from vLLM's ``v1/hisparse/coordinator.py``, its HiSparse managers and
``BlockPool``; written here). Imports nothing of vLLM.

Scope: one request at a time (freed, then a new one), prefix caching off, no hits and no
external loads (so no host publication, copies or restores), one resident and one hot
group; a prompt computed in chunks, the workers confirming the page copies planned (any
subset, any time; one worker, or two whose reports come apart), and other users of the
GPU pool taking and giving back blocks. The rules (``Model``):

- a step to ``T`` tokens takes, in group order, the host blocks (from the host pool: when
  it lacks them the step fails, whatever the GPU pool holds), the indexer's and the
  resident row's blocks up to ``cdiv(T, bs)``, and the hot group's ``blocks_per_request``
  once the request was asked to move to host reads; all or nothing, against the GPU
  pool's free count (unpinned pages count as free); a step asked to fit the whole request
  (``full_sequence_must_fit``) first checks all of its host pages, and on the GPU pool its
  indexer pages, its row's capped at the admission window, and the hot region if asked
  for (``Model.fits``);
- blocks come from the head of the free queue; a block given back uncached goes to its
  head (LIFO), an unpinned page to its tail; handing out an unpinned page loses it: the
  row reads it from host from then on (null), and the request must hold a hot region;
- after a step, every sealed page (of the tokens but the last ``num_prefill_lookahead - 1``,
  which a multi-module MTP prefills again) with a GPU copy and no host copy yet gets a copy
  planned (in page order, at most ``max_model_len // bs`` waiting to be sent); then, if
  the request holds its hot region, its clean pages are unpinned, tail first, but the
  row's last two; if not, it is asked to take one when the pool's free count is below
  ``max(blocks_per_request, num_blocks // 10)`` or its row holds the admission window
  (``cdiv(min(max_in_flight_tokens, max_model_len), bs)`` pages);
- a copy is confirmed once as many workers completed it as the first enqueued report
  said (``Model.report``);
- a confirmed copy makes its page clean (unpinned at once when the request holds its hot
  region and the page is not among the row's last two);
- freeing: ``Model.free``; a page in flight keeps its blocks until its copy is confirmed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

BS = 16  # one block size for every group, as HiSparse requires
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
    reprefill: int = 0  # the last tokens not final (``num_prefill_lookahead - 1``): not copied
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
    # transfer id -> [workers that will complete it (0: not yet known), completions so far]
    counts: dict[int, list[int]] = field(default_factory=dict)
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

    def fits(self, full: int) -> bool:
        """The full-sequence gate (``full_sequence_must_fit``) for a request of ``full``
        tokens: the host pages all of it needs, then on the GPU pool the indexer's pages,
        the row's capped at the admission window and the hot region if asked for."""
        pages = cdiv(min(full, MAX_LEN), BS)
        if pages - len(self.host_row) > len(self.host):
            return False
        need = max(pages - len(self.indexer), 0) + max(min(pages, self.window) - len(self.row), 0)
        need += self.hot_blocks - len(self.hot) if self.hot_required else 0
        if need > len(self.gpu):
            self.note("full sequence does not fit")
            return False
        if pages > self.window:
            self.note("capped at the window")
        return True

    def step(self, total: int, full: int = 0) -> bool:
        """A step to ``total`` tokens; ``full``: the request's length when the whole of it
        must fit (0: it need not)."""
        pages = cdiv(total, BS)
        if full and not self.fits(full):
            return False
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
        self.plan(max(total - self.reprefill, 0) // BS)
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

    def report(self, enqueued: dict[int, int], completed: dict[int, int]) -> list[int]:
        """The workers' reports (vLLM's ``update_spills``), on transfers in flight only: a
        transfer's number of workers is the first enqueued count reported for it, and it
        is confirmed once that many completions have come. Returns those confirmed."""
        live = {*self.pending, *self.orphans}
        for tid, n in enqueued.items():
            if tid in live:
                c = self.counts.setdefault(tid, [0, 0])
                c[0] = c[0] or n
        for tid, n in completed.items():
            if tid in live:
                self.counts.setdefault(tid, [0, 0])[1] += n
        done = [t for t in sorted(live) if t in self.counts and 0 < self.counts[t][0] <= self.counts[t][1]]
        if any(t not in done for t in completed if t in live):
            self.note("waits for a worker")
        for tid in done:
            del self.counts[tid]
        self.confirm(done)
        return done

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


def model_state(m: Model) -> dict[str, Any]:
    return {"host_row": m.host_row, "indexer": m.indexer, "row": m.row, "hot": m.hot,
            "hot_required": m.hot_required, "valid": m.valid, "pending": sorted(m.pending.values()),
            "pinned_clean": m.pinned_clean, "unpinned": set(m.unpinned.values()),
            "gpu_free": len(m.gpu), "host_free": len(m.host),
            "in_flight": len(m.pending) + len(m.orphans), "work": bool(m.to_send or m.pending or m.orphans)}
