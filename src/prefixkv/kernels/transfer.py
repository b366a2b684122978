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

Ids are 1-D int32/int64 tensors on the CPU (the host needs their values to find the runs;
reading them never waits for the device). Every check happens before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..results import BlockCopy, BlockLoad, BlockOffload
from .errors import ArgumentTypeError, BlockIdError, DeviceError, DtypeError, ShapeError, UnsupportedError
from .validation import CACHE_DTYPES, SLOT_DTYPES

__all__ = ["alloc_host_cache", "offload_blocks", "load_blocks", "copy_blocks", "run_kv_ops",
           "transfer_stream"]

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def transfer_stream(device: torch.device | str) -> torch.cuda.Stream:
    """The side stream of ``device`` (a CUDA device) used when no ``stream`` is given;
    created on first use, one per device."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def alloc_host_cache(device_cache: torch.Tensor, num_slots: int, *, block_dim: int = 0) -> torch.Tensor:
    """A host cache of ``num_slots`` slots for ``device_cache``: shape ``[num_slots,
    *device_cache.shape without block_dim]``, same dtype, contiguous, zero-filled, on the
    CPU, pinned when ``device_cache`` is on CUDA.

    Raises:
        ArgumentTypeError: ``device_cache`` is not a tensor.
        UnsupportedError: ``num_slots`` is not an int >= 1, or ``block_dim`` not an axis.
        DtypeError: a dtype other than float16/bfloat16/float32.
    """
    _check_caches("device_cache", [device_cache], block_dim)
    if type(num_slots) is not int or num_slots < 1:
        raise UnsupportedError(f"num_slots must be an int >= 1, got {num_slots!r}")
    shape = (num_slots, *_slot_shape(device_cache, block_dim))
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
            match, a host cache not contiguous, ids not 1-D or of different lengths.
        DtypeError: cache dtypes differ or are not float16/bfloat16/float32; ids not int.
        DeviceError: device caches on several devices, host caches or ids not on the CPU.
        UnsupportedError: ``block_dim`` not an axis; a ``stream`` with CPU caches.
        BlockIdError: an id outside its cache, or a host id given twice.
    """
    plan = _Plan(device_caches, host_caches, block_dim, stream)
    plan.check_ids(device_ids, host_ids, plan.num_blocks, plan.num_slots, "device_ids", "host_ids")
    return plan.run(lambda: plan.offload(device_ids, host_ids))


def load_blocks(host_caches: Sequence[torch.Tensor], device_caches: Sequence[torch.Tensor],
                host_ids: torch.Tensor, device_ids: torch.Tensor, *, block_dim: int = 0,
                stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Copy host slot ``host_ids[i]`` into device block ``device_ids[i]``, in every pair
    of caches; device ids distinct. Arguments, returns and raises as ``offload_blocks``
    (the id given twice is a device id here)."""
    plan = _Plan(device_caches, host_caches, block_dim, stream)
    plan.check_ids(host_ids, device_ids, plan.num_slots, plan.num_blocks, "host_ids", "device_ids")
    return plan.run(lambda: plan.load(host_ids, device_ids))


def copy_blocks(device_caches: Sequence[torch.Tensor], src_ids: torch.Tensor, dst_ids: torch.Tensor,
                *, block_dim: int = 0, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Copy device block ``src_ids[i]`` into ``dst_ids[i]`` (fork copy-on-write), in every
    cache; every source is read before any destination is written; destinations distinct.
    Returns and raises as ``offload_blocks``."""
    plan = _Plan(device_caches, None, block_dim, stream)
    plan.check_ids(src_ids, dst_ids, plan.num_blocks, plan.num_blocks, "src_ids", "dst_ids")
    return plan.run(lambda: plan.copy(src_ids, dst_ids))


def run_kv_ops(ops: Sequence[BlockOffload | BlockLoad | BlockCopy], device_caches: Sequence[torch.Tensor],
               host_caches: Sequence[torch.Tensor] | None = None, *, block_dim: int = 0,
               stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Run a plan from ``take_kv_ops()``: every offload, then every load, then every copy,
    one transfer per kind over all caches. ``host_caches``: needed when the plan has
    offloads or loads. Returns the event after the last copy (CUDA), or None (CPU, or an
    empty plan). Raises as the three calls, before any copy; also ArgumentTypeError for an
    op of another type, ShapeError for host ops without ``host_caches``."""
    groups: dict[type, list] = {BlockOffload: [], BlockLoad: [], BlockCopy: []}
    for op in ops:
        if type(op) not in groups:
            raise ArgumentTypeError(f"ops must be BlockOffload, BlockLoad or BlockCopy, got {op!r}")
        groups[type(op)].append(op)
    if not ops:
        return None
    if host_caches is None and (groups[BlockOffload] or groups[BlockLoad]):
        raise ShapeError("the plan moves blocks to or from the host but no host_caches were given")
    plan = _Plan(device_caches, host_caches, block_dim, stream)
    ids = {kind: (_ids([op.src for op in group]), _ids([op.dst for op in group]))
           for kind, group in groups.items()}
    plan.check_ids(*ids[BlockOffload], plan.num_blocks, plan.num_slots, "offload src", "offload dst")
    plan.check_ids(*ids[BlockLoad], plan.num_slots, plan.num_blocks, "load src", "load dst")
    plan.check_ids(*ids[BlockCopy], plan.num_blocks, plan.num_blocks, "copy src", "copy dst")

    def work() -> None:
        plan.offload(*ids[BlockOffload])
        plan.load(*ids[BlockLoad])
        plan.copy(*ids[BlockCopy])

    return plan.run(work)


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _slot_shape(cache: torch.Tensor, block_dim: int) -> tuple[int, ...]:
    return tuple(s for d, s in enumerate(cache.shape) if d != block_dim)


def _check_caches(name: str, caches, block_dim: int) -> None:
    if not isinstance(caches, (list, tuple)) or not all(isinstance(c, torch.Tensor) for c in caches):
        raise ArgumentTypeError(f"{name} must be a list or tuple of torch.Tensor, got {caches!r:.80}")
    if not caches:
        raise ShapeError(f"{name} is empty: give at least one cache")
    ndim = caches[0].dim()
    if type(block_dim) is not int or not 0 <= block_dim < ndim:
        raise UnsupportedError(f"block_dim must be an int in [0, {ndim}) for {ndim}-dim caches, "
                               f"got {block_dim!r}")
    for c in caches:
        if c.dtype not in CACHE_DTYPES:
            raise DtypeError(f"{name} dtype {c.dtype}; expected one of {CACHE_DTYPES}")


class _Plan:
    """Checked caches of one call, and the copies over them."""

    def __init__(self, device_caches, host_caches, block_dim: int, stream) -> None:
        _check_caches("device_caches", device_caches, block_dim)
        dev = device_caches[0]
        self.device = dev.device
        self.num_blocks = dev.shape[block_dim]
        for c in device_caches:
            if c.device != self.device:
                raise DeviceError(f"device caches on {c.device} and {self.device}: use one device")
            if c.dim() != dev.dim() or c.shape[block_dim] != self.num_blocks:
                raise ShapeError(f"device caches of shapes {tuple(c.shape)} and {tuple(dev.shape)}: "
                                 f"each needs {self.num_blocks} blocks on axis {block_dim}")
        self.num_slots = 0
        if host_caches is not None:
            _check_caches("host_caches", host_caches, 0)
            if len(host_caches) != len(device_caches):
                raise ShapeError(f"{len(device_caches)} device caches but {len(host_caches)} host caches")
            self.num_slots = host_caches[0].shape[0]
            for d, h in zip(device_caches, host_caches):
                want = (self.num_slots, *_slot_shape(d, block_dim))
                if tuple(h.shape) != want:
                    raise ShapeError(f"host cache shape {tuple(h.shape)}, expected {want} "
                                     f"(slot-major, see alloc_host_cache)")
                if h.dtype != d.dtype:
                    raise DtypeError(f"host cache dtype {h.dtype} != device cache dtype {d.dtype}")
                if h.device.type != "cpu":
                    raise DeviceError(f"host caches must be on the CPU, got {h.device}")
                if not h.is_contiguous():
                    raise ShapeError("host caches must be contiguous: a slot is one run of bytes")
        if stream is not None and self.device.type != "cuda":
            raise UnsupportedError(f"stream applies to CUDA caches, these are on {self.device}")
        self.devs = [c.movedim(block_dim, 0) for c in device_caches]  # views: [num_blocks, ...]
        self.hosts = list(host_caches or ())
        self.stream = stream

    @staticmethod
    def check_ids(src: torch.Tensor, dst: torch.Tensor, src_count: int, dst_count: int,
                  src_name: str, dst_name: str) -> None:
        for name, ids, count in ((src_name, src, src_count), (dst_name, dst, dst_count)):
            if not isinstance(ids, torch.Tensor):
                raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
            if ids.dim() != 1:
                raise ShapeError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
            if ids.dtype not in SLOT_DTYPES:
                raise DtypeError(f"{name} dtype {ids.dtype}; expected one of {SLOT_DTYPES}")
            if ids.device.type != "cpu":
                raise DeviceError(f"{name} must be on the CPU (its values plan the copies), got {ids.device}")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= count):
                bad = ids[(ids < 0) | (ids >= count)][0]
                raise BlockIdError(f"{name} holds {int(bad)}, outside [0, {count})")
        if src.shape != dst.shape:
            raise ShapeError(f"{src_name} has {src.numel()} ids, {dst_name} has {dst.numel()}")
        if dst.unique().numel() != dst.numel():
            raise BlockIdError(f"{dst_name} names a destination twice: {dst.tolist()}")

    def run(self, work) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            work()
            return None
        stream = self.stream or transfer_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward passes queued so far
        with torch.cuda.stream(stream):
            work()
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _runs(self, host_ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The order that sorts ``host_ids``, and its runs of consecutive slots as
        ``(first position, end position, first slot)``."""
        slots, order = host_ids.to(torch.int64).sort()
        values = slots.tolist()
        runs, start = [], 0
        for i in range(1, len(values) + 1):
            if i == len(values) or values[i] != values[i - 1] + 1:
                runs.append((start, i, values[start]))
                start = i
        return order, runs

    def offload(self, device_ids: torch.Tensor, host_ids: torch.Tensor) -> None:
        if not host_ids.numel():
            return
        order, runs = self._runs(host_ids)
        src = device_ids.to(torch.int64)[order].to(self.device, non_blocking=True)
        for dev, host in zip(self.devs, self.hosts):
            staged = dev.index_select(0, src)  # [n, ...] contiguous, in slot order
            for a, b, slot in runs:
                host[slot:slot + b - a].copy_(staged[a:b], non_blocking=True)

    def load(self, host_ids: torch.Tensor, device_ids: torch.Tensor) -> None:
        if not host_ids.numel():
            return
        order, runs = self._runs(host_ids)
        dst = device_ids.to(torch.int64)[order].to(self.device, non_blocking=True)
        for dev, host in zip(self.devs, self.hosts):
            staged = torch.empty((len(dst), *dev.shape[1:]), dtype=dev.dtype, device=self.device)
            for a, b, slot in runs:
                staged[a:b].copy_(host[slot:slot + b - a], non_blocking=True)
            dev.index_copy_(0, dst, staged)

    def copy(self, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        if not src_ids.numel():
            return
        src = src_ids.to(self.device, torch.int64, non_blocking=True)
        dst = dst_ids.to(self.device, torch.int64, non_blocking=True)
        for dev in self.devs:
            dev.index_copy_(0, dst, dev.index_select(0, src))
