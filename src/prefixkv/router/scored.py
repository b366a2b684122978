"""Which layer group of each replica the router's index mirrors, and the application of a
replica's events to the index under that rule.

A replica whose manager has several attention groups (a hybrid model) announces each
full block once per group that caches it (``group_idx``). The index mirrors one group
per replica, so that no block counts twice: its *scored group*, the first group the
replica announces as full attention (``kv_cache_spec_kind`` absent or
``"full_attention"``; in practice the lowest) since it was last cleared. Stores and
removals of its other groups are not indexed (a removal that names no group is). A
store that names no group (vLLM 0.33 names one on every event) is a one-group replica's:
indexed when full attention, and it never sets the scored group (it once did, and one
such event, fuzzed, left every later batch of the replica's group 0 out of the index). The
scored group's run is an upper bound of the replica's hit: a windowed group needs only
the blocks inside its window, which every group computed and cached together, but may
have evicted one of them since, and the manager then serves less (it checks every
group; the router only predicts). A model without a full-attention group is scored by
no group: its replicas score 0 (its hits need the window rule, which the index does not
apply).

A store of block size 0 is not indexed, and not counted as a block size that differs:
vLLM 0.33's offloading connector announces so an offloaded key it holds no metadata for
(``_placeholder_stored``: the key's hash, no token ids, on its tier's medium), which the
router cannot place in a prompt's chain.
"""

from __future__ import annotations

from collections.abc import Sequence

from .decode import Cleared, Removed, RouterEvent, Stored
from .index import BlockIndex
from .marks import IndexMarks

__all__ = ["FULL_KIND", "ScoredGroups"]

FULL_KIND = "full_attention"


class ScoredGroups:
    """The scored group of each replica (module doc), set by its events; ``marks``: the
    router's counts beside the index (a ``Stored`` of another block size is counted
    there and not indexed; emptying a replica's index resets them)."""

    def __init__(self, marks: IndexMarks) -> None:
        self._marks = marks
        self._scored: dict[str, int] = {}

    def group(self, replica: str) -> int | None:
        """The replica's scored group; None before it announced one (events that name no
        group never set it)."""
        return self._scored.get(replica)

    def apply(self, index: BlockIndex, replica: str, events: Sequence[RouterEvent]) -> None:
        """Apply ``events`` (checked: each a ``Stored``, ``Removed`` or ``Cleared``) of
        ``replica`` to ``index``, in order; only its scored group is indexed."""
        scored = self._scored
        for ev in events:
            if isinstance(ev, Stored):
                if ev.block_size == 0 or self._marks.mismatched(replica, ev.block_size):
                    continue  # (0: a connector's placeholder, module doc)
                if ev.group is None:  # a one-group replica's: indexed when full attention
                    if ev.kind in (None, FULL_KIND):
                        index.store(replica, ev.hashes, ev.medium)
                    continue
                if replica not in scored and ev.kind in (None, FULL_KIND):
                    scored[replica] = ev.group
                if ev.group == scored.get(replica):
                    index.store(replica, ev.hashes, ev.medium)
            elif isinstance(ev, Removed):
                # a removal that names no group is applied: it can only understate
                if ev.group is None or ev.group == scored.get(replica, ev.group):
                    index.remove(replica, ev.hashes, ev.medium)
            elif isinstance(ev, Cleared):
                self.clear(index, replica)

    def clear(self, index: BlockIndex, replica: str) -> None:
        """Empty the replica's index; its next full-attention group is scored."""
        index.clear(replica)
        self._scored.pop(replica, None)
        self._marks.emptied(replica)
