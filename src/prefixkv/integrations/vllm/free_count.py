"""A write of vLLM's free count (``block_pool.free_block_queue.num_free_blocks = n``), as
a reservation of prefixkv's blocks.

vLLM's tests run the pool dry by writing its free queue's counter (``= 0``): its pool
then believes ``n`` blocks are free, its ``allocate_slots`` finds none to take and the
scheduler preempts; each block freed later adds one to the counter; the test writes the
old count back to end it. The free list itself is never touched, nor any cached block.

prefixkv serves the write with the same effect and no lie about a block:

- ``n`` below the blocks free now reserves the difference, ``R = free - n``: from then
  on ``allocate_slots`` keeps ``R`` blocks free on top of what it keeps anyway (its
  ``reserved_blocks`` grows by ``R``: an admission or a step that would dip into them
  returns None, nothing changed), and the count reads ``free - R`` (``num_free_blocks``,
  ``get_num_free_blocks``, ``usage``), so a block freed later adds one to it, as in
  vLLM; no block is taken or evicted, no content lost.
- ``n`` at or above the blocks free ends the reservation (R = 0): the count reads the
  pool's again. (vLLM's counter would then claim blocks its list does not hold, and its
  pool would fail when it tries to take them; prefixkv shows none it does not have.)
- ``n`` not an int >= 0: RequestError, nothing changed.
- While ``R > 0``, ``allocate_slots(..., full_sequence_must_fit=True)`` is refused by name
  (UnsupportedByPrefixKV, nothing changed): vLLM's whole-sequence gate reads its counter
  (``free - R``) where prefixkv's reads its pool, and would admit what vLLM refuses.

The reservation is installed on the manager object at the first write
(``allocate_slots`` wrapped there): a manager whose count is never written runs its
class's calls, untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefixkv.errors import check_count

from .layout import UnsupportedByPrefixKV

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["Reservation"]

_RESERVED_AT = 8  # ``reserved_blocks``'s position among allocate_slots' arguments after the request
_FULL_FIT_AT = 7  # ``full_sequence_must_fit``'s


class Reservation:
    """The blocks a write of the free count set aside (``blocks``, R) on manager ``m``."""

    def __init__(self, m: KVCacheManager) -> None:
        self._m = m
        self.blocks = 0
        self._installed = False

    def free(self) -> int:
        """The free count as vLLM's pool shows it: prefixkv's free blocks less R."""
        return max(0, int(self._m.core.num_free_blocks) - self.blocks)

    def write(self, n: int) -> None:
        """``num_free_blocks = n`` (the module docstring). Raises RequestError for ``n``
        that is not an int >= 0, nothing changed."""
        n = check_count("num_free_blocks", n, 0, None)
        if not self._installed:
            m = self._m
            m.allocate_slots = _keeping(m.allocate_slots, self)  # type: ignore[method-assign]
            self._installed = True
        self.blocks = max(0, int(self._m.core.num_free_blocks) - n)


def _keeping(call: Callable[..., Any], reservation: Reservation) -> Callable[..., Any]:
    def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
        r = reservation.blocks
        if r:  # (a count that is not an int is left for the call to refuse)
            gate = args[_FULL_FIT_AT] if len(args) > _FULL_FIT_AT else kwargs.get("full_sequence_must_fit")
            if gate is True:
                raise UnsupportedByPrefixKV(
                    f"allocate_slots with full_sequence_must_fit=True while a write of "
                    f"free_block_queue.num_free_blocks hides {r} blocks: vLLM's whole-sequence gate reads "
                    f"its written counter, prefixkv serves the write as reserved blocks only")
            if len(args) > _RESERVED_AT:
                if args[_RESERVED_AT].__class__ is int:
                    args = (*args[:_RESERVED_AT], args[_RESERVED_AT] + r, *args[_RESERVED_AT + 1:])
            elif (kept := kwargs.get("reserved_blocks", 0)).__class__ is int:
                kwargs["reserved_blocks"] = kept + r
        return call(request, *args, **kwargs)

    allocate_slots.__doc__ = call.__doc__
    return allocate_slots
