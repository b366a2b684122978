"""The requests of one HiSparse layout on its two pools: the host pool, which holds each
request's primary copy (the source group's row), and the device pool (an ``UnpinPool``),
which holds the indexer's pages, the resident row (``row.ResidentRow``: its pages, a
write-back cache of the host row) and the hot region, taken once the request must read
from host. The copies to host in flight are ``spills.Spills``.

The rules are vLLM 0.33's (``v1/hisparse/coordinator.py``, its HiSparse managers and
``BlockPool``), in the scope of tests/engines/hisparse_model.py, against which
tests/engines/test_hisparse_state.py checks this state call by call: prefix caching off
(no hits, no publication), one resident and one hot group, one block size; external
(connector) loads into host pages are ``imports.Imports``' (``load``, ``finish_import``;
checked against tests/engines/hisparse_import_model.py). A request's step is
``allocate`` (all or nothing, the full-sequence gate when asked) then ``advance`` (copies
planned, pages unpinned or the hot region asked for); the workers' reports confirm
copies (``report``); ``free`` lets a request go while its copies in flight keep their
blocks until confirmed. Caller mistakes raise
RequestError before any change.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from ...core.block import Block, blocks_for
from ...core.pool import BlockPool, PoolIndex
from ...core.pool_unpin import UnpinPool
from ...errors import RequestError, check_count
from ...index import NoIndex
from . import loads, state_check
from .imports import Imports
from .request import _Request
from .row import CLEAN, UNPINNED, ResidentRow
from .spills import Spills

__all__ = ["HiSparseState"]


class HiSparseState:
    """The requests of a HiSparse layout (module doc). ``num_blocks``/``host_blocks``:
    each pool's blocks, its block 0 the null block; ``hot_blocks``: a hot region's;
    ``window``: the admission window in pages; ``max_pages``: the most copies planned and
    not yet sent; ``reprefill``: the last tokens of a step not final (not copied)."""

    def __init__(self, num_blocks: int, host_blocks: int, hot_blocks: int, block_size: int,
                 window: int, max_pages: int, reprefill: int = 0) -> None:
        for name, n in (("num_blocks", num_blocks), ("host_blocks", host_blocks)):
            check_count(name, n, 2, None)
        self.block_size = check_count("block_size", block_size, 1, None)
        self.hot_blocks = check_count("hot_blocks", hot_blocks, 1, None)
        self.window = check_count("window", window, 1, None)
        self.reprefill = check_count("reprefill", reprefill, 0, None)
        self.watermark = max(hot_blocks, num_blocks // 10)  # (vLLM's, against the free count)
        self.device = UnpinPool(num_blocks, self._new_index())
        self.host = BlockPool(host_blocks, self._new_index())
        self.nulls = (self.device.take(1)[0], self.host.take(1)[0])
        self.spills = Spills(max_pages)
        self.imports = Imports()
        self._requests: dict[Hashable, _Request] = {}
        self._unpinned: dict[int, set[tuple[Hashable, int]]] = {}  # block id -> (request, page)s
        self._orphans: dict[int, tuple[Block, Block]] = {}  # copy id -> its blocks

    def _new_index(self) -> PoolIndex:
        """The index of each pool's content: none (caching off; cache.py's subclass has one)."""
        return NoIndex()

    # the subclass's hooks (cache.py): nothing to do with caching off
    def _adopt(self, key: Hashable) -> None:
        """``key``'s step is scheduled, its copies planned: its hit pages adopt GPU copies."""

    def _let_go(self, block: Block) -> None:
        """A freed request's unpinned ``block`` is no one's to read any more."""
        self.device.forget(block)

    def _orphan_done(self, tid: int) -> None:
        """Copy ``tid`` of a freed request is confirmed (before its host block goes)."""

    def _confirmed(self, keys: set[Hashable]) -> None:
        """Copies of the live requests ``keys`` were confirmed (their rows are updated)."""

    def _leaving(self, key: Hashable) -> None:
        """``key`` is being freed: it holds its blocks and rows still."""

    def _held_host(self) -> list[Block]:
        """The host blocks held outside the requests and their copies (for the checks)."""
        return []

    def _get(self, key: Hashable) -> _Request:
        r = self._requests.get(key)
        if r is None:
            raise RequestError(f"unknown HiSparse request {key!r}")
        return r

    def holds(self, key: Hashable) -> bool:
        """Whether ``key`` is a request of this state (admitted, not freed)."""
        return key in self._requests

    def request(self, key: Hashable) -> tuple[list[int], list[int], list[int], list[int], bool]:
        """``key``'s block ids: host row, indexer, resident row (0: read from host), hot
        region; and whether it was asked to take its hot region."""
        r = self._get(key)
        return ([b.block_id for b in r.host], [b.block_id for b in r.indexer],
                [0 if b is None else b.block_id for b in r.blocks], [b.block_id for b in r.hot],
                r.hot_required)

    def row(self, key: Hashable) -> ResidentRow:
        """``key``'s resident row (read it; the state changes it)."""
        return self._get(key).row

    def need(self, key: Hashable, tokens: int, *, cap: bool = False, imported: int = 0) -> int:
        """Device blocks ``key`` (new or not) takes to cover ``tokens`` tokens: its indexer
        pages, its row's (capped at the admission window when ``cap``) and its hot region
        if asked for; when the host pool cannot back its pages, that plus the device
        pool's size and one (vLLM's answer: more than the pool can ever give).
        ``imported``: the computed tokens, when they include an external load's (then
        the row's count is ``Imports.row_need``'s and the hot region is counted)."""
        r = self._requests.get(key) or _Request()
        pages = blocks_for(check_count("tokens", tokens, 1, None), self.block_size)
        n = max(pages - len(r.indexer), 0)
        if imported:  # (an import's count: imports.py)
            check_count("imported", imported, 1, None)
            n += Imports.row_need(r.blocks, pages, imported, self.block_size) + self.hot_blocks - len(r.hot)
        else:
            n += max((min(pages, self.window) if cap else pages) - len(r.blocks), 0)
            n += self.hot_blocks - len(r.hot) if r.hot_required else 0
        return n + (len(self.device.blocks) + 1 if pages - len(r.host) > self.host.num_free else 0)

    def fits(self, key: Hashable, full: int) -> bool:
        """The full-sequence gate for ``key`` (new or not) of ``full`` tokens: all of its
        host pages, then the device pages of its indexer, of its row capped at the
        admission window, and its hot region if asked for."""
        return self.need(key, full, cap=True) <= self.device.num_free

    def reclaims(self) -> bool:
        """Whether a copy in flight gives blocks back once confirmed: a freed request's
        whose host block no one else holds (vLLM's test: the copy's the one reference),
        or one of a row that reads from host (its page is unpinned then)."""
        return any(self._orphans[t][1].ref_cnt == 1 if k is None else self._requests[k].row.hot
                   for t, (k, _) in self.spills.flight.items())

    def allocate(self, key: Hashable, total: int, full: int = 0) -> bool:
        """Give ``key`` (admitted if new) the blocks of ``total`` tokens, all or nothing;
        ``full``: the request's length when all of it must fit (0: it need not).
        Returns whether it did."""
        check_count("total", total, 1, None)
        if full and not self.fits(key, full):
            return False
        r = self._requests.get(key) or _Request()
        pages = blocks_for(total, self.block_size)
        grow = max(pages - len(r.host), 0)
        if grow > self.host.num_free:
            return False
        new_indexer, new_row = max(pages - len(r.indexer), 0), max(pages - len(r.blocks), 0)
        new_hot = self.hot_blocks - len(r.hot) if r.hot_required else 0
        if new_indexer + new_row + new_hot > self.device.num_free:
            return False
        self._requests[key] = r
        r.host += self.host.take(grow)
        r.indexer += self.device.take(new_indexer)
        r.blocks += self.device.take(new_row)
        r.row.grow(new_row)
        if r.hot_required:  # (a page lost above is one of a row that reads from host already)
            r.hot += self.device.take(self.hot_blocks - len(r.hot))
            if not r.row.hot:
                r.row.hold_hot()
        return True

    def load(self, key: Hashable, imported: int, total: int, full: int = 0) -> bool:
        """A new request ``key``'s first allocation, all or nothing: an external load of
        its first ``imported`` tokens into host pages, and the slots up to ``total``
        tokens (module doc of imports.py; ``full``: the request's length when all of it
        must fit, 0: it need not). Returns whether it fit. RequestError, nothing
        changed, for a request holding blocks or ``total`` short of ``imported``."""
        return loads.load(self, key, imported, total, full)

    def finish_import(self, key: Hashable, failed: bool) -> None:
        """``key``'s pending import ended (vLLM's ``finish_host_import``): done, its whole
        pages are valid and its tail page's restore is planned (its copy id among
        ``take_copies``', ``imports.restores``); failed, its pages stay unmarked
        (``imports.failed``, until freed). Nothing without a pending import."""
        loads.finish_import(self, key, failed)

    def advance(self, key: Hashable, total: int) -> None:
        """``key``'s step to ``total`` tokens is scheduled: the sealed pages of its final
        tokens get copies planned; then a row reading from host unpins its clean pages,
        and one that does not asks for its hot region when the pool runs low or the row
        holds its window."""
        r = self._get(key)
        self.plan(key, max(total - self.reprefill, 0))
        self._adopt(key)
        if not r.row.hot:
            if r.row.asks_for_hot(self.device.num_free, self.watermark, self.window):
                r.hot_required = True
            return
        for page in r.row.unpinnable():
            self._unpin(key, r, page)

    def plan(self, key: Hashable, tokens: int) -> None:
        """Plan copies of ``key``'s DIRTY pages that its first ``tokens`` tokens seal
        (within the budget; vLLM's ``plan_prefix_materialization``)."""
        r = self._get(key)
        sealed = min(check_count("tokens", tokens, 0, None) // self.block_size, len(r.row))
        pending = self.imports.pending  # (a pending import's pages are not copied)
        first = blocks_for(pending[key], self.block_size) if pending and key in pending else 0
        self.spills.plan(key, r.row.plan(sealed, self.spills.budget, first))

    def _unpin(self, key: Hashable, r: _Request, page: int) -> None:
        block = r.blocks[page]
        assert block is not None
        r.row.unpin(page)
        self._unpinned.setdefault(block.block_id, set()).add((key, page))
        self.device.unpin([block], self._reused)

    def _reused(self, block: Block) -> None:
        """The device pool handed an unpinned block out: the pages that read it (one, or
        several where a hit adopted it) are read from host from now on."""
        for key, page in self._unpinned.pop(block.block_id, ()):
            r = self._requests[key]
            r.row.lose(page)
            r.blocks[page] = None
            r.hot_required = True
            if page < r.synced:
                r.stale.add(page)

    def require_hot(self, key: Hashable) -> None:
        """``key`` takes its hot region with its next allocation (vLLM's ``require_hot``)."""
        self._get(key).hot_required = True

    def take_residency(self, key: Hashable) -> tuple[list[int], list[int]] | None:
        """What the workers lack of ``key``'s row: the pages lost since they were told,
        then those added since, with their device block ids (0: read from host); None
        when nothing changed or ``key`` holds no blocks. They are told now."""
        r = self._requests.get(key)
        if r is None or (not r.stale and r.synced >= len(r.blocks)):
            return None
        pages = [*sorted(r.stale), *range(r.synced, len(r.blocks))]
        r.stale.clear()
        r.synced = len(r.blocks)
        return pages, [0 if (b := r.blocks[p]) is None else b.block_id for p in pages]

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The copies planned since the last call, in order: (copy id, device block id,
        host block id) (the step's offload command)."""
        out = []
        for tid in self.spills.take():
            block, host = self._blocks_of(tid)
            out.append((tid, block.block_id, host.block_id))
        return out

    def _blocks_of(self, tid: int) -> tuple[Block, Block]:
        if tid in self._orphans:
            return self._orphans[tid]
        key, page = self.spills.page_of(tid)
        r = self._requests[key]
        block = r.blocks[page]
        assert block is not None
        return block, r.host[page]

    def report(self, enqueued: Mapping[int, int], completed: Mapping[int, int]) -> list[int]:
        """The workers' reports (``Spills.report``): the copies confirmed now, in id order.
        A freed request's give their blocks back; a live one's pages turn clean (and are
        unpinned at once when its row reads from host and they are not among its last)."""
        owners = {t: self.spills.page_of(t) for t in {*enqueued, *completed} if t in self.spills}
        done = self.spills.report(enqueued, completed)
        orphans = [t for t in done if t in self._orphans]
        for tid in orphans:  # (the device blocks first, then the host ones; to the head)
            self.device.free([self._orphans[tid][0]])
        restores = self.imports.restores  # (copy id -> a restore's page is whole)
        for tid in done:
            whole = restores.pop(tid, True) if restores else True  # (True: a copy to host)
            if tid in self._orphans:
                self._orphan_done(tid)
                self.host.free([self._orphans.pop(tid)[1]])
                continue
            key, page = owners[tid]
            r = self._requests[key]
            if whole:
                if r.row.confirm(page):
                    self._unpin(key, r, page)
            else:
                r.row.restored(page)
        self._confirmed({owners[t][0] for t in done if owners[t][0] is not None} & self._requests.keys())
        return done

    def free(self, key: Hashable) -> None:
        """``key`` goes. Its unpinned pages stay in the pool, no longer its own; its other
        clean pages are unpinned so (tail first; a block another row reads stays watched);
        its copies in flight keep their device and host blocks until confirmed; the rest
        goes back to the head of each pool, the host row, then group by group: the
        indexer's, the row's dirty pages, the hot region (each tail first)."""
        r = self._get(key)
        self.imports.forget(key)
        self._leaving(key)
        for page in r.row.pages(UNPINNED):
            block = r.blocks[page]
            assert block is not None
            readers = self._unpinned[block.block_id]
            readers.discard((key, page))
            if not readers:
                del self._unpinned[block.block_id]
                if not block.refs:
                    self._let_go(block)
        clean = [r.blocks[p] for p in reversed(r.row.pages(CLEAN))]
        split = r.row.free()
        for block in clean:
            assert block is not None
            self.device.unpin([block], self._reused)
            if not block.refs and block.block_id not in self._unpinned:
                self._let_go(block)
        busy = set(split.kept)
        for tid in self.spills.detach(key):
            page = self.spills.page_of(tid)[1]
            block = r.blocks[page]
            assert block is not None
            self._orphans[tid] = (block, r.host[page])
        del self._requests[key]
        self.host.free([b for p, b in reversed(list(enumerate(r.host))) if p not in busy])
        for blocks in (r.indexer, [r.blocks[p] for p in split.to_head], r.hot):
            self.device.free([b for b in reversed(blocks) if b is not None])

    def check_invariants(self, others: Sequence[Block] = (), host_others: Sequence[Block] = ()) -> None:
        """Raise InvariantError when the pools, rows and copies disagree. ``others``,
        ``host_others``: the device and host blocks held outside these requests."""
        state_check.check(self, others, host_others)
