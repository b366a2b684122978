"""Block transfers between device KV caches and host caches: the copies of the manager's
per-step plan (``take_kv_ops()``: offloads, then loads, then fork copies).

Layouts. A device cache is any tensor with a block axis ``block_dim`` (``0`` for one
layer's ``[num_blocks, block_size, num_kv_heads, head_dim]``, ``1`` for layers stacked
as ``[num_layers, num_blocks, ...]``). Its host cache is slot-major, so that one slot is
one contiguous run of bytes across every layer::

    device  [num_layers, num_blocks, block_size, H, D]      (block_dim = 1)
    host    [num_slots,  num_layers, block_size, H, D]      (alloc_host_cache)

One call moves a set of blocks for every given cache (K and V, all layers): the device
side is one torch indexed copy per cache (``index_select`` / ``index_copy_``) through a
contiguous staging tensor, and the host side is one ``copy_`` per run of consecutive slot
ids (a run is contiguous in a slot-major host cache, so the copy is one DMA). On CUDA the
host caches are pinned, the copies are queued on a side stream after the work already on
the current stream, nothing waits on the host, and the call returns a ``torch.cuda.Event``
recorded after them: the engine makes its forward pass wait for it
(``torch.cuda.current_stream().wait_event(ev)``), and must synchronise on it before it
reads a host cache from the CPU. On the CPU the same calls copy at once and return None.
The copies move bytes (an integer view of each cache), so every cache dtype, fp8 included,
is copied bit for bit.

Ids are 1-D int32/int64 tensors on the CPU (the host needs their values to find the runs;
reading them never waits for the device). Every check happens before anything is written.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import cast

import torch

from ..results import BlockCopy, BlockLoads, BlockOffloads
from .errors import ArgumentTypeError, BlockIdError, ShapeError, UnsupportedError
from .transfer_plan import TransferPlan, check_caches, slot_shape, transfer_stream

__all__ = ["alloc_host_cache", "offload_blocks", "load_blocks", "copy_blocks", "run_kv_ops",
           "transfer_stream"]

def alloc_host_cache(device_cache: torch.Tensor, num_slots: int, *, block_dim: int = 0) -> torch.Tensor:
    """A host cache of ``num_slots`` slots for ``device_cache``: shape ``[num_slots,
    *device_cache.shape without block_dim]``, same dtype, contiguous, zero-filled, on the
    CPU, pinned when ``device_cache`` is on CUDA.

    Raises:
        ArgumentTypeError: ``device_cache`` is not a tensor.
        UnsupportedError: ``num_slots`` is not an int >= 1, or ``block_dim`` not an axis.
        DtypeError: a dtype other than float16/bfloat16/float32/float8_e4m3fn/float8_e5m2.
    """
    check_caches("device_cache", [device_cache], block_dim)
    if type(num_slots) is not int or num_slots < 1:
        raise UnsupportedError(f"num_slots must be an int >= 1, got {num_slots!r}")
    shape = (num_slots, *slot_shape(device_cache, block_dim))
    return torch.zeros(shape, dtype=device_cache.dtype, pin_memory=device_cache.is_cuda)


def offload_blocks(device_caches: Sequence[torch.Tensor], host_caches: Sequence[torch.Tensor],
                   device_ids: torch.Tensor, host_ids: torch.Tensor, *, block_dim: int = 0,
                   stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Copy device block ``device_ids[i]`` into host slot ``host_ids[i]``, in every pair
    ``(device_caches[c], host_caches[c])``.

    ``device_caches``: tensors with a block axis ``block_dim``, one device, one block
    count. ``host_caches``: the matching ``alloc_host_cache`` layouts (CPU, contiguous).
    ``device_ids``, ``host_ids``: ``[n]`` int32/int64 on the CPU; host ids distinct.
    ``stream``: CUDA only; default ``transfer_stream(device)``.
    Returns the event recorded after the copies (CUDA), or None (CPU: done).

    Raises:
        ArgumentTypeError: a cache list that is not a list/tuple of tensors, ids not tensors.
        ShapeError: cache lists of different lengths or empty, host shapes that do not
            match, a host cache not contiguous, ids not 1-D or of different lengths; a
            cache the call writes (host caches here, device caches for loads and copies)
            that is an expanded view or shares memory with another cache or the ids
            (K and V given as one tensor).
        DtypeError: cache dtypes differ or are not float16/bfloat16/float32 or fp8
            (float8_e4m3fn, float8_e5m2); ids not int.
        DeviceError: device caches on several devices, host caches or ids not on the CPU.
        UnsupportedError: ``block_dim`` not an axis; a ``stream`` with CPU caches.
        BlockIdError: an id outside its cache, or a host id given twice.
    """
    plan = TransferPlan(device_caches, host_caches, block_dim, stream)
    plan.check_ids(device_ids, host_ids, plan.num_blocks, plan.num_slots, "device_ids", "host_ids")
    plan.check_writes("offload_blocks", True, False, {"device_ids": device_ids, "host_ids": host_ids})
    return plan.run(lambda: plan.offload(device_ids, host_ids))


def load_blocks(host_caches: Sequence[torch.Tensor], device_caches: Sequence[torch.Tensor],
                host_ids: torch.Tensor, device_ids: torch.Tensor, *, block_dim: int = 0,
                stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Copy host slot ``host_ids[i]`` into device block ``device_ids[i]``, in every pair
    of caches; device ids distinct. Arguments, returns and raises as ``offload_blocks``
    (the id given twice is a device id here)."""
    plan = TransferPlan(device_caches, host_caches, block_dim, stream)
    plan.check_ids(host_ids, device_ids, plan.num_slots, plan.num_blocks, "host_ids", "device_ids")
    plan.check_writes("load_blocks", False, True, {"host_ids": host_ids, "device_ids": device_ids})
    return plan.run(lambda: plan.load(host_ids, device_ids))


def copy_blocks(device_caches: Sequence[torch.Tensor], src_ids: torch.Tensor, dst_ids: torch.Tensor,
                *, block_dim: int = 0, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Copy device block ``src_ids[i]`` into ``dst_ids[i]`` (fork copy-on-write), in every
    cache, as if one after another in order: a copy whose source is an earlier copy's
    destination reads what that copy wrote (a fork of a fork in one plan: ``0 -> 1``,
    ``1 -> 2`` puts block 0's content in 2, as ``take_kv_ops()`` requires); destinations
    distinct. Returns and raises as ``offload_blocks``."""
    plan = TransferPlan(device_caches, None, block_dim, stream)
    plan.check_ids(src_ids, dst_ids, plan.num_blocks, plan.num_blocks, "src_ids", "dst_ids")
    plan.check_writes("copy_blocks", False, True, {"src_ids": src_ids, "dst_ids": dst_ids})
    return plan.run(lambda: plan.copy(src_ids, dst_ids))


def run_kv_ops(ops: Sequence[BlockOffloads | BlockLoads | BlockCopy], device_caches: Sequence[torch.Tensor],
               host_caches: Sequence[torch.Tensor] | None = None, *, block_dim: int = 0,
               stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Run a plan from ``take_kv_ops()``: every offload (the ids of all the
    ``BlockOffloads``, in order), then every load (likewise of all the ``BlockLoads``),
    then every copy (in order, as ``copy_blocks``), one transfer per kind over all
    caches. ``device_caches``, ``host_caches``, ``block_dim``, ``stream``: as
    ``offload_blocks``; ``host_caches`` is needed when the plan has offloads or loads.
    Returns the event after the last copy (CUDA), or None (CPU, or an empty plan).
    Raises as the three calls, before any copy; also ArgumentTypeError for an op of
    another type or an id that is not an int (a bool, a float: never rounded),
    ShapeError for host ops without ``host_caches`` or a ``BlockOffloads`` or
    ``BlockLoads`` whose ``src`` and ``dst`` differ in length."""
    src: dict[type, list[int]] = {BlockOffloads: [], BlockLoads: [], BlockCopy: []}
    dst: dict[type, list[int]] = {BlockOffloads: [], BlockLoads: [], BlockCopy: []}
    for op in ops:
        kind = type(op)
        if kind not in src:
            raise ArgumentTypeError(f"ops must be BlockOffloads, BlockLoads or BlockCopy, got {op!r}")
        if isinstance(op, BlockCopy):
            src[kind].append(_op_id(op, op.src))
            dst[kind].append(_op_id(op, op.dst))
        else:  # BlockOffloads, BlockLoads: id lists
            if not isinstance(op.src, (tuple, list)) or not isinstance(op.dst, (tuple, list)):
                raise ArgumentTypeError(f"a {kind.__name__}'s src and dst must be tuples of int, "
                                        f"got {op!r:.80}")
            if len(op.src) != len(op.dst):
                raise ShapeError(f"a {kind.__name__} with {len(op.src)} sources and "
                                 f"{len(op.dst)} destinations")
            src[kind] += _op_ids(op, op.src)
            dst[kind] += _op_ids(op, op.dst)
    if not ops:
        return None
    if host_caches is None and (src[BlockOffloads] or src[BlockLoads]):
        raise ShapeError("the plan moves blocks to or from the host but no host_caches were given")
    plan = TransferPlan(device_caches, host_caches, block_dim, stream)
    ids = {kind: (_ids(src[kind]), _ids(dst[kind])) for kind in src}
    plan.check_ids(*ids[BlockOffloads], plan.num_blocks, plan.num_slots, "offload src", "offload dst")
    plan.check_ids(*ids[BlockLoads], plan.num_slots, plan.num_blocks, "load src", "load dst")
    plan.check_ids(*ids[BlockCopy], plan.num_blocks, plan.num_blocks, "copy src", "copy dst")
    plan.check_writes("run_kv_ops", bool(src[BlockOffloads]), bool(src[BlockLoads] or src[BlockCopy]), {})

    def work() -> None:
        plan.offload(*ids[BlockOffloads])
        plan.load(*ids[BlockLoads])
        plan.copy(*ids[BlockCopy])

    return plan.run(work)


def _op_id(op: object, value: object) -> int:
    """``value`` (an id of ``op``) as an int: any integer type (``__index__``), never a bool
    or a float, whose rounding would move another block's KV."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ArgumentTypeError(f"ids must be int, got {value!r} ({type(value).__name__}) in {op!r:.80}")
    try:
        return operator.index(value)  # type: ignore[arg-type]  # __index__ checked above
    except TypeError as exc:  # a float tensor's __index__
        raise ArgumentTypeError(f"ids must be int, got {value!r} in {op!r:.80}") from exc


def _op_ids(op: object, values: Sequence[object]) -> list[int]:
    """``values`` (ids of ``op``) as ints, as :func:`_op_id` takes each; plain ints (what
    the manager states) without a Python-level loop: a step may offload thousands."""
    if set(map(type, values)) <= {int}:
        return cast("list[int]", list(values))
    return [_op_id(op, v) for v in values]


def _ids(values: list[int]) -> torch.Tensor:
    try:
        return torch.tensor(values, dtype=torch.int64)
    except (ValueError, RuntimeError, OverflowError) as exc:  # an int past int64: outside every cache
        raise BlockIdError(f"an id is outside every cache (past int64): {exc}") from exc
