"""Shape checks that keep the kernels' int32 arithmetic inside int32.

The kernels widen block and token indices to int64 (a cache or q of more than 2^31
elements is fine) but keep offsets inside one block or token, and key positions, in
int32: it keeps the key loop's integer work small. These checks read only shapes and
strides, so a call whose int32 arithmetic could wrap raises before any launch instead of
reading outside its tensors (found by a slot-major cache view, which read out of bounds,
and by ``window_size=(-1, 2**31 - 1)``, which wrapped ``pos + right`` and attended no key).
"""

from __future__ import annotations

import torch

from .errors import ShapeError, UnsupportedError

__all__ = ["WINDOW_CAP", "check_int32_reach", "check_window_reach"]

# The kernels do position arithmetic in int32 (pos + right, pos - left, in every masked
# tile): a window side wider than this is clamped to it, and a windowed call must keep
# capacity + total_q + window below 2^31 (checked on shapes, in check_attention).
WINDOW_CAP = 2**30


def check_int32_reach(name: str, t: torch.Tensor, dims: tuple[int, ...], unit: str) -> None:
    """The offsets of ``t`` along ``dims`` (those the kernels multiply in int32: the slot,
    head and dim inside one block, the head and dim inside one token) stay below 2^31.

    The block and token indices are widened to int64 in the kernels; these are not, to
    keep the key loop's integer work small. Only a layout whose ``dims`` are strided
    wider than the block or token (a slot-major cache viewed as block-major) gets here.

    Raises:
        ShapeError: naming the tensor, its strides and the reach.
    """
    reach = sum((t.shape[i] - 1) * abs(t.stride(i)) for i in dims)
    if reach >= 2**31:
        raise ShapeError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()}: offsets inside one {unit} reach "
            f"{reach} elements; the kernels compute them in int32 (below 2^31), so use a layout whose "
            f"{unit} is compact (the block/token dimension may have any stride)"
        )


def check_window_reach(left: int, right: int, capacity: int, total_q: int) -> None:
    """A window's position arithmetic fits int32: query positions lie in
    ``[-total_q, capacity)`` and key positions in ``[0, capacity)``, so ``pos + right``
    and ``pos - left`` stay inside int32 when ``capacity + total_q + width < 2^31``.

    Raises:
        UnsupportedError: a window side > 0 with a block table and q too large for it.
    """
    width = max(left, right)
    if width > 0 and capacity + total_q + width >= 2**31:
        raise UnsupportedError(
            f"window_size ({left}, {right}) (sides clamped to {WINDOW_CAP}) with a block-table row of "
            f"{capacity} keys and {total_q} query rows: capacity + total_q + window must stay below 2^31 "
            "(the kernels' position arithmetic is int32)"
        )
