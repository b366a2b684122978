"""The checked caches of one block transfer and the copies over them (``transfer.py`` holds
the public calls and their contracts).

Copies, per cache pair, through a contiguous staging tensor ``[n, *slot]``:

    offload : staged = device[ids] (one indexed gather)  -> host[run] = staged[run] (one DMA per run)
    load    : staged[run] = host[run] (one DMA per run)   -> device[ids] = staged (one indexed scatter)
    copy    : device[dst] = device[origin(src)] (gather, then scatter), where origin(src) is
              the block whose content a copy in order would read: an earlier copy's
              destination stands for that copy's origin (a fork of a fork: 0 -> 1, 1 -> 2
              puts block 0's content in 2)

A run is a stretch of consecutive slot ids: contiguous in a slot-major host cache. Every
cache is viewed as integers of its element size first: the copies move bits, so every
cache dtype (fp8 included) takes the same copies, and none can fail on a dtype after an
earlier one of the same call has written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .errors import ArgumentTypeError, BlockIdError, DeviceError, DtypeError, ShapeError, UnsupportedError
from .overlap import check_apart
from .validation import CACHE_DTYPES, SLOT_DTYPES

__all__ = ["TransferPlan", "as_bits", "check_caches", "slot_shape", "transfer_stream"]

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def transfer_stream(device: torch.device | str) -> torch.cuda.Stream:
    """The side stream of ``device`` (a CUDA device) used when no ``stream`` is given;
    created on first use, one per device."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch: untyped
    return _STREAMS[device]


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` viewed as the integer dtype of its element size (same shape and strides)."""
    return cache.view(_BITS[cache.element_size()])


def slot_shape(cache: torch.Tensor, block_dim: int) -> tuple[int, ...]:
    return tuple(s for d, s in enumerate(cache.shape) if d != block_dim)


def check_caches(name: str, caches: object, block_dim: int) -> None:
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


class TransferPlan:
    """Checked caches of one call, and the copies over them. Raises as ``offload_blocks``
    (``transfer.py``) for the caches; ``check_ids`` for the ids."""

    def __init__(self, device_caches: Sequence[torch.Tensor], host_caches: Sequence[torch.Tensor] | None,
                 block_dim: int, stream: torch.cuda.Stream | None) -> None:
        check_caches("device_caches", device_caches, block_dim)
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
            check_caches("host_caches", host_caches, 0)
            if len(host_caches) != len(device_caches):
                raise ShapeError(f"{len(device_caches)} device caches but {len(host_caches)} host caches")
            self.num_slots = host_caches[0].shape[0]
            for d, h in zip(device_caches, host_caches, strict=True):
                want = (self.num_slots, *slot_shape(d, block_dim))
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
        # Views of the bytes: [num_blocks, ...] as an integer dtype of the element's size, so
        # every copy moves bits (no kernel per dtype: CPU index_copy_ has none for fp8).
        self.devs = [as_bits(c.movedim(block_dim, 0)) for c in device_caches]
        self.hosts = [as_bits(h) for h in host_caches or ()]
        self.stream = stream
        self._caches = {**{f"device_caches[{i}]": c for i, c in enumerate(device_caches)},
                        **{f"host_caches[{i}]": h for i, h in enumerate(host_caches or ())}}

    def check_writes(self, call: str, host: bool, device: bool, ids: dict[str, torch.Tensor]) -> None:
        """Raise ShapeError when a cache this call writes (the host caches when ``host``,
        the device caches when ``device``) has two blocks at one address (an expanded
        view) or shares memory with another cache or ``ids``: K and V as one tensor
        would take both copies, the second reading what the first wrote. Caches only
        read may share memory."""
        kinds = ("host_caches",) * host + ("device_caches",) * device
        written = {n: c for n, c in self._caches.items() if n.startswith(kinds)}
        read: dict[str, torch.Tensor | None] = {n: c for n, c in self._caches.items() if n not in written}
        check_apart(call, written, {**read, **ids})

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
        if dst.unique().numel() != dst.numel():  # type: ignore[no-untyped-call]  # torch: untyped
            raise BlockIdError(f"{dst_name} names a destination twice: {dst.tolist()}")

    def run(self, work: Callable[[], None]) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            work()
            return None
        stream = self.stream or transfer_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward passes queued so far
        with torch.cuda.stream(stream):
            work()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: untyped
            event.record(stream)
        return event

    def _runs(self, host_ids: torch.Tensor, device_ids: torch.Tensor
              ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The device ids in the order that sorts ``host_ids`` (on the device), and the
        runs of consecutive slots in that order as ``(first position, end, first slot)``."""
        slots, order = host_ids.to(torch.int64).sort()
        values = slots.tolist()
        runs, start = [], 0
        for i in range(1, len(values) + 1):
            if i == len(values) or values[i] != values[i - 1] + 1:
                runs.append((start, i, values[start]))
                start = i
        return device_ids.to(torch.int64)[order].to(self.device, non_blocking=True), runs

    def offload(self, device_ids: torch.Tensor, host_ids: torch.Tensor) -> None:
        if host_ids.numel():
            src, runs = self._runs(host_ids, device_ids)
            for dev, host in zip(self.devs, self.hosts, strict=True):
                staged = dev.index_select(0, src)  # [n, ...] contiguous, in slot order
                for a, b, slot in runs:
                    host[slot:slot + b - a].copy_(staged[a:b], non_blocking=True)

    def load(self, host_ids: torch.Tensor, device_ids: torch.Tensor) -> None:
        if host_ids.numel():
            dst, runs = self._runs(host_ids, device_ids)
            for dev, host in zip(self.devs, self.hosts, strict=True):
                staged = torch.empty((len(dst), *dev.shape[1:]), dtype=dev.dtype, device=self.device)
                for a, b, slot in runs:
                    staged[a:b].copy_(host[slot:slot + b - a], non_blocking=True)
                dev.index_copy_(0, dst, staged)

    def copy(self, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        if not src_ids.numel():
            return
        # In order, copy i reads its source after every earlier copy into it: map each
        # source to the block whose content it holds then, so that one gather of the
        # contents before any write (then one scatter) does what the copies in order do.
        origin: dict[int, int] = {}
        sources = []
        for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
            sources.append(origin.get(s, s))
            origin[d] = sources[-1]
        src = torch.tensor(sources, dtype=torch.int64).to(self.device, non_blocking=True)
        dst = dst_ids.to(self.device, torch.int64, non_blocking=True)
        for dev in self.devs:
            dev.index_copy_(0, dst, dev.index_select(0, src))
