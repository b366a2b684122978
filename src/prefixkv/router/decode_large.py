"""A large KVEventBatch payload read field by field, building only what the router reads.

``msgpack.unpackb`` builds every container and element of a payload before the decoder
can check its shape: a frame of empty arrays or maps (one byte each) cost 65x and 73x its
bytes at the reader's peak, and a legal event's token ids, which the router never reads,
13.6x (tests/router/test_decode_expansion.py). For a payload of ``STREAM_FROM`` bytes or
more, ``decode_batch`` reads it here instead: the batch's and each event's headers, the
fields the router reads (as ``decode._event`` gets them from ``unpackb``), each block
hash as it comes, and nothing else: an unread field (``token_ids``, ``extra_keys``, a
replica's own) is skipped unbuilt, and a container where a scalar belongs, or a hash that
is not one, ends the read at once (DecodeError), unbuilt. What is built is then at most
the block hashes' list (a uint16 hash: 36 bytes of int and pointer for its 3 bytes).

The answer is ``unpackb``'s path's for every payload that is msgpack throughout, but two
kinds: one malformed only inside a field the router does not read (an unhashable map
key, bad UTF-8) is read here, where ``unpackb`` refused it whole; and a
``kv_cache_spec_kind`` longer than ``MAX_SCALAR`` bytes is refused here (not built),
where ``unpackb``'s path kept it. Messages name the field as the other path's do,
without the value (not built).
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

STREAM_FROM = 1 << 13
"""Payloads of this many bytes or more are read here; below it ``unpackb`` is as fast or
faster (a batch of one event of a few blocks: 1.2-1.5x) and, once the payload is known
whole (whole.py), builds at most ~73 x 8 KiB, 0.6 MB (benchmarks/results/fleet-r18.md)."""

# Positional layout of the pre-0.2x array encoding: tag first, then the fields in the
# structs' declaration order (fields added later come last; trailing defaults omitted).
ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                    "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}

# the fields ``decode._event`` reads, by name; an array event's by position (tag first)
READ = frozenset(("type", "block_hashes", "parent_block_hash", "medium", "group_idx",
                  "block_size", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"))


class Unbuilt:
    """A container met where a scalar belongs: not built (its place in ``raw`` holds this,
    which no check of ``decode._event`` takes)."""

    def __repr__(self) -> str:
        return "<a msgpack container, not read>"


UNBUILT = Unbuilt()


def _is_array(payload: bytes, at: int) -> bool:
    b = payload[at]
    return 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)


def _is_map(payload: bytes, at: int) -> bool:
    b = payload[at]
    return 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)


LONG = Unbuilt()
"""A str, bin or ext value past ``MAX_SCALAR`` bytes met where the router reads one: not
built (every such field it reads is shorter: a hash, a medium, a kind, a tag)."""
MAX_SCALAR = 4096
SHORT = bytes(1 if b < 0x80 or 0xA0 <= b <= 0xC4 and b != 0xC1 or 0xCA <= b <= 0xD3
              or b == 0xD9 or b >= 0xE0 else 0 for b in range(256))
"""Type bytes of the scalars read at once: at most 255 bytes of str or bin, ints,
floats, nil, bools (no container, no ext, nothing longer)."""
_LENGTH = {0xC5: 2, 0xC6: 4, 0xDA: 2, 0xDB: 4, 0xC8: 2, 0xC9: 4}  # type byte: length bytes


def _scalar(u: Any, payload: bytes, longest: int | None = MAX_SCALAR) -> object:
    """The next value if a scalar of at most ``longest`` bytes (None: any); a container is
    skipped and given as ``UNBUILT``, a longer scalar as ``LONG``."""
    at = u.tell()
    b = payload[at]
    if 0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF:
        u.skip()
        return UNBUILT
    width = _LENGTH.get(b) if longest is not None else None
    if width is not None and int.from_bytes(payload[at + 1:at + 1 + width], "big") > longest:  # type: ignore[operator]
        u.skip()
        return LONG
    return u.unpack()


def read_batch(payload: bytes, convert: Any, hash_ok: Any,
               error: type[Exception]) -> tuple[object, list[Any], object]:
    """``(ts, events, rank)`` of a large payload, each event ``convert(raw)`` as soon as
    it is read (``raw``: a dict of the fields the router reads, as ``unpackb`` gives them
    but for ``UNBUILT`` in a container's place, or an array or ``UNBUILT`` for an event
    that is neither a map nor an array of a known tag), so that the first bad one ends
    the read. ``hash_ok(value)``: whether a block hash is one (the first that is not
    ends that field's read: the field is given as ``[UNBUILT]``). Raises ``error`` for a
    payload that is not a KVEventBatch's shape or not msgpack (trailing bytes, a map key
    that is a container), and msgpack's errors (the caller makes them DecodeError)."""
    import msgpack

    # (one copy of the payload, the buffer: a file over it made the buffer grow to twice
    # the largest value skipped)
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(payload))
    u.feed(payload)
    if not _is_array(payload, 0):
        raise error("a KVEventBatch is [ts, events, dp_rank?], got another value")
    n = u.read_array_header()
    if n not in (2, 3):
        raise error(f"a KVEventBatch is [ts, events, dp_rank?], got an array of {n}")
    ts = _scalar(u, payload)
    if not _is_array(payload, u.tell()):
        raise error("a KVEventBatch is [ts, events, dp_rank?], its events not an array")
    events = [convert(_event(u, payload, hash_ok, error)) for _ in range(u.read_array_header())]
    rank = _scalar(u, payload) if n == 3 else None
    if u.tell() != len(payload):
        raise error(f"not msgpack: {len(payload) - u.tell()} bytes after the batch")
    return ts, events, rank


def _event(u: Any, payload: bytes, hash_ok: Any, error: type[Exception]) -> object:
    at = u.tell()
    raw: dict[object, object] = {}
    if _is_map(payload, at):
        tell, unpack, skip = u.tell, u.unpack, u.skip
        for _ in range(u.read_map_header()):  # (a short scalar read at once: ``SHORT``)
            key = unpack() if SHORT[payload[tell()]] else _scalar(u, payload)
            if key is UNBUILT:  # (``unpackb``: an unhashable key, not msgpack it can build)
                raise error("not msgpack: a map key that is an array or a map")  # (a LONG
            # key is none of those read: its value is skipped)
            if key == "block_hashes":
                raw[key] = _hashes(u, payload, hash_ok)
            elif key in READ:
                raw[key] = unpack() if SHORT[payload[tell()]] else _scalar(u, payload)
            else:
                skip()
        return raw
    if not _is_array(payload, at):
        return _scalar(u, payload)
    n = u.read_array_header()
    tag = _scalar(u, payload) if n else None
    if not isinstance(tag, str) or tag not in ARRAY_FIELDS:  # (refused: ``decode._event``)
        for _ in range(n - 1):
            u.skip()
        return [tag]
    fields = ARRAY_FIELDS[tag]
    raw["type"] = tag
    for i in range(n - 1):
        name = fields[i] if i < len(fields) else None
        if name == "block_hashes":
            raw[name] = _hashes(u, payload, hash_ok)
        elif name in READ:
            raw[name] = _scalar(u, payload)
        else:
            u.skip()
    return raw


def _hashes(u: Any, payload: bytes, hash_ok: Any) -> object:
    """A ``block_hashes`` field: its hashes; a field that is not an array, as ``_scalar``.
    Items all uint64 or all bin8 of one length are read in C-level passes over their
    bytes (``_uniform``); others one by one, the rest skipped after the first that is not
    a hash (given as ``[UNBUILT]``, which no event takes)."""
    at = u.tell()
    if not _is_array(payload, at):
        return _scalar(u, payload)
    b = payload[at]
    first = at + (1 if b <= 0x9F else 3 if b == 0xDC else 5)
    same = _uniform(payload, first, b & 0x0F if b <= 0x9F else int.from_bytes(
        payload[at + 1:first], "big"))
    if same is not None:
        u.skip()  # (the field, in C)
        return same
    n = u.read_array_header()
    out = []
    tell, unpack = u.tell, u.unpack
    for i in range(n):
        b = payload[tell()]  # (an int or a bin8 digest, read at once: thousands of hashes)
        h = unpack() if b < 0x80 or 0xCC <= b <= 0xD3 or b == 0xC4 else _scalar(u, payload)
        if not hash_ok(h):  # (``UNBUILT``, ``LONG``: read past already)
            for _ in range(n - i - 1):
                u.skip()
            return [UNBUILT]
        out.append(h)
    return out


def _uniform(payload: bytes, first: int, n: int) -> list[Any] | None:
    """The ``n`` items from ``payload[first]`` on when all are uint64 (``0xcf`` and 8
    bytes: every 64-bit hash from 2**32 on) or all bin8 of one length of at most 64 (a
    digest); None otherwise (the stride's type bytes say so: item i starts at ``first +
    i * step`` when every item before it had the same length)."""
    if n == 0 or first + 2 > len(payload):
        return None
    step = 9 if payload[first] == 0xCF else payload[first + 1] + 2 if payload[first] == 0xC4 \
        else 0
    end = first + step * n
    if not 2 <= step <= 66 or end > len(payload) or payload[first:end:step].count(
            payload[first]) != n:
        return None
    if step == 9:
        data = bytearray(payload[first:end])
        del data[::9]
        ints = array("Q", data)
        if sys.byteorder == "little":
            ints.byteswap()
        return ints.tolist()
    if payload[first + 1:end:step].count(step - 2) != n:
        return None
    return [payload[i:i + step - 2] for i in range(first + 2, end, step)]


ANSWER = frozenset(("publisher_epoch", "next_seq", "replayed_batches", "snapshot"))


def read_answer(payload: bytes) -> object:
    """A large replay answer (``replay_client``) as ``unpackb`` gives it, but for the
    fields ``replay_client._check`` reads alone (the rest skipped), ``UNBUILT`` in a
    container's place where a scalar belongs, and ``replayed_batches`` read up to its
    first item that is not a ``[scalar, scalar]`` pair (given as ``UNBUILT``, the rest
    skipped): a frame of empty pairs cost 64x its bytes, unpacked whole. ``UNBUILT`` for
    an answer that is not a map. Raises msgpack's errors, and ValueError for trailing
    bytes or a map key that is not a str or bytes (``unpackb``'s strict keys)."""
    import msgpack

    u = msgpack.Unpacker(raw=False, max_buffer_size=len(payload))
    u.feed(payload)
    if not _is_map(payload, 0):
        u.skip()
        out: object = UNBUILT
    else:
        answer: dict[object, object] = {}
        for _ in range(u.read_map_header()):
            key = u.unpack() if not (0x80 <= payload[u.tell()] <= 0x9F
                                     or 0xDC <= payload[u.tell()] <= 0xDF) else UNBUILT
            if not isinstance(key, (str, bytes)):
                raise ValueError("a replay answer's key is not a str or bytes")
            if key == "replayed_batches" and _is_array(payload, u.tell()):
                answer[key] = _pairs(u, payload)
            elif key in ANSWER:
                answer[key] = _scalar(u, payload, None)
            else:
                u.skip()
        out = answer
    if u.tell() != len(payload):
        raise ValueError(f"{len(payload) - u.tell()} bytes after the replay answer")
    return out


def _pairs(u: Any, payload: bytes) -> list[object]:
    n = u.read_array_header()
    out: list[object] = []
    for i in range(n):
        k = u.read_array_header() if _is_array(payload, u.tell()) else -1
        if k != 2:  # (not a pair: its elements, or it, and the rest, unread)
            for _ in range(n - i - 1 + (k < 0) + max(k, 0)):
                u.skip()
            out.append(UNBUILT)
            return out
        out.append([_scalar(u, payload, None), _scalar(u, payload, None)])
    return out
