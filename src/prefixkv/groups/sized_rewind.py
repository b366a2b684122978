"""``rewind`` on the hybrid manager over groups of different block sizes (groups/sized.py):
the request goes back to its first ``num_tokens`` tokens and the engine recomputes from
there, as the one-size ``rewind`` (decode.py), each group at its own size.

    tokens        | kept                  | forgotten (given again by append_tokens)  |
    0             num_tokens                                            num_scheduled
    prefix ids    cut at num_tokens // hash_size (the hash blocks wholly kept)
    group of b    its blocks from num_tokens // b lose their content (GroupIndex.uncache:
                  a prefix no other block of its group holds is forgotten with every
                  descendant, in every group); they stay in the table, recorded anew
                  as the recompute passes each aligned end

Blocks below ``num_tokens // b`` recorded at a later count stay recorded (their KV is
sound). A block another request shares is pinned as at one size (pins.py, per group at
its own size): the recompute must give the same tokens up to the end of the last one.
vLLM's manager has no rewind: its scheduler sets the computed tokens back (a whole
prompt loaded, whose last token it recomputes; a failed load) and its blocks stay
cached. The block ids are the same either way (the tables keep their length); what is
findable until the recompute records again, and the longer prefixes forgotten, differ
(tests/sized_model.py ``rewind`` states prefixkv's rule, docs/groups.md "Rewind").

Refused with ConfigError, before any change: beside a Mamba group (a state block is not
rewound yet), and where a query at ``num_tokens`` reads a block a window released or
the request is tainted (the recompute over lost KV, groups/taint.py, is not ported to
sizes yet).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from ..core.block import Block
from ..errors import ConfigError, check_count
from .decode import set_back
from .pins import RewindPins
from .request import GroupRequest
from .taint import reads_lost

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager


def _refuse(why: str) -> ConfigError:
    return ConfigError(f"rewind {why} is not served with groups of different block sizes yet "
                       f"(docs/groups.md)")


def _uncached(self: HybridKVCacheManager, req: GroupRequest, num_tokens: int) -> list[Block]:
    """The request's blocks from ``num_tokens // b`` on, per group (in order): every one
    that holds content loses it, also one past the last its own prefix ids key (a block
    it shares that another request recorded again after an earlier rewind of this one:
    the recompute writes other KV there; GroupIndex.uncache skips the empty ones)."""
    return [blk for t, b in zip(req.tables, self._group_sizes, strict=True)
            for blk in t[num_tokens // b:] if blk is not None]


def rewind(self: HybridKVCacheManager, request_id: Hashable, num_tokens: int) -> None:
    """As ``HybridKVCacheManager.rewind`` (the module says what is served). Raises
    RequestError (unknown id, ``num_tokens`` outside ``[0, num_scheduled_tokens]``),
    ConfigError (what is not served yet)."""
    req = self._get(request_id)
    check_count("num_tokens", num_tokens, 0, req.num_scheduled)
    if self._sparse:
        raise _refuse("beside a Mamba group")
    if req.tainted_from is not None or reads_lost(self.groups, req, num_tokens, self._group_sizes):
        raise _refuse("to where a window released what the recompute reads")
    if self._pins is None:
        self._pins = RewindPins()
    self._pins.rewind(req, num_tokens, self._group_sizes, self._requests)
    freed, owner = self._index.uncache(_uncached(self, req, num_tokens)), self._index.owner
    # (the descendants' free blocks go to the empty tier in one stated order, the last
    # of it taken first: by group, then block id; tests/sized_model.py ``rewind``)
    self._pool.emptied(sorted(freed, key=lambda b: (owner[b.block_id], b.block_id)))
    set_back(self, req, num_tokens, num_tokens // self._hash_size, self._hash_size)
