"""Small frozen result types of plain ints handed back to the engine."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Admission:
    """A request admitted by ``add_request``.

    ``block_ids``: the request's blocks in order (cached prefix first).
    ``num_cached_tokens``: prompt tokens whose KV is already in those blocks (a multiple
    of block_size, and always < the prompt length). ``num_new_tokens``: tokens scheduled
    now, whose KV the engine computes in this step (positions ``num_cached_tokens`` to
    ``num_cached_tokens + num_new_tokens - 1``).
    """

    request_id: Hashable
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    num_new_tokens: int


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy the KV of block ``src`` into block ``dst`` (all block_size slots) before the
    next forward pass."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class Fork:
    """A child created by ``fork``: its blocks, and the copies the engine must make
    (copy-on-write of the parent's partial last block; empty when there is none)."""

    request_id: Hashable
    block_ids: tuple[int, ...]
    copies: tuple[BlockCopy, ...]
