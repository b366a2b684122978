"""A Mamba (sparse) group's blocks ahead (``GroupSpec.ahead``, ``mamba(ahead=a)``): vLLM's
``num_speculative_blocks`` in ``mamba_cache_mode="align"``, the scratch states a
speculative (MTP / EAGLE) step writes past the request's running state.

A request's table ends with its state block and ``a`` blocks ahead of it::

    | released / jumped over (None) | (checkpoint) | state | a blocks ahead |
    0                                              c - 1   c              c + a

where ``c`` entries cover the positions (the step's end). Admission takes the state
block, the checkpoint's if any, then the ``a`` ahead (vLLM's first allocation,
``1 + a`` blocks: ``first_row``). A step that covers ``m`` more entries (``shift``,
vLLM's ``MambaManager.allocate_new_blocks``) moves the state to entry ``c + m - 1``:

- the entries up to ``bound = c + m - 1`` (one less with a checkpoint, whose entry is
  ``c + m - 2``) past the old end are None;
- each block ahead below ``bound`` moves to the table's end, its entry None (vLLM's
  ``_relocate_speculative_block``), in order; those at or past ``bound`` stay, the
  first of them becoming the state (or the checkpoint);
- fresh blocks fill the rest: one (two with a checkpoint) whatever ``m``, as many as
  without blocks ahead, so the count of fresh blocks (``_num_fresh``, ``sized._fresh``)
  is unchanged and only their places differ.

A block ahead lies past every scheduled position, so no step records it (hashes it,
announces it, lets a hit land on it) before it became a state block; ``check`` says so
for every request (``check_invariants``). Released as every Mamba block once the state
moved past it; ``free`` returns them with the rest. A manager without blocks ahead in a
sparse group never calls these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.block import Block
from ..errors import ConfigError

if TYPE_CHECKING:
    from .growth import Growth
    from .manager import HybridKVCacheManager
    from .request import GroupRequest


def first_row(m: int, ahead: int, new: Sequence[Block], lead: int = 0) -> list[Block | None]:
    """The ``m`` new entries of an admission's row: None but the last ``len(new)``
    (checkpoint, state and ``ahead`` blocks ahead, in the order vLLM takes them), with
    ``lead`` entries between the state and the blocks ahead left None (lookahead slots,
    which vLLM's align mode leaves out)."""
    row: list[Block | None] = [None] * m
    k = len(new) - ahead  # (the checkpoint's and the state's)
    row[m - ahead:] = new[k:]
    row[m - ahead - lead - k:m - ahead - lead] = new[:k]
    return row


def shift(table: list[Block | None], m: int, ahead: int, new: Sequence[Block], checkpoint: bool) -> None:
    """Grow ``table`` (a sparse group's, ending with its ``ahead`` blocks ahead) by ``m``
    entries, vLLM's way (module docstring): its blocks ahead below the new state's
    entry (the checkpoint's with ``checkpoint``) move to its end, ``new`` (the fresh
    blocks, as many as the rule leaves, the caller counted) after them."""
    n = len(table)
    bound = n - ahead + m - 1 - checkpoint
    if n < bound:
        table += [None] * (bound - n)
    for i in range(n - ahead, n):
        if i >= bound:
            break
        table.append(table[i])
        table[i] = None
    assert len(table) + len(new) == n + m, (len(table), len(new), n, m, ahead, checkpoint)
    table += new


def fresh(n: int, m: int, ahead: int, checkpoint: bool) -> int:
    """The fresh blocks ``shift`` puts in a table of ``n`` entries growing by ``m``."""
    bound = n - ahead + m - 1 - checkpoint
    moved = max(0, min(n, bound) - (n - ahead))
    return max(0, n + m - max(n, bound) - moved)


def refuse_slots(self: HybridKVCacheManager, num_slots: int) -> None:
    """Raises ConfigError for ``num_slots`` > 0 lookahead slots in a manager of groups of
    different block sizes whose sparse group holds blocks ahead (not served: vLLM's
    align mode leaves lookahead slots out of its Mamba group, and its plug-in refuses
    them beside Mamba, integrations/vllm/mamba.py)."""
    if num_slots and any(s.sparse and s.ahead for s in self.groups):
        raise ConfigError(f"prefixkv does not offer lookahead slots (got {num_slots}) beside a Mamba group "
                          f"holding blocks ahead (mamba(ahead=...)) with groups of different block sizes")



def refuse_load(self: HybridKVCacheManager, hit: int, first: int) -> None:
    """Raises ConfigError for a load (``num_external_tokens``: the first query at ``first``,
    past the hit at ``hit``) beside a sparse group holding blocks ahead (not served: the
    load's state block and the blocks ahead would share the row's end; vLLM's plug-in
    here refuses loads beside speculative blocks, integrations/vllm/mamba.py)."""
    if first > hit and any(s.sparse and s.ahead for s in self.groups):
        raise ConfigError(f"prefixkv does not offer a load ({first - hit} external tokens) beside a "
                          f"Mamba group holding blocks ahead (mamba(ahead=...))")

def check(table: Sequence[Block | None], ahead: int) -> str | None:
    """How the blocks ahead at the end of ``table`` are unsound (missing, or cached:
    a block ahead holds no state a hit may read yet), None when sound."""
    for b in table[len(table) - ahead:]:
        if b is None or b.key is not None:
            return f"block ahead {b!r} is {'missing' if b is None else 'cached'}"
    return None


def take(self: HybridKVCacheManager, req: GroupRequest, per_group: int) -> Growth:
    """``growth._take`` (one size) of a manager with a sparse group holding blocks ahead:
    as it, but such a group's entries placed by ``shift``."""
    fresh = self._pool.take(self._num_fresh(per_group))
    ahead = self._ahead
    assert ahead is not None
    added = []
    for g, (spec, table) in enumerate(zip(self.groups, req.tables, strict=True)):
        n = min(per_group, 1) if spec.sparse else per_group
        new, fresh = fresh[:n], fresh[n:]
        self._index.own(g, new)
        if spec.sparse and ahead[g]:
            shift(table, per_group, ahead[g], new, False)
        else:
            table += [None] * (per_group - n) + new  # type: ignore[operator]
        added.append(tuple([b.block_id for b in new]))
    return tuple(added)
