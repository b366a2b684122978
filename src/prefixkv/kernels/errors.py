"""Errors raised by the kernels package for caller mistakes.

Every error is a ``ValueError`` subclass raised before any tensor is written, and its
message carries the offending numbers and the valid choices. All but ``MetadataError``
come from shapes, dtypes, devices and Python values, so raising them never reads a
tensor; ``MetadataError`` comes only from checked mode (``checked=True``), which does.
"""

from __future__ import annotations

from ..errors import PrefixKVError

__all__ = [
    "KernelInputError",
    "ShapeError",
    "DtypeError",
    "DeviceError",
    "UnsupportedError",
    "BackendError",
    "BatchError",
    "MetadataError",
    "TensorValueError",
    "ArgumentTypeError",
    "BlockIdError",
]


class KernelInputError(PrefixKVError):
    """Base class of every caller mistake detected by :mod:`prefixkv.kernels`; a
    ``PrefixKVError`` (and so a ``ValueError``) like the core's, so one ``except`` catches
    every caller mistake of the library."""


class ShapeError(KernelInputError):
    """A tensor has the wrong rank, size or an unusable stride."""


class DtypeError(KernelInputError):
    """A tensor has a dtype the kernel does not accept, or dtypes disagree."""


class DeviceError(KernelInputError):
    """Tensors of one call live on different devices."""


class UnsupportedError(KernelInputError):
    """A scalar option is out of range or of the wrong type (head_dim, window, softcap,
    scale, a flag that is not a bool, ...)."""


class BackendError(KernelInputError):
    """An unknown backend was named, or the named backend cannot run these tensors."""


class BatchError(KernelInputError):
    """Per-request block ids and lengths that cannot describe a batch (see ``batch.py``)."""


class MetadataError(KernelInputError):
    """Checked mode only: a value inside a metadata tensor (a slot, a block id, a length,
    a ``cu_seqlens_q`` entry) lies outside what the other tensors allow. The message names
    the request (or token) and the value."""


class TensorValueError(MetadataError):
    """Checked mode only: a value inside ``k_scale``/``v_scale`` or ``sinks`` that has no
    meaning (a negative, NaN or infinite scale; a NaN or ``+inf`` sink). Without checked
    mode such values get the defined answer documented in ``fp8.py`` and on the sinks
    argument; a zero scale and a ``-inf`` sink are valid."""


class ArgumentTypeError(KernelInputError, TypeError):
    """An argument is not of an accepted Python type (a list where a tensor is expected,
    a device that is neither a ``torch.device`` nor a str); also a ``TypeError``."""


class BlockIdError(KernelInputError):
    """A block transfer (``transfer.py``) names a block or host slot outside its cache, or
    the same destination twice. Transfer ids live on the CPU, so this is checked on every
    call without waiting for the device."""
