"""Errors raised by the kernels package for caller mistakes.

Every error is a ``ValueError`` subclass raised before any tensor is written, and its
message carries the offending numbers and the valid choices.
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
    """A scalar option is out of range (head_dim, window, softcap, scale, ...)."""


class BackendError(KernelInputError):
    """An unknown backend was named, or the named backend cannot run these tensors."""


class BatchError(KernelInputError):
    """Per-request block ids and lengths that cannot describe a batch (see ``batch.py``)."""
