"""A prefix-aware router in front of N replicas (pure Python; the ZeroMQ subscriber needs
``prefixkv[events]``, the Redis index ``prefixkv[redis]``, imported only where used).

It imports nothing of the core but its types and ``block_hashes``: the index learns
what each replica holds from vLLM-format KV events (``decode``), and a prompt is scored
by the longest run of its block hashes each replica holds, and by load.
"""

from .decode import Cleared, DecodeError, Removed, Stored, decode_batch
from .index import BlockIndex, InProcessIndex
from .router import Choice, Router, RouterError

__all__ = [
    "BlockIndex", "Choice", "Cleared", "DecodeError", "InProcessIndex", "Removed", "Router",
    "RouterError", "Stored", "decode_batch",
]
