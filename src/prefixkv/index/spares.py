"""How ``ContentIndex`` takes a content's block out of the index while equal content may
stay: a held spare (twin) takes a primary's place (``_unindex``), ``uncache`` makes blocks
whose KV was never computed unfindable, ``release_spare`` lets a spare go, and the dict
helpers that key, rekey and unkey an entry. Recording is in ``recording.py``; finding
(``match``, ``claim``), the eviction step (``drop``) and checks in ``content.py``.
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

    def uncache(self, blocks: Sequence[Block], cut: bool = False) -> None:
        """Make held ``blocks`` unfindable: their KV was never computed. A block that
        another request holds too (it hit the block in the same step) keeps its content
        id, as a spare that is never found, so that request's later blocks still key
        under the right parent; the rest lose their content. (A request that hit such a
        block must be dropped too, before its step runs: its KV would be read unwritten.)
        ``cut``: blocks after these in their requests may stay findable (``uncache_blocks``
        names any blocks, not a request's whole tail), cut off from their parent's content
        as a spare's children are."""
        self.losses += 1  # (``Run.seen``)
        for b in blocks:
            if b.key is None:
                continue
            self._unindex(b)
            if b.ref_cnt > 1 or cut:
                if self._lower is not None:  # blocks after it are cut off (``cut``)
                    self.cut += 1
                    self._lower.stop_chaining()
            if b.ref_cnt > 1:
                b.twin = True
            else:
                b.key = None
                b.twin = False

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

    def _unindex(self, b: Block, evicting: bool = False) -> None:
        """Take ``b`` out of the index: unlist a twin; replace a primary by a held twin,
        or remove its key (and announce it) when it was the last block holding it; an
        evicted content computed in an earlier step goes down to the tier below."""
        if b.counted is not None:  # (its shared run is no longer whole)
            b.counted.broken()
        twins = self._twins
        if b.twin:
            listed = twins.get(b.content_id)
            if listed is not None and b in listed:
                self._unlist(b)
            return
        if b.chained:  # found through its parent alone (so no spare is held)
            b.chained = False
            self._num_chained -= 1
        elif self._entry(b.key) is not b:
            return
        elif b.content_id in twins:
            heir = self._unlist(twins[b.content_id][-1])
            heir.twin = False
            self._rekey(b.key, heir)
            return
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

