"""``unpack_whole``: ``msgpack.unpackb`` of a small payload, once it is known whole.

``unpackb`` allocates a container's item slots when it reads the container's header,
before the items: an array32 header (5 bytes) announcing as many items as the payload
has bytes, nested a thousand deep (msgpack's stack holds 1,024), made a payload of
60,000 bytes cost 80 MB (1,340x) before ``unpackb`` found the items missing
(tests/router/test_decode_expansion.py). ``Unpacker.skip`` walks the same value in C
and builds nothing; once it has read one whole value ending at the payload's last byte,
every item a header announced is there (a byte at least each), so what ``unpackb``
allocates is bounded by the bytes: at most ~73x them (a payload of empty maps, the
dearest item a byte can make), which is why larger payloads are read field by field
(``decode_large``).

Each thread keeps one ``Unpacker`` for the check (making one cost more than the check of
a small batch: ~1 us of the ~5 us a one-event batch takes to decode); one that raised,
or read a value ending before the payload's end, is dropped (its buffer holds the rest).
"""

from __future__ import annotations

import threading
from typing import Any

_KEPT = 1 << 16
"""The largest payload checked by a thread's kept ``Unpacker`` (larger: a new one)."""
_local = threading.local()


def unpack_whole(payload: bytes, **options: Any) -> Any:
    """``msgpack.unpackb(payload, **options)`` if ``payload`` is one whole msgpack value
    and nothing after it. Raises ValueError for trailing bytes, and msgpack's errors for
    a payload cut short or not msgpack (before anything is built)."""
    import msgpack

    u = getattr(_local, "unpacker", None) if len(payload) <= _KEPT else None
    if u is None:
        u = msgpack.Unpacker(max_buffer_size=max(_KEPT, len(payload)))
    start = u.tell()
    try:
        u.feed(payload)
        u.skip()
        left = len(payload) - u.tell() + start
    except BaseException:
        _local.unpacker = None  # (its buffer holds the rest of the payload)
        raise
    if left or len(payload) > _KEPT:
        _local.unpacker = None
        if left:
            raise ValueError(f"{left} bytes after the msgpack value")
    else:
        _local.unpacker = u
    return msgpack.unpackb(payload, **options)
