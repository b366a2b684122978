"""prefixkv: a KV-cache block manager with automatic prefix caching.

The core (this package's top level) is pure Python and imports neither torch nor triton;
the kernels live in ``prefixkv.kernels`` (optional extra ``prefixkv[kernels]``).

The public API is what ``__all__`` lists here and in ``prefixkv.kernels``,
``prefixkv.engine``, ``prefixkv.router``, ``prefixkv.store``, ``prefixkv.groups`` and
``prefixkv.tiers``, the classes of ``prefixkv.fleet.publisher`` and
``prefixkv.fleet.metrics``, the engine entry points in ``prefixkv.integrations`` and the
``prefixkv`` command (all in docs/api.md). docs/api.md also has the names the docs and
examples import from a module: ``prefixkv.engine.hybrid``, ``prefixkv.router.subscriber``,
``prefixkv.router.redis_index``, ``prefixkv.store.torch_io`` and ``prefixkv.fleet.wire``;
and ``prefixkv.index``, the index protocol and the two indexes a manager builds for
itself (for readers of docs/design.md: an engine never passes one). The other modules
(``core``, ``hashing``, ...) are implementation and may change. The benchmark baselines
(``ContiguousAllocator``, ``PagedAllocator``) are importable here and from
``prefixkv.baselines`` but are not part of the API.
"""

from .allocator import Allocator
from .baselines import ContiguousAllocator as ContiguousAllocator
from .baselines import PagedAllocator as PagedAllocator
from .core.manager import KVCacheManager
from .core.prompt import Prompt
from .errors import (
    MAX_BLOCKS,
    ConfigError,
    ExtraKeysError,
    ExtraNotInstalledError,
    InvariantError,
    PlanError,
    PrefixKVError,
    PromptError,
    PromptTooLongError,
    RequestError,
    TokenError,
)
from .event_log import PendingEvents
from .events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from .extra_keys import ExtraKeys, MultiModalInput
from .hashing import block_hashes
from .results import (
    Admission,
    BlockCopy,
    BlockLoads,
    BlockOffloads,
    DecodeStep,
    Fork,
    KVOp,
    SharedPrefix,
    StoreFetched,
    StorePut,
    StoreWait,
)
from .stats import PrefixCacheStats

__version__ = "0.1.0"

__all__ = [
    "Admission", "Allocator", "AllBlocksCleared", "BlockCopy", "BlockLoads", "BlockOffloads",
    "BlockRemoved", "BlockStored",
    "ConfigError", "DecodeStep", "Event", "ExtraKeys", "ExtraKeysError", "ExtraNotInstalledError",
    "Fork", "InvariantError", "KVCacheManager", "KVOp", "MAX_BLOCKS", "MultiModalInput",
    "PendingEvents", "PlanError", "PrefixCacheStats", "PrefixKVError", "Prompt", "PromptError",
    "PromptTooLongError", "RequestError",
    "SharedPrefix",
    "StoreFetched", "StorePut", "StoreWait", "TokenError", "block_hashes",
]
