"""A stored block's value, and the check that decides whether it serves a request.

    value = head | payload length: u64 | checksum: xxh3-128 of payload | payload
    head  = b"PKV" version:u8 | layout digest:16 | block_size:u32
            | len:u16 parent chain hash | len:u32 token bytes | len:u32 extra-key bytes

(little-endian). The head holds everything the content check needs: a value is accepted
only when its head equals the one the request expects byte for byte (same format, model
and KV layout, block size, parent, tokens and extra keys), its length is exact and its
payload matches the checksum. So a key collision, a value written by another model or
layout, a truncated or corrupted value, is a miss, never wrong KV. The checksum catches
corruption, not forgery: whoever may write to the store may write any KV (security.md).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ..errors import ConfigError, is_utf8

MAGIC = b"PKV\x01"
_HEAD = struct.Struct("<4s16sIH")
_LENS = struct.Struct("<II")
_TAIL = struct.Struct("<Q16s")


@dataclass(frozen=True, slots=True)
class StoreLayout:
    """What a block's KV bytes are: ``model`` names the model and the cache layout
    (weights, layers, KV heads, head size, NHD...; any text that changes when the KV
    would), ``dtype`` the element type, ``block_bytes`` the KV payload of one block for
    all layers, K and V (e.g. 2 x layers x block_size x kv_heads x head_dim x itemsize).
    Raises ConfigError for an empty name or dtype, one holding a NUL (the digest's
    separator: ``("m\\0f16", "x")`` would name the layout ``("m", "f16\\0x")`` names) or
    not encodable as UTF-8, or a size that is not a positive int."""

    model: str
    dtype: str
    block_bytes: int

    def __post_init__(self) -> None:
        for name in ("model", "dtype"):
            value = getattr(self, name)
            if type(value) is not str or not value or "\0" in value or not is_utf8(value):
                raise ConfigError(f"StoreLayout.{name} must be a non-empty UTF-8 str without "
                                  f"a NUL, got {value!r}")
        b = self.block_bytes
        if type(b) is not int or b <= 0:
            raise ConfigError(f"StoreLayout.block_bytes must be a positive int, got {b!r}")

    def digest(self) -> bytes:
        """16 bytes naming this layout (in every value's head and in the key namespace)."""
        text = f"{self.model}\0{self.dtype}\0{self.block_bytes}".encode()
        return hashlib.sha256(b"prefixkv-layout\0" + text).digest()[:16]


def block_head(layout: bytes, block_size: int, parent: bytes, tokens: bytes, extra: bytes) -> bytes:
    """The head of a block's value (see the module docstring); ``layout``: a layout digest."""
    return (_HEAD.pack(MAGIC, layout, block_size, len(parent)) + parent
            + _LENS.pack(len(tokens), len(extra)) + tokens + extra)


def payload_bytes(payload: object) -> memoryview:
    """``payload`` (bytes, or any C-contiguous buffer: a memoryview of float32 counts
    items, not bytes, in ``len``) as a flat view of its bytes. Raises ConfigError for
    anything else."""
    try:
        view = memoryview(payload)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"a payload must be bytes or a buffer, got {type(payload).__name__}") from None
    if not view.c_contiguous:
        raise ConfigError("a payload must be a C-contiguous buffer (copy a strided view first)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def encode_value(head: bytes, payload: bytes | memoryview) -> bytes:
    """The value stored for a block: ``head`` (``StorePut.head``) and its KV ``payload``
    (bytes or a C-contiguous buffer, counted in bytes). Raises ConfigError for a head that
    is not bytes or a payload that is not such a buffer."""
    if type(head) is not bytes:
        raise ConfigError(f"a value's head must be bytes, got {type(head).__name__}")
    view = payload_bytes(payload)
    return b"".join((head, _TAIL.pack(view.nbytes, xxhash.xxh3_128_digest(view)), view))


def decode_value(value: object, head: bytes, payload_len: int) -> bytes | None:
    """The payload of ``value`` if it is exactly a value for ``head`` with a
    ``payload_len``-byte payload that matches its checksum; None otherwise (any other
    ``value``, ``None`` and non-bytes included). Raises ConfigError for a ``head`` that
    is not bytes or a ``payload_len`` that is not an int >= 0 (the caller's, not the
    store's)."""
    if not isinstance(head, (bytes, bytearray)) or type(payload_len) is not int or payload_len < 0:
        raise ConfigError(f"decode_value takes a bytes head and an int payload_len >= 0, got "
                          f"{type(head).__name__}, {payload_len!r}"[:200])
    if type(value) is not bytes or len(value) != len(head) + _TAIL.size + payload_len:
        return None
    if not value.startswith(head):
        return None
    n, checksum = _TAIL.unpack_from(value, len(head))
    payload = value[len(head) + _TAIL.size:]
    if n != payload_len or xxhash.xxh3_128_digest(payload) != checksum:
        return None
    return payload


def value_checked(front: bytearray, head: bytes, payload: Sequence[memoryview],
                  payload_len: int) -> bool:
    """Whether a value read in parts, ``front`` (its head and tail: ``len(head)`` plus
    the tail's bytes) and ``payload`` (views its payload was read into, in order), is
    exactly a value for ``head`` with a ``payload_len``-byte payload that matches its
    checksum (``decode_value`` for a value read in place: no copy)."""
    if front[:len(head)] != head:
        return False
    n, checksum = _TAIL.unpack_from(front, len(head))
    if n != payload_len:
        return False
    h = xxhash.xxh3_128()
    for view in payload:
        h.update(view)
    return bool(h.digest() == checksum)
