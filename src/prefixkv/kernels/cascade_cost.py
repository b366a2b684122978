"""Which reads fewer keys, cascade attention or the plain call: a count from the tiles the
launches take, on the host counts a :class:`~prefixkv.kernels.CascadeBatch` keeps.

One program of the attention kernel holds ``block_q`` query positions of one request and
one KV head, and loads every key its rows may attend (causal, bottom-right aligned): a
request of ``q`` new tokens on ``k`` keys loads, over its ``T = ceil(q / block_q)``
programs, ``sum_t (k - q + min((t + 1) * block_q, q)) = T (k - q) + block_q T (T - 1) / 2 + q``
keys per KV head. Cascade: pass 2 loads each request's keys past its group's prefix,
pass 1 each group's prefix once per tile of its packed rows; both return the LSE, whose
tiles are at most 128 rows (the plain prefill's are 256), so a chunked prefill of long
own parts can read more than the plain call (twice as much on the H100, run 7). Split-KV
cuts a program's keys into slices and loads each key once all the same.
"""

from __future__ import annotations

from typing import NamedTuple

import triton

from ..core.block import blocks_for
from .cascade_batch import CascadeBatch
from .tiling import choose_tiles

__all__ = ["CascadeKeys", "cascade_keys"]


class CascadeKeys(NamedTuple):
    """Keys one KV head's programs load for one call, plain and cascade (both passes)."""

    plain: int
    cascade: int

    @property
    def pays(self) -> bool:
        """Cascade loads fewer keys than the plain call."""
        return self.cascade < self.plain


def keys_read(q_len: int, kv_len: int, block_q: int) -> int:
    """Keys one KV head's programs of one request load (closed form of the module's sum)."""
    return _keys_read_sum(q_len, 1, kv_len, block_q)


def _block_q(group: int, head_dim: int, max_seqlen_q: int, on_gpu: bool, elem_bytes: int, return_lse: bool,
             kv_fp8: bool) -> int:
    group_p2 = triton.next_power_of_2(group)
    tile = choose_tiles(group=group, head_dim=head_dim, max_seqlen_q=max_seqlen_q, on_gpu=on_gpu,
                        elem_bytes=elem_bytes, return_lse=return_lse, kv_fp8=kv_fp8)
    return int(max(tile.block_m, group_p2) // group_p2)


def cascade_keys(cascade: CascadeBatch, *, group: int, head_dim: int, max_seqlen_q: int, on_gpu: bool = True,
                 elem_bytes: int = 2, return_lse: bool = False, kv_fp8: bool = False) -> CascadeKeys:
    """Keys one KV head loads in the plain call of ``cascade``'s batch and in cascade's two
    passes, with the tiles the launches take: ``group`` query heads per KV head,
    ``head_dim``, the call's ``max_seqlen_q``, ``on_gpu`` (GPU tiles, else the
    interpreter's), ``elem_bytes`` of q, ``return_lse`` of the plain call, an fp8 cache.
    Bytes: keys x KV heads x head_dim x 2 (K and V) x the cache's element size.
    """
    def block_q(max_q: int, lse: bool) -> int:
        return _block_q(group, head_dim, max_q, on_gpu, elem_bytes, lse, kv_fp8)

    plain_q, own_q = block_q(max_seqlen_q, return_lse), block_q(max_seqlen_q, True)
    plain = cascade_keys_ = 0
    for q_len, requests, keys, own in cascade.by_q_len:  # keys_read summed over equal q_len
        plain += _keys_read_sum(q_len, requests, keys, plain_q)
        cascade_keys_ += _keys_read_sum(q_len, requests, own, own_q)
    if cascade.prefix_groups:
        prefix_q = block_q(cascade.max_seqlen_q, True)
        cascade_keys_ += sum(blocks_for(rows, prefix_q) * keys for rows, keys in cascade.prefix_groups)
    return CascadeKeys(plain, cascade_keys_)


def _keys_read_sum(q_len: int, requests: int, kv_lens: int, block_q: int) -> int:
    """:func:`keys_read` summed over ``requests`` requests of ``q_len`` new tokens whose
    keys add up to ``kv_lens`` (the formula is linear in the keys)."""
    if q_len <= 0:
        return 0
    tiles = blocks_for(q_len, block_q)
    return tiles * (kv_lens - requests * q_len) + requests * (block_q * tiles * (tiles - 1) // 2 + q_len)
