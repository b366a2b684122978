"""The reference of vLLM 0.33's HiSparse external (connector) loads into host pages, on top
of hisparse_model.py's ``Model`` (read from vLLM's ``HiSparseResidentManager``,
``HiSparseHotManager`` and ``HiSparseSourceManager.allocate_external_computed_blocks`` /
``get_num_blocks_to_allocate``, and ``HiSparseCoordinator.record_pending_host_import`` /
``finish_host_import`` / ``complete_host_import``; written here). Imports nothing of vLLM.

Scope: the model's, and a request may start with a load: its first allocation (vLLM's
``allocate_slots`` with ``num_external_computed_tokens=E``, no new token, its blocks'
caching delayed, as an async load asks) of ``E`` tokens an external load writes into its
host pages. The rules (``ImportModel``; its cases at the end):

- the load's count (``ImportModel.fits_load``): the host pages of ``cdiv(T, bs)`` tokens
  (host pool: when short, nothing else counts), on the GPU pool the indexer's pages of
  ``T`` tokens, ONE resident page (the import's tail page, writable: the earlier
  imported pages are read from host) plus the row's pages past the import, and the hot
  region (an import must read from host); ``T`` is the request's length when the whole
  of it must fit (never capped at the admission window), else ``E``;
- the load takes, in this order: the host pages, the indexer's pages, the tail page (the
  row is null up to it), then the hot region; the import is pending (``pending``) and
  no page below its end is copied to host while it is;
- its end (vLLM's ``finish_host_import``): failed, nothing changes (the request is
  freed); done, the import's whole pages are valid (``valid`` becomes exactly them, the
  ready prefix their count) and the tail page is restored: a transfer (``restore``,
  before the forward pass) from its host page to its GPU page, which confirmed makes the
  page clean only if it is whole (a partial tail stays dirty: the next steps fill it);
- a freed request's pending import goes with it; its restore in flight keeps both
  blocks until confirmed, as a copy to host does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from .hisparse_cases import CONFIRM, HALVE, STEP, STREAMS
from .hisparse_model import BS, MAX_LEN, Model, cdiv, model_state


@dataclass
class ImportModel(Model):
    """``Model`` whose request may start with an external load (module doc)."""

    pending_import: int = 0  # the tokens of the import not yet finished (0: none)
    restores: set[int] = field(default_factory=set)  # the transfers in flight that are restores

    def fits_load(self, imported: int, full: int) -> bool:
        """Whether a new request's load of ``imported`` tokens fits, the whole request of
        ``full`` tokens too when it must (0: it need not)."""
        tokens = min(full, MAX_LEN) if full else imported
        pages, imported_pages = cdiv(tokens, BS), cdiv(imported, BS)
        if pages > len(self.host):
            self.note("host full")
            return False
        need = pages + 1 + max(pages - imported_pages, 0) + self.hot_blocks
        if need > len(self.gpu):
            self.note("gpu full")
            return False
        return True

    def load(self, imported: int, full: int = 0) -> bool:
        """A new request's first allocation: ``imported`` tokens loaded into host pages
        (module doc). Returns whether it fit."""
        assert not self.host_row and imported > 0
        if (full and not self.fits_load(imported, full)) or not self.fits_load(imported, 0):
            return False
        pages = cdiv(imported, BS)
        self.host_row = [self.host.popleft() for _ in range(pages)]
        self.indexer = self.pop(pages)
        self.row = [0] * (pages - 1) + self.pop(1)
        self.hot_required = True
        self.hot = self.pop(self.hot_blocks)
        self.pending_import = self.computed = imported
        self.note("loaded")
        return True

    def plan(self, sealed: int) -> None:
        """``Model.plan`` from the pending import's end on."""
        first = cdiv(self.pending_import, BS)
        ready, self.ready = self.ready, max(self.ready, first)
        super().plan(sealed)
        self.ready = ready

    def finish(self, failed: bool) -> None:
        """The load's end (module doc); nothing without a pending import."""
        imported, self.pending_import = self.pending_import, 0
        if not imported or failed:
            return
        pages = imported // BS
        self.valid, self.ready = set(range(pages)), pages
        tail = (imported - 1) // BS
        if tail in self.pending.values() or not self.row[tail]:
            return
        self.pending[self.next_transfer] = tail
        self.restores.add(self.next_transfer)
        self.to_send.append(self.next_transfer)
        self.next_transfer += 1
        self.note("restore planned")

    def confirm(self, transfers: list[int]) -> None:
        """``Model.confirm`` one transfer at a time, in order; a restore makes its page
        clean only if it is valid."""
        for tid in sorted(transfers):
            if tid not in self.restores or tid not in self.pending:
                self.restores.discard(tid)
                super().confirm([tid])
                continue
            self.restores.discard(tid)
            page = self.pending.pop(tid)
            if page in self.valid:
                self.pinned_clean.add(page)
                if self.can_read_from_host():
                    self.unpin(page)
            self.note("restored")

    def free(self) -> None:
        """``Model.free``; the pending import goes too."""
        self.pending_import = 0
        super().free()


def import_state(m: ImportModel) -> dict[str, Any]:
    """``model_state`` with the pending import and the restores in flight."""
    return {**model_state(m), "import": m.pending_import,
            "restores": sorted(m.pending[t] for t in m.restores if t in m.pending)}


ALL = 2**16 - 1
# (pool, host pool, hot blocks, max_in_flight_tokens, prompt), ops, what must happen; a
# "load" of ``arg`` tokens (the whole request must fit when ``arg`` is negative) starts a
# new request (the one holding blocks is freed first); "finish" ends its import (failed
# when ``arg``: then freed)
IMPORT_SCENARIOS = {
    # vLLM's test_hisparse_external_import_uses_hard_gpu_footprint: the indexer's 4 pages,
    # one row page and the hot region fill the pool; the row is null but its tail
    "hard-gpu-footprint": ((8, 9, 2, MAX_LEN, 4 * BS), [("load", -4 * BS)], {"loaded"}),
    # a whole tail page restored, then clean; the steps go on from the prompt's last token
    "whole-tail-restored": ((32, 16, 2, MAX_LEN, 4 * BS), [
        ("load", -4 * BS), ("finish", 0), ("confirm", ALL), ("step", 1), ("confirm", ALL)],
        {"loaded", "restore planned", "restored"}),
    # a partial tail restored stays dirty; the next steps fill it, then it is copied
    "partial-tail-restored": ((32, 16, 2, MAX_LEN, 6 * BS), [
        ("load", BS + 1), ("finish", 0), ("confirm", ALL), ("step", 2 * BS), ("confirm", ALL),
        ("step", 3 * BS), ("confirm", ALL)], {"loaded", "restored", "unpinned"}),
    # freed with the restore in flight: both blocks wait for the two workers
    "aborted-restore": ((16, 16, 2, MAX_LEN, BS + 1), [
        ("load", -(BS + 1)), ("finish", 0), ("halve", ALL), ("free", 0), ("confirm", ALL),
        ("step", BS)], {"restore planned", "freed in flight"}),
    "failed-import": ((16, 16, 2, MAX_LEN, 3 * BS), [
        ("load", 2 * BS), ("finish", 1), ("load", 3 * BS), ("finish", 0), ("confirm", ALL)],
        {"loaded", "restored"}),
    # steps while the import is pending (no connector ends it): no page below its end copied
    "steps-before-the-end": ((32, 16, 2, MAX_LEN, 6 * BS), [
        ("load", 2 * BS + 3), ("step", 3 * BS), ("confirm", ALL), ("step", BS), ("confirm", ALL)],
        {"loaded", "unpinned"}),
    "host-short": ((32, 4, 2, MAX_LEN, 5 * BS), [("load", -3 * BS), ("load", 3 * BS)], {"host full"}),
    "gpu-short": ((8, 16, 2, MAX_LEN, 5 * BS), [("take", 2), ("load", 4 * BS), ("give_back", 0),
                                                ("load", 4 * BS)], {"gpu full", "loaded"}),
}

LOAD = st.tuples(st.just("load"), st.integers(-MAX_LEN, MAX_LEN).filter(bool))
FINISH = st.tuples(st.just("finish"), st.sampled_from([0, 0, 0, 1]))
IMPORT_OPS = st.lists(st.one_of(LOAD, FINISH, STEP, CONFIRM, LOAD, FINISH, STEP, CONFIRM, HALVE,
                                st.tuples(st.just("take"), st.integers(1, 12)),
                                st.tuples(st.just("give_back"), st.just(0)),
                                st.tuples(st.just("free"), st.just(0))), min_size=4, max_size=40)
# (pools large enough that most loads fit: the host pool backs a whole prompt)
IMPORT_STREAMS = {**STREAMS, "num_blocks": st.integers(12, 40), "host_blocks": st.integers(6, 24),
                  "ops": IMPORT_OPS}


def reports(m: Model, op: str, arg: int) -> tuple[dict[int, int], dict[int, int]]:
    """The workers' reports of a "confirm" (one worker) or "halve" (two, one completing)
    op on the copies in flight of mask ``arg``: (enqueued, completed)."""
    chosen = [t for k, t in enumerate(sorted([*m.pending, *m.orphans])) if arg >> (k % 16) & 1]
    return {t: 1 if op == "confirm" else 2 for t in chosen}, {t: 1 for t in chosen}


def seeded_stream(seed: int) -> tuple[tuple[int, int, int, int, int], list[tuple[str, int]]]:
    """A uniform random stream of 30 import ops and its shape (``run``'s arguments):
    Hypothesis' lean to short streams rarely reaches a restore confirmed."""
    rng = random.Random(seed)
    kinds = ["load", "finish", "step", "confirm", "load", "finish", "step", "confirm", "halve", "take",
             "give_back", "free"]
    ops = [(k, {"load": rng.choice([-1, 1]) * rng.randint(1, MAX_LEN), "finish": rng.choice([0, 0, 0, 1]),
                "step": rng.randint(1, 40), "confirm": rng.getrandbits(16), "halve": rng.getrandbits(16),
                "take": rng.randint(1, 12)}.get(k, 0)) for k in (rng.choice(kinds) for _ in range(30))]
    shape = (rng.randint(12, 40), rng.randint(6, 24), rng.randint(1, 3), rng.choice([16, 32, 64, MAX_LEN]),
             rng.randint(40, MAX_LEN))
    return shape, ops
