"""Stand-ins for the vLLM objects the adapter reads, and the calls of a vLLM scheduler,
shared by the adapter and conformance tests."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from prefixkv import KVCacheManager
from prefixkv.adapters.vllm import VllmAllBlocksCleared, VllmBlockStored, VllmKVCacheManager


@dataclass
class Lora:
    lora_name: str
    lora_int_id: int | None = None


@dataclass
class Pos:
    offset: int
    length: int


@dataclass
class MM:
    identifier: str
    mm_position: Pos


@dataclass
class Req:
    """The fields of vLLM's Request that the adapter reads."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    cache_salt: str | None = None
    lora_request: Lora | None = None
    mm_features: list[MM] = field(default_factory=list)
    skip_reading_prefix_cache: bool = False


def make(num_blocks: int = 16, block_size: int = 16, *, log_stats: bool = True, **kw):
    """An adapter over a new manager with events on; returns (adapter, manager)."""
    mgr = KVCacheManager(num_blocks, block_size, enable_events=True, **kw)
    return VllmKVCacheManager(mgr, log_stats=log_stats), mgr


def admit(kv, req, num_new=None, **kw):
    """What vLLM's scheduler does for a waiting request: look up, allocate, and on
    success advance ``num_computed_tokens``. Returns (new blocks or None, hit)."""
    blocks, hit = kv.get_computed_blocks(req)
    n = len(req.all_token_ids) - hit if num_new is None else num_new
    new = kv.allocate_slots(req, n, hit, blocks, **kw)
    if new is not None:
        req.num_computed_tokens = hit + n
    return new, hit


def live_hashes(events) -> set:
    """Hashes stored and not removed since the last clear: what a router mirrors."""
    live: set = set()
    for e in events:
        if isinstance(e, VllmAllBlocksCleared):
            live.clear()
        elif isinstance(e, VllmBlockStored):
            live.update(e.block_hashes)
        else:
            live.difference_update(e.block_hashes)
    return live


@contextmanager
def hidden(m, prompt, *where):
    """``(group, block)`` entries of ``prompt``'s cached blocks made unfindable for the
    duration (vLLM's test pops them from its hash map, then puts them back)."""
    nodes = m._find(None, prompt, None, True)[1]
    entries = m._index.entries
    kept = [(g, nodes[j].pid, entries[g].pop(nodes[j].pid)) for g, j in where]
    try:
        yield
    finally:
        for g, pid, block in kept:
            entries[g][pid] = block
        m.check_invariants()
