"""Layer groups: models that mix full attention with sliding-window or chunked local
attention, or with Mamba (state-space) layers. ``HybridKVCacheManager`` keeps a block
table per group over one shared pool, releases blocks that leave every future window,
and reports the longest prefix every group can serve (``prefixkv.groups.hits``);
``BlockSizes`` states the rules for groups of different block sizes (not offered by the
manager yet). Pure Python, like the core."""

from .events import GroupBlockRemoved, GroupBlockStored
from .hits import longest_hit, longest_sized_hit
from .manager import HybridKVCacheManager
from .results import GroupAdmission, GroupBlockCopy, GroupDecodeStep, GroupFork, GroupStats
from .sizes import BlockSizes
from .spec import (
    CHUNKED,
    FULL,
    MAMBA,
    SLIDING,
    GroupSpec,
    chunked_local,
    full_attention,
    mamba,
    sliding_window,
)

__all__ = [
    "BlockSizes", "CHUNKED", "FULL", "GroupAdmission", "GroupBlockCopy", "GroupBlockRemoved",
    "GroupBlockStored", "GroupDecodeStep", "GroupFork", "GroupSpec", "GroupStats", "HybridKVCacheManager",
    "MAMBA", "SLIDING", "chunked_local", "full_attention", "longest_hit", "longest_sized_hit", "mamba",
    "sliding_window",
]
