"""The checks every kernel entry point starts with, on any argument: a tensor is a
``torch.Tensor``, a flag a ``bool``, a number a real (not a bool), and a tensor on the
device of the others. The per-call checks built on them are in ``validation.py``.
"""

from __future__ import annotations

import torch

from .errors import ArgumentTypeError, DeviceError, UnsupportedError

__all__ = ["check_flags", "check_tensors"]


def check_tensors(**tensors: object) -> None:
    """Each keyword argument is a ``torch.Tensor``.

    Raises:
        ArgumentTypeError: naming the first that is not.
    """
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_flags(**flags: object) -> None:
    """Each keyword argument is a ``bool`` (not merely truthy: ``causal="no"`` is a mistake).

    Raises:
        UnsupportedError: naming the first that is not.
    """
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise UnsupportedError(f"{name} must be True or False, got {value!r}")


def _real(value: object) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise DeviceError(f"{name} is on {t.device}, expected {device} like the others")
