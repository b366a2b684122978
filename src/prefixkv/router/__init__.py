"""A prefix-aware router in front of N replicas (pure Python; the ZeroMQ subscriber needs
``prefixkv[events]``, the Redis index ``prefixkv[redis]``, imported only where used).

It imports nothing of the core but its types and ``block_hashes``: the index learns
what each replica holds from vLLM-format KV events (``decode``), or from the router's own
decisions (``ApproxIndex``), and a scorer weighs each replica's longest run of the
prompt's block hashes against its load (``AffinityScorer``, ``CostScorer``), which it
reads from the replicas' ``/metrics`` (``MetricsPoller``, standard library only).
"""

from .approx import ApproxIndex, ApproxIndexError
from .decode import Cleared, DecodeError, Removed, Stored, decode_batch
from .index import BlockIndex, BlockIndexError, InProcessIndex
from .load import LoadError, ReplicaLoad, from_metrics
from .poller import MetricsPoller
from .router import Choice, Router, RouterError
from .scorer import AffinityScorer, CostScorer, ReplicaView, Scorer, ScorerError

__all__ = [
    "AffinityScorer", "ApproxIndex", "ApproxIndexError", "BlockIndex", "BlockIndexError",
    "Choice", "Cleared", "CostScorer", "DecodeError", "InProcessIndex", "LoadError",
    "MetricsPoller", "Removed", "ReplicaLoad", "ReplicaView", "Router", "RouterError", "Scorer",
    "ScorerError", "Stored", "decode_batch", "from_metrics",
]
