"""Blocks a request holds ahead of its table's end (``GroupSpec.ahead``): vLLM's
``num_speculative_blocks`` of a Mamba group in ``mamba_cache_mode="none"`` (served as a
2-token window), the scratch states a speculative (MTP / EAGLE) step writes past the
request's last position.

A group with ``ahead = a`` keeps its table ``a`` entries longer than the others' rule::

    | released (None) | held: up to max(num_scheduled, num_reserved) | a blocks ahead |
    0              cut[g]                                     blocks_for(...)    + a

The blocks ahead are taken at admission with the rest (vLLM's ``get_num_blocks_to_allocate``
counts ``num_tokens + a * block_size`` in that group), and as the table grows they become
the entries of the new positions while as many new blocks are appended: a growth of ``m``
entries takes ``m`` blocks in every group, theirs included, so only the lengths
(``blocks_for(covered) + a``) and the admission's count (``a`` more) tell the groups apart.
No window release reaches them (they lie past every query), no step records them (they lie
past every scheduled block); ``free`` returns them with the rest. A manager whose groups
hold none ahead runs the code it ran without them: its ``_ahead0`` (group 0's, the group
whose table length measures growth) is 0, ``_ahead`` None, and its one-token path
(``_roomy``, which reads the tables' lengths) is its class's; with blocks ahead it is
``roomy`` (``serve``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MethodType
from typing import TYPE_CHECKING

from . import spec_states
from .request import GroupRequest
from .spec import GroupSpec

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager


def aheads(specs: Sequence[GroupSpec]) -> tuple[int, ...] | None:
    """Each group's ``ahead``, or None when no group holds a block ahead."""
    out = tuple(s.ahead for s in specs)
    return out if any(out) else None


def lengths(covered: Sequence[int], ahead: Sequence[int] | None) -> list[int]:
    """Each group's table length for ``covered[g]`` positions' blocks."""
    if ahead is None:
        return list(covered)
    return [c + a for c, a in zip(covered, ahead, strict=True)]


def serve(self: HybridKVCacheManager) -> None:
    """Give the manager ``self`` (built, with blocks ahead) the one-token check
    ``roomy`` in place of its class's."""
    self.__dict__["_roomy"] = MethodType(roomy, self)
    if any(s.sparse and s.ahead for s in self.groups) and not self._serves_sizes:
        self.__dict__["_take"] = MethodType(spec_states.take, self)


def roomy(self: HybridKVCacheManager, req: GroupRequest) -> bool:
    """The class's ``_roomy`` (whose length test the blocks ahead pass), and one more
    token at ``num_scheduled`` lands in a block before every group's blocks ahead."""
    n, ahead = req.num_scheduled, self._ahead
    assert ahead is not None
    return type(self)._roomy(self, req) and all(
        n < (len(t) - a) * b for t, a, b in zip(req.tables, ahead, self._group_sizes, strict=True))
