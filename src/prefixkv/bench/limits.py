"""Caps that keep ``prefixkv bench`` within bounded memory and time, checked before the
work they guard (a trace's caps line by line as it is read, before that line's tokens
are drawn). Each error names the cap; change these constants to lift them.

Memory per token: a request's tokens are a tuple, 8 bytes a token. Drawn tokens point
into ``workloads.TOKEN_IDS`` and a continued prompt into its history's objects, so they
cost nothing more; token ids written out in a trace are int objects of their own (about
28 bytes more each). So ``MAX_TRACE_TOKENS`` keeps a parsed workload under about 0.15 GB
(measured: 16 lines of 1M drawn tokens, 159 MB peak RSS), 0.6 GB if every id is written
out, and replay time linear in it.
"""

from __future__ import annotations

MAX_REQUEST_TOKENS = 2**20
"""Prompt (with the history it continues) + output tokens of one request: a 1M context."""

MAX_BLOCK_SIZE = MAX_REQUEST_TOKENS
"""``--block-size`` at most: a larger block never fills in any request (and the shared
store names a layout's block size in 4 bytes)."""

MAX_TRACE_TOKENS = 2**24
"""All requests of one workload (a trace, or a built-in one at ``--scale``) together,
every continued prompt counted with its history: a chain of n turns of k tokens counts
about n*n*k/2, which is what it costs to replay."""

MAX_LINE_CHARS = 2**25
"""Characters in one trace line (32 Mi: a 1M-token prompt written as JSON fits)."""

MAX_POOL_BLOCKS = 2**20
"""Blocks of any pool a run creates, the capacity sweep's largest (2x) included: about
150 MB of block bookkeeping in ``KVCacheManager``."""

MAX_POOL_FLAG = MAX_POOL_BLOCKS // 2
"""``--pool-blocks`` at most: its sweep goes to twice that."""

MAX_REPLICAS = 1024
"""Replicas of a simulated fleet (``--replicas``) at most: a pool each."""
