"""The engine's side of the store ops, for torch caches (imports torch: not part of the
core, and ``prefixkv.store`` does not import it).

A block's payload is its K, then its V, every layer, in the cache's dtype and byte
order: ``K[block] | V[block]`` where ``K[block]`` is the ``[num_layers, block_size,
num_kv_heads, head_dim]`` slice of a device cache ``[num_layers, num_blocks, ...]``
(``block_dim=1``, the example runner's layout) or of a host cache ``[num_slots,
num_layers, ...]`` (slot-major, one run of bytes per slot). Every replica must use the
same layout and dtype: the ``StoreLayout`` names them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy
import torch

from ..errors import ConfigError
from ..results import KVOp, StoreFetched, StorePut
from .record import payload_bytes
from .writer import StoreWriter


def kv_block_bytes(k_cache: torch.Tensor, v_cache: torch.Tensor, block_dim: int = 1) -> int:
    """Bytes of one block's payload, K's and V's: the ``StoreLayout.block_bytes`` of these
    caches. ``k_cache``, ``v_cache``: device caches whose dimension ``block_dim`` indexes
    the blocks (``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` with the
    default 1). Raises ConfigError for a ``block_dim`` that is not one of their dimensions,
    or caches with no block along it."""
    for c in (k_cache, v_cache):
        if not isinstance(c, torch.Tensor):
            raise ConfigError(f"the caches must be torch tensors, got {type(c).__name__}")
        if type(block_dim) is not int or not 0 <= block_dim < c.dim():
            raise ConfigError(f"block_dim must be a dimension of the caches, in [0, {c.dim()}) "
                              f"for shape {tuple(c.shape)}, got {block_dim!r}")
        if c.shape[block_dim] == 0:
            raise ConfigError(f"caches of shape {tuple(c.shape)} hold no block along "
                              f"block_dim {block_dim}")
    per = [c.numel() // c.shape[block_dim] * c.element_size() for c in (k_cache, v_cache)]
    return sum(per)


def host_slot_views(k_host: torch.Tensor, v_host: torch.Tensor) -> list[list[memoryview]]:
    """Each host slot's memory as writable byte views, K then V (slot-major caches
    ``[num_slots, ...]``, contiguous, on the CPU, pinned or not): what
    ``KVCacheManager.attach_host_memory`` takes, so fetches read straight into the slots.
    The tensors must outlive the manager's fetches. Raises ConfigError for caches that
    are not contiguous CPU tensors with one slot per row (at least one slot)."""
    for c in (k_host, v_host):
        if not isinstance(c, torch.Tensor):
            raise ConfigError(f"host caches must be torch tensors, got {type(c).__name__}")
        if c.device.type != "cpu" or not c.is_contiguous() or c.dim() == 0 \
                or k_host.dim() == 0 or c.shape[0] != k_host.shape[0] or c.shape[0] == 0:
            raise ConfigError(f"host caches must be contiguous CPU tensors [num_slots, ...] "
                              f"of equal slots, got {tuple(c.shape)} on {c.device}")
    n = k_host.shape[0]
    k, v = (memoryview(c.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
            for c in (k_host, v_host))
    sk, sv = len(k) // n, len(v) // n
    return [[k[i * sk:(i + 1) * sk], v[i * sv:(i + 1) * sv]] for i in range(n)]


def block_payload(k_cache: torch.Tensor, v_cache: torch.Tensor, block_id: int,
                  block_dim: int = 1) -> bytes:
    """The payload of device block ``block_id`` (copied to the CPU: call it before a
    forward pass or a load may overwrite the block)."""
    parts = [c.select(block_dim, block_id).contiguous().cpu().view(torch.uint8).numpy().tobytes()
             for c in (k_cache, v_cache)]
    return parts[0] + parts[1]


def write_payload(k_host: torch.Tensor, v_host: torch.Tensor, slot: int,
                  payload: bytes | memoryview) -> None:
    """Write ``payload`` into host slot ``slot`` of slot-major host caches.
    Raises ConfigError when its length is not the slot's (another layout or dtype)."""
    k, v = k_host[slot], v_host[slot]
    nk, nv = k.numel() * k.element_size(), v.numel() * v.element_size()
    view = payload_bytes(payload)
    if view.nbytes != nk + nv:
        raise ConfigError(f"a payload of {view.nbytes} bytes for host slots of {nk + nv}: "
                          f"the StoreLayout's block_bytes must match the caches")
    if k.device.type == v.device.type == "cpu" and k.is_contiguous() and v.is_contiguous():
        src = numpy.frombuffer(view, numpy.uint8)  # (no copy: the payload is read in place)
        k.view(-1).view(torch.uint8).numpy()[:] = src[:nk]
        v.view(-1).view(torch.uint8).numpy()[:] = src[nk:]
        return
    raw = torch.frombuffer(bytearray(view), dtype=torch.uint8)  # (writable: a copy)
    k.copy_(raw[:nk].view(k.dtype).view(k.shape))
    v.copy_(raw[nk:].view(v.dtype).view(v.shape))


def run_store_ops(ops: Sequence[KVOp], k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k_host: torch.Tensor, v_host: torch.Tensor, writer: StoreWriter,
                  block_dim: int = 1) -> list[KVOp]:
    """Run a plan's store ops and return the others, in order, for the engine's copies
    (``BlockOffloads``, ``BlockLoads``, ``BlockCopy``). Call it first: a ``StorePut`` reads
    a device block that a later load or copy of the plan may overwrite, and a
    ``StoreFetched`` writes a host slot that a later load reads; no offload of the plan
    writes a fetched slot (it is pinned).

    ``k_cache``, ``v_cache``: the device caches, blocks along ``block_dim``
    (``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` with the default
    1); ``k_host``, ``v_host``: slot-major host caches ``[num_slots, ...]`` whose slot
    holds a device block's bytes (``[num_layers, block_size, num_kv_heads, head_dim]``).
    ``writer``: where puts go (``StoreWriter.put``). Raises ConfigError, before any op
    runs, for a bad ``block_dim`` (as ``kv_block_bytes``), host slots whose bytes are
    not a device block's (another dtype, block size or head layout), a fetched payload
    of another length (as ``write_payload``) or for a slot the host caches lack, caches
    that are not tensors, ``ops`` that are not a list or tuple, or a ``writer`` without
    ``put``."""
    if not isinstance(ops, (list, tuple)) or not callable(getattr(writer, "put", None)):
        raise ConfigError(f"run_store_ops takes a plan's ops (a list) and a StoreWriter, got "
                          f"{type(ops).__name__}, {type(writer).__name__}")
    for c in (k_host, v_host):
        if not isinstance(c, torch.Tensor):
            raise ConfigError(f"host caches must be torch tensors, got {type(c).__name__}")
    block = kv_block_bytes(k_cache, v_cache, block_dim)
    slot = sum(math.prod(c.shape[1:]) * c.element_size() for c in (k_host, v_host))
    if slot != block:
        raise ConfigError(f"host slots of {slot} bytes (k_host {tuple(k_host.shape)} "
                          f"{k_host.dtype}) for device blocks of {block} (k_cache "
                          f"{tuple(k_cache.shape)} {k_cache.dtype}, block_dim {block_dim}): a "
                          f"host slot must hold one device block, in the same dtype")
    slots = k_host.shape[0]
    for op in ops:  # (checked first: no put goes out before a fetched payload is refused)
        if type(op) is StoreFetched:
            if type(op.dst) is not int or not 0 <= op.dst < slots:
                raise ConfigError(f"a fetched payload for host slot {op.dst!r}: the host "
                                  f"caches have slots 0..{slots - 1}")
            if payload_bytes(op.payload).nbytes != block:
                raise ConfigError(f"a payload of {payload_bytes(op.payload).nbytes} bytes for "
                                  f"host slots of {block}: the StoreLayout's block_bytes "
                                  f"must match the caches")
    rest: list[KVOp] = []
    for op in ops:
        if type(op) is StorePut:
            writer.put(op, block_payload(k_cache, v_cache, op.src, block_dim))
        elif type(op) is StoreFetched:
            write_payload(k_host, v_host, op.dst, op.payload)
        else:
            rest.append(op)
    return rest
