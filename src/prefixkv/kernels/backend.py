"""Which backend a kernel call takes: the Triton kernels or the torch reference.

Decided per call from the tensors' device and the innermost :func:`use_backend` (a
context variable, so threads and tasks keep their own); nothing is probed at import
time, and Triton is imported only to ask whether its interpreter is on.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from .errors import ArgumentTypeError, BackendError, DeviceError

__all__ = ["BACKENDS", "use_backend", "resolve_backend"]

BACKENDS = ("auto", "triton", "torch")
"""Names accepted by ``backend=`` and :func:`use_backend`: ``"auto"`` (Triton on CUDA
tensors, the torch reference elsewhere), ``"triton"``, ``"torch"``."""
_default_backend: contextvars.ContextVar[str] = contextvars.ContextVar("prefixkv_kernels_backend",
                                                                       default="auto")


def _check_name(backend: str) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise BackendError(f"backend {backend!r} is not one of {BACKENDS}")
    return backend


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Within the ``with`` block, calls without ``backend=`` use ``backend``.

    Raises:
        BackendError: ``backend`` is not one of ``BACKENDS``.
    """
    token = _default_backend.set(_check_name(backend))
    try:
        yield
    finally:
        _default_backend.reset(token)


def _device(device: torch.device | str) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise ArgumentTypeError(f"device must be a torch.device or a str, got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise DeviceError(f"device {device!r} is not a device torch knows: {e}") from None


def resolve_backend(backend: str | None, device: torch.device | str) -> str:
    """The backend (``"triton"`` or ``"torch"``) a call on ``device`` takes.

    ``None`` means the innermost :func:`use_backend`, else ``"auto"``: Triton on CUDA
    tensors, the torch reference elsewhere. ``device`` is a ``torch.device`` or its name.

    Raises:
        BackendError: unknown name, or ``"triton"`` on CPU tensors without
            ``TRITON_INTERPRET=1`` (Triton cannot compile for the CPU).
        ArgumentTypeError: ``device`` is neither a ``torch.device`` nor a str.
        DeviceError: ``device`` is a str torch cannot parse.
    """
    device = _device(device)
    name = _check_name(_default_backend.get() if backend is None else backend)
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda":
        from .tiling import interpreting

        if not interpreting():
            raise BackendError(
                f"backend 'triton' needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 set before "
                "triton is imported; use backend='torch' on this device"
            )
    return name
