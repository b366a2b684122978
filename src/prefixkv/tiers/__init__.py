"""Tiers below the device pool: where a block's content goes when the pool evicts it,
and where admission looks after the device misses. ``HostTier``: host memory (L2)."""

from .host import HostTier
from .host_index import HostSlot

__all__ = ["HostSlot", "HostTier"]
