"""How ``ContentIndex`` takes a content's block out of the index while equal content may
stay: a held spare (twin) takes a primary's place (``_unindex``), ``uncache`` makes blocks
whose KV was never computed unfindable, ``release_spare`` lets a spare go, and the dict
helpers that key, rekey and unkey an entry. Recording is in ``recording.py``; finding
(``match``, ``claim``) in ``content.py``; the eviction step (``drop``) and checks in ``dropping.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import Block, Key
from .announce import RemovedRun, removed
from .recording import ContentRecorder


class SpareIndex(ContentRecorder):
    """``ContentIndex``'s spares and unindexing (see ``ContentIndex``)."""

    def _unkey(self, key: Key | None) -> None:
        """Delete the dict entry under ``key`` (token bytes, or a content triple)."""
        if type(key) is bytes:
            del self._by_chunk[key]
        else:
            assert isinstance(key, tuple), f"a keyed block without a key: {key!r}"
            del self._by_key[key]

    def uncache(self, blocks: Sequence[Block], cut: bool = False) -> list[Block]:
        """Make held ``blocks`` unfindable: their KV was never computed. A block that
        another request holds too (it hit the block in the same step) keeps its content
        id, as a spare that is never found, so that request's later blocks still key
        under the right parent; the rest lose their content. (A request that hit such a
        block must be dropped too, before its step runs: its KV would be read unwritten.)
        ``cut``: blocks after these in their requests may stay findable (``uncache_blocks``
        names any blocks, not a request's whole tail), cut off from their parent's content
        as a spare's children are.

        A content that leaves the index so takes its cached descendants with it
        (``_forget_below``). Returns those of them that were free: the pool moves them
        to its empty tier (``BlockPool.emptied``)."""
        if self.run_counts.pending:  # (the runs whose blocks are read here: those of
            for b in blocks:  # ``blocks`` and those they head; the walk below settles
                r = b.counted  # each run it reaches, through its head: no other run
                if r is not None and r.pending:  # holds a descendant (``pending.py``)
                    self._settle(r)
                r = b.starts
                if r is not None and r.pending:
                    self._settle(r)
        self.losses += 1  # (``Run.seen``)
        gone: list[Block] | None = None  # the blocks whose content left the index
        for b in blocks:
            if b.key is None:
                continue
            if self._unindex(b):
                if gone is None:
                    gone = [b]
                else:
                    gone.append(b)
            if b.ref_cnt > 1 or cut:
                if self._lower is not None:  # blocks after it are cut off (``cut``)
                    self.cut += 1
                    self._lower.stop_chaining()
            if b.ref_cnt > 1:
                b.twin = True
            else:
                b.key = None
                b.twin = False
        if self._lower is not None and self._lower.load_dst:  # (their loads are dead)
            self._lower.unload(blocks)
        return self._forget_below(gone) if gone is not None else []

    def _forget_below(self, gone: list[Block]) -> list[Block]:
        """Take out of the index every content recorded under one of ``gone``'s contents
        (which just left it), and under those, and so on, device blocks and host slots:
        no lookup could reach them, so they go as any forgotten content does (announced
        gone; their held spares and held blocks keep no findable content, a block held by
        several requests kept as an unlisted spare, as ``uncache`` keeps one). Their KV
        may have been computed on top of the KV found invalid, so they are not offered
        again when that content is recomputed (under a new content id). Returns the
        device blocks that were free, now empty. On the device the walk costs the
        descendants alone: a content's chained child is its ``child``, its keyed ones
        are noted under its id (``Kids``). With a tier below, each round passes over the
        tier's maps once (``LowerTier.forget_under``), and one more round follows a round
        that dropped slots. This runs only when a content is forgotten."""
        lost = {b.content_id for b in gone}
        freed: list[Block] = []
        lower = self._lower
        kids, by_chunk, by_key = self._kids, self._by_chunk, self._by_key
        by_parent = kids.by_parent
        todo: list[Block] = list(gone)  # blocks whose content left: their children next
        found: list[Block] = []  # device descendants, each the block found for its content
        while True:
            while todo:
                b = todo.pop()
                r = b.starts  # a pending run b heads: its blocks are b's descendants
                if r is not None and r.pending:
                    self._settle(r)
                cid = b.content_id
                c = b.child  # (a device block's chained child; a slot's is the tier's)
                if c.chained and c.parent_cid == cid and not c.twin and c.key is not None \
                        and type(b) is Block and c.content_id not in lost:
                    lost.add(c.content_id)
                    found.append(c)
                    todo.append(c)
                keys = by_parent.pop(cid, None) if by_parent else None
                if keys is not None:
                    for c in kids.live(cid, keys, by_chunk, by_key):
                        if c.content_id not in lost:
                            lost.add(c.content_id)
                            found.append(c)
                            todo.append(c)
            below = lower.forget_under(lost) if lower is not None else []
            for s in below:  # (device children of a slot's content are keyed: ``drop``)
                lost.add(s.content_id)
            todo += below
            for d in found:
                self._forget(d, freed)
            if lower is not None and lower.load_dst:  # (their loads are dead)
                lower.unload(found)
            if not below:
                return freed
            found = []

    def _forget(self, d: Block, freed: list[Block]) -> None:
        """``_forget_below``'s step for one block found for its content: its held spares
        and it keep no findable content; appended to ``freed`` when free."""
        for t in self._twins.pop(d.content_id, ()):
            t.key = None
            t.twin = False
        self._unindex(d)
        if not d.ref_cnt:
            d.key = None
            d.starts = None
            freed.append(d)
        elif d.ref_cnt > 1:
            d.twin = True
        else:
            d.key = None

    def _entry(self, key: Key | None) -> Block | None:
        """The block keyed under ``key`` in the dicts, if any."""
        if type(key) is bytes:
            return self._by_chunk.get(key)
        assert isinstance(key, tuple), f"a keyed block without a key: {key!r}"
        return self._by_key.get(key)

    def _rekey(self, key: Key | None, b: Block) -> None:
        """Key ``b`` under ``key`` (an entry there already) in its dict."""
        if type(key) is bytes:
            self._by_chunk[key] = b
        else:
            assert isinstance(key, tuple), f"a keyed block without a key: {key!r}"
            self._by_key[key] = b

    def _unindex(self, b: Block, evicting: bool = False) -> bool:
        """Take ``b`` out of the index: unlist a twin; replace a primary by a held twin,
        or remove its key (and announce it) when it was the last block holding it; an
        evicted content computed in an earlier step goes down to the tier below. Returns
        whether the content left the index (the last case)."""
        if b.counted is not None:  # (its shared run is no longer whole)
            b.counted.broken()
        twins = self._twins
        if b.twin:
            listed = twins.get(b.content_id)
            if listed is not None and b in listed:
                self._unlist(b)
            return False
        if b.chained:  # found through its parent alone (so no spare is held)
            b.chained = False
            self._num_chained -= 1
        elif self._entry(b.key) is not b:
            return False
        elif b.content_id in twins:
            heir = self._unlist(twins[b.content_id][0])  # (the first made: vLLM finds it)
            heir.twin = False
            self._rekey(b.key, heir)
            return False
        else:
            self._unkey(b.key)
        if self._lower is not None:  # the content goes: a chained child is keyed (see drop)
            c = b.child
            if c.chained and c.parent_cid == b.content_id:
                self._enter(c)
        if self.lazy:
            self._sink.defer(RemovedRun((b,)))
        elif self._sink.active:
            self._sink.append(removed((b,)))
        if evicting and self._lower is not None:
            self._lower.demote((b,), self.step)
        return True

    def _unlist(self, b: Block) -> Block:
        listed = self._twins[b.content_id]
        listed.remove(b)
        if not listed:
            del self._twins[b.content_id]
        return b

    def release_spare(self, block: Block) -> Block | None:
        # the entry under the spare's key may hold another content: a spare that
        # ``uncache`` made keeps the key it had, and a chained block's key is its token
        # bytes alone, which another content (other parent or extra keys) may be keyed by
        primary = self._entry(block.key)
        self._unindex(block)
        block.key = None
        block.twin = False
        if primary is None or primary.ref_cnt or primary.content_id != block.content_id:
            return None
        return primary
