"""The prefix cache's index: full blocks found by their content.

A block's content is ``(parent content id, token bytes, extra-key bytes)``. Content ids
are handed out per process, one per distinct content (blocks holding equal content share
one), so the triple names a whole prefix exactly. The index is keyed by the token bytes
alone (``by_chunk``: a bytes key hashes and compares far faster than a tuple), and the
entry found is verified against the parent id and extra bytes: a hit is one dict probe
and two comparisons, with no call into the chain hash, so a collision of chain hashes,
accidental or crafted, cannot make a hit. The rare content whose token bytes are already
taken by another content (the same block of text after a different prefix or with
other extra keys) is keyed by the whole triple in ``by_key``, probed only on a mismatch.

Most contents are in neither dict: a new content under a parent whose content has no
other child is *chained*, found only as the parent's ``child`` (tried before any probe and
verified the same way), so storing and evicting a chain's blocks touches no dict. A
displaced chained sibling, a first block, a content with spares and its children are
keyed. With a tier below, blocks loaded from its slots are chained the same way, and the
walk past the device's run tries a device block's child before probing; a chained block
whose parent's content leaves the device while it stays (``uncache``) is keyed, since the
walk may reach that content in a slot.

The chain hash is the identity outside the process (events, tiers, stores). It is
computed only for blocks newly stored, and only when someone needs it (``hashing``):

    id(block 0) = H(root || tokens[0:bs] || extra_0),  id(block i) = H(id(i-1) || ...)

Equal content in two blocks (a block-aligned prompt re-sent while cached, identical
greedy requests) makes the later one a *spare* (a twin): the index keeps one entry per
key, the primary, and remembers the held twins, so when the primary is evicted a twin
takes its place and the content (and every child keyed under it) stays findable. A twin
whose last reference goes holds nothing of value (its content is still cached) and
returns empty. So: a content is findable exactly while some block holds it, and events
announce a hash once (first block) and withdraw it once (last block).

This module claims content (``claim``: an admission's hits, their references taken in the
same pass). ``ContentIndex``'s other parts: its state (``chains.py``), recording
(``recording.py``, ``landed.py``), spares leaving the index (``spares.py``), eviction and
checks (``dropping.py``), finding content without a claim (``matching.py``); a claimed run
cut where the prompt parts from it (``run_cut.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from operator import attrgetter
from typing import TYPE_CHECKING

from ..core.block import Block
from ..errors import ConfigError, check_positive
from ..event_log import EventLog, EventSink, NullSink
from .hasher import Hasher
from .matching import NO_PARENT as _NO_PARENT
from .matching import MatchingIndex
from .pending import split_pending
from .run_cut import agree, split_run

if TYPE_CHECKING:
    from .lower import LowerTier

_REFS = attrgetter("refs")


class ContentIndex(MatchingIndex):
    """Satisfies ``Index``. ``hasher``/``sink``: chain hashes are computed, and events
    written to ``sink``, only when ``sink.active``. ``lower``: the tier that keeps
    evicted content and continues a chain past the device's misses (``HostTier``).
    Raises ConfigError for a ``hasher`` not a ``Hasher``, a ``sink`` not a ``NullSink``
    or ``EventLog``, or a ``block_size`` not a positive int."""

    def __init__(self, hasher: Hasher, sink: EventSink, block_size: int, *,
                 lower: LowerTier | None = None) -> None:  # (a wrong argument's error names this class)
        if not isinstance(hasher, Hasher) or not isinstance(sink, NullSink | EventLog):
            raise ConfigError(f"ContentIndex needs a Hasher and an event sink (NullSink or EventLog), "
                              f"got {hasher!r} and {sink!r}")
        super().__init__(hasher, sink, check_positive("block_size", block_size), lower=lower)
        # the parent of a first block in ``claim`` (content id 0): its ``child`` is the first
        # block the last claim found, a guess verified as any (prompts that open alike, a
        # shared system prompt, find it without hashing their first chunk for a probe)
        self._root = Block(-1)

    def __len__(self) -> int:
        return len(self._by_chunk) + len(self._by_key) + self._num_chained + sum(
            len(r.blocks) for r in self.run_counts.pending)

    def claim(self, chunks: Sequence[bytes], base: bytes, mm: Sequence[bytes] | None,
              data: bytes) -> tuple[list[Block], int] | None:
        """``match`` that also takes a reference on each block found, in the same pass
        (a block with no reference leaves the pool's cached tier: its links are unlinked
        in place and left stale). Returns the hits and how many of them left the cached
        tier, for ``BlockPool.claimed`` (``BlockPool.unclaim`` undoes it); None, with nothing
        done, with per-block extra keys: then use ``match``. With a tier below, the run is
        the device's alone: the caller checks whether the tier goes on after it. ``data``:
        the chunks' bytes in one piece (or a longer bytes that starts with them): a run
        is compared with it as one memcmp."""
        if mm is not None:
            return None
        hits: list[Block] = []
        held = 0
        # (``by_chunk.get`` called as a method: no bound method made, a C path cold each step)
        by_chunk, by_key, epoch = self._by_chunk, self._by_key, self._epoch
        width = 4 * self._bs
        n = len(chunks)
        end = n * width
        root = p = self._root  # (its content id is 0, a first block's parent_cid)
        b: Block | None
        i = 0  # the chunks compared: ``len(hits)`` (an index, not an iterator: a run skips
        while True:  # its chunks with an addition, no ``islice``, a C path cold each step)
            if i >= n:  # (not ``while i < n``: the loop is long, so its test's jump needs
                break  # an ``EXTENDED_ARG``, after which 3.11 leaves the compare generic)
            chunk = chunks[i]
            # the parent's last child first: a verified guess saves hashing the chunk
            b = p.child
            if b.key != chunk or b.parent_cid != p.content_id \
                    or (b.extra is not base and b.extra != base) \
                    or b.twin:  # (extra is nearly always the same object: ``is`` first)
                cid = p.content_id
                b = by_chunk.get(chunk)
                if b is None or b.parent_cid != cid or b.extra != base:
                    b = by_key.get((cid, chunk, base)) if by_key else None
                    if b is None:
                        break
            if b.counted is not None:  # (one block's count alone: see ``Run``)
                b.counted.dissolve()
            if b.refs:  # (the held ones are counted: the unlinking branch costs more)
                b.refs += 1
                held += 1
            else:  # unlinked from the cached tier in place, its own links left stale
                b.prev.next = b.next
                b.next.prev = b.prev
                b.refs = 1
            hits.append(b)
            p = b
            i += 1
            while True:  # (a run may end on a block heading another run: a pending
                # run's blocks have no key, so only its head's ``starts`` reaches them)
                run = b.starts
                if run is None or run.ok != epoch or (run.extra is not base and run.extra != base):
                    break
                # b heads a run: as many of its blocks as agree with the prompt's next chunks
                # are the blocks found for them (a shared run holds its content; ``Run``)
                known = run.blocks
                k = len(known)
                if (run.pcid if run.pending else known[0].parent_cid) != b.content_id:
                    # (b holds other content since)
                    break
                # (the head's chunk first, as recorded; within the chunks given: a probe may
                # be cut short of ``data``. At an offset, not a slice of the prompt's bytes:
                # a copy writes its lines, ~30 a chat step, where ``startswith``'s argument
                # parsing is ~19 lines of machine code, once a step: events-r30.md)
                if not data.startswith(run.data, (i - 1) * width, end):
                    # (-1: b's differs: b was emptied and refilled since, its ``starts`` stale)
                    k = agree(run.data, data, (i - 1) * width, end, width) - 1
                    if k <= 0:
                        break
                    if run.pending:  # (the cut written alone: ``split_pending``; one block
                        known = split_pending(run, k, width)  # leaves the pending runs)
                        self._num_chained += 1
                    else:
                        known = split_run(run, k, width)  # (the part claimed, a run of its own now)
                if run.shared:  # one count for the run; free, it leaves the tier as one segment
                    if run.n:  # (consecutive there: ``Run``)
                        held += k
                    else:
                        run.counts.free -= 1
                        if run.fwd:
                            known[0].prev.next = known[-1].next
                            known[-1].next.prev = known[0].prev
                        else:
                            known[-1].prev.next = known[0].next
                            known[0].next.prev = known[-1].prev
                    run.n += 1
                else:  # (stale, maybe: each block checked as a hit is, before any is taken,
                    # unless no block has lost its content since the run was known whole)
                    if run.seen != self.losses:
                        q = b
                        for x, chunk in zip(known, islice(chunks, i, i + k), strict=True):
                            if x.key != chunk or x.twin or x.parent_cid != q.content_id \
                                    or x.extra != base:
                                break
                            q = x
                        else:
                            q = _NO_PARENT
                        if q is not _NO_PARENT:  # one was not: the blocks go one by one
                            run.ok = -1
                            break
                        run.seen = self.losses
                    was = held
                    for b in known:
                        if b.counted is not None:  # (another run shares it: a run recorded
                            # since over blocks rewound and computed again; its count alone)
                            b.counted.dissolve()
                        if b.refs:
                            b.refs += 1
                            held += 1
                        else:
                            b.prev.next = b.next
                            b.next.prev = b.prev
                            b.refs = 1
                    # each was free (held by this request alone from now on), or each is held
                    # as many times (each count changes with the run's from now on, until one
                    # changes alone; counted in C): one count for them all
                    if held == was or held - was == k and list(
                            map(_REFS, known)).count(known[0].refs) == k:
                        run.shared = True
                        run.n = known[0].refs
                        run.counts.shared += 1
                        for b in known:
                            b.counted = run
                hits.extend(known)  # (not ``+=``: a C path of its own, cold each step)
                p = known[-1]
                b = p
                i += k  # (the k chunks compared)
        if hits:
            root.child = hits[0]
        return hits, len(hits) - held
