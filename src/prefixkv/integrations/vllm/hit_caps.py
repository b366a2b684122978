"""The cap a waiting request's hit was found under, kept for its admission, where a
full-attention group's block is larger than the hash block (vLLM's fine-grained partial
hits: groups/partial_full.py).

The plug-in's admission finds the hit again (``slots.admit``), under the cap of the hit
``get_computed_blocks`` reported: elsewhere that finds the same hit, as every group's
hit is downward-closed at its blocks. Here it is not. vLLM's full attention takes a
block whole only when the cap reaches its end (``find_longest_cache_hit``'s phase 1:
``max_length // block_size`` blocks), so a hit that ends inside a block found whole
(Mamba took the hit below full attention's) is found again only under the cap it was
found under:

    tokens          | 0 .. 7 | 8 .. 15 |
    full (16)       |  block 3, cached whole   |    Mamba (8): a state at 8 only
    cap 16 (a prompt of 17 tokens): block 3 whole, Mamba takes the hit to 8: hit 8
    cap 8: no whole block, no partial entry inside block 3 at 4 or 8: hit 0

``HitCaps`` keeps the cap of each request's last lookup whose hit ends inside such a
block (None: vLLM's default, ``num_tokens - 1``), held weakly (it goes with the
``Request``); admission takes it back for that same hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["HitCaps"]


class HitCaps:
    """Each waiting request's last hit inside a block of full attention larger than the
    hash block, with the cap it was found under (module docstring)."""

    def __init__(self, fine_size: int) -> None:
        self.fine_size = fine_size
        """The block size of the full-attention groups larger than the hash block."""
        self._caps: WeakKeyDictionary[Request, tuple[int, int | None]] = WeakKeyDictionary()

    def lookup(self, m: KVCacheManager, request: Request, prompt: Any, extra: Any,
               cap: int | None) -> tuple[KVCacheBlocks, int]:
        """``hits.lookup`` here: the hit's blocks per group (rows that may end with a
        block the hit ends inside) and its tokens, the core's (with ``m.use_eagle``,
        EAGLE's: ``peek``, in ``m.eagle_groups``); noted with ``cap``."""
        peek = m.eagle_groups or False
        ids = m.core.lookup_block_ids(prompt, extra=extra, max_hit_tokens=cap, peek=peek)
        blocks = m._blocks.of(ids)
        n: int = m.core.lookup(prompt, extra=extra, max_hit_tokens=cap, peek=peek) if ids[m.hit_group] else 0
        self.note(request, n, cap)
        if n:
            m._telemetry.on_accessed(blocks)
        return blocks, n

    def note(self, request: Request, hit: int, cap: int | None) -> None:
        """``request``'s lookup found ``hit`` tokens under ``cap`` (None: no cap given)."""
        if hit % self.fine_size:
            self._caps[request] = (hit, cap)
        else:
            self._caps.pop(request, None)

    def cap(self, request: Request, hit: int) -> int | None:
        """The cap admission finds ``hit`` tokens of ``request`` under: its lookup's when
        that found this hit inside a block (None: no cap), else ``hit`` itself. (With
        vLLM's ``delay_cache_blocks``, admission asks the block's copy to hold no partial
        entry yet: slots.py, ``hold_tail``.)"""
        if hit % self.fine_size:
            noted = self._caps.get(request)
            if noted is not None and noted[0] == hit:
                return noted[1]
        return hit
