"""``BlockCopier``: whole blocks between vLLM's paged KV caches and payload bytes.

vLLM 0.33 hands a connector one tensor per attention layer, the layer's view of the
shared KV allocation in its logical shape ``[B, H, N, C]``: blocks, KV heads, tokens of
a block, and the content of one token of one head (its K then its V, ``C`` elements).
The physical order behind that view is the engine's ``KVCacheLayout`` (``LBNHC`` is
vLLM's NHD, ``LBHNC`` its HND, ...): the view's strides say it, and this module reads
only the view. A block's payload is the logical bytes of every layer, in the copier's
layer order::

    payload(b) = layer_0[b] | layer_1[b] | ... ,  layer_l[b] = [H, N, C] row-major bytes

so a replica in HND and one in NHD store and read the same bytes for the same KV.
Reads gather a batch of blocks with one ``index_select`` per layer (then one copy to the
CPU); writes scatter them with one ``index_copy_`` per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...errors import ConfigError


class BlockCopier:
    """Blocks of the caches ``kv_caches`` (layer name -> ``[B, H, N, C]`` view; the
    payload takes layers in sorted name order). Raises ConfigError when there are no
    caches, one is not 4-d, or they disagree on the number of blocks or the device."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if not kv_caches:
            raise ConfigError("no KV caches were registered")
        self.names = sorted(kv_caches)
        self.layers = [kv_caches[n] for n in self.names]
        first = self.layers[0]
        for name, t in zip(self.names, self.layers, strict=True):
            if t.dim() != 4 or t.shape[0] != first.shape[0] or t.device != first.device:
                raise ConfigError(f"KV cache {name!r} of shape {tuple(t.shape)} on {t.device}: "
                                  f"expected [B, H, N, C] views with B={first.shape[0]} on "
                                  f"{first.device}")
        self.num_blocks = int(first.shape[0])
        self._sizes = [t[0].numel() * t.element_size() for t in self.layers]
        self.block_bytes = sum(self._sizes)

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``block_ids`` as an index tensor on the caches' device. Raises ConfigError
        for an id outside ``[0, num_blocks)``."""
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ConfigError(f"block ids {bad[:4]} outside [0, {self.num_blocks})")
        return torch.tensor(list(block_ids), dtype=torch.int64, device=self.layers[0].device)

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        """The payload of each block (waits for the copy to the CPU)."""
        rows, ready = self.read_rows(block_ids)
        if ready is not None:
            ready.synchronize()
        return [row.tobytes() for row in rows.numpy()]

    def read_rows(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """The payloads of the blocks as host rows ``[n, block_bytes]`` uint8, and the
        CUDA event after which they are there (None on the CPU: at once). The blocks are
        gathered now, in stream order (one ``index_select`` per layer into a new device
        tensor), so a later kernel may overwrite them; the copy to pinned host memory
        runs without blocking the caller. Call it once the step's forward pass wrote them."""
        n = len(block_ids)
        if not n:
            return torch.empty((0, self.block_bytes), dtype=torch.uint8), None
        ids = self._ids(block_ids)
        rows = torch.cat([t.index_select(0, ids).reshape(n, -1).view(torch.uint8)
                          for t in self.layers], dim=1)
        if not rows.is_cuda:
            return rows, None
        host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return host, ready

    def write(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        """Write ``payloads[i]`` into block ``block_ids[i]`` of every layer. Raises
        ConfigError, before writing anything, for a payload of another size or a count
        that differs from the ids'."""
        if len(payloads) != len(block_ids):
            raise ConfigError(f"{len(payloads)} payloads for {len(block_ids)} blocks")
        wrong = [len(p) for p in payloads if len(p) != self.block_bytes]
        if wrong:
            raise ConfigError(f"payloads of {wrong[0]} bytes for blocks of {self.block_bytes}")
        if block_ids:
            raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
            self.write_rows(block_ids, raw.view(len(block_ids), self.block_bytes))

    def write_rows(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Write row ``i`` of ``rows`` (``[n, block_bytes]`` uint8, host or device: a
        staging buffer the payloads were read into) into block ``block_ids[i]`` of every
        layer. Raises ConfigError, before writing anything, for rows of another shape."""
        if tuple(rows.shape) != (len(block_ids), self.block_bytes) or rows.dtype != torch.uint8:
            raise ConfigError(f"rows of shape {tuple(rows.shape)} and {rows.dtype} for "
                              f"{len(block_ids)} blocks of {self.block_bytes} bytes")
        if not block_ids:
            return
        ids = self._ids(block_ids)
        rows = rows.to(self.layers[0].device, non_blocking=True)
        offset = 0
        for t, size in zip(self.layers, self._sizes, strict=True):
            part = rows[:, offset:offset + size].contiguous().view(t.dtype)
            t.index_copy_(0, ids, part.view(len(block_ids), *t.shape[1:]))
            offset += size
