"""Decode a vLLM ``KVEventBatch`` payload, as docs/events.md describes it, into the few
facts a router needs. Accepts vLLM 0.33's map-encoded events and the positional
(array) events of older vLLM releases in the same batch.

Every field the decoder reads is type-checked (and a hash's width and a medium name's
length bounded: the index keeps them per block); any payload that does not fit raises
DecodeError and nothing else (a subscriber counts it and goes on). Fields it does not
read (``token_ids``, ``lora_*``, ``extra_keys``, vLLM's newer optional fields) are not
checked: a replica's extension there must not cost the router its batches. A payload
of ``decode_large.STREAM_FROM`` bytes (8 KiB) or more is read field by field, building
only those fields (decode_large.py): unpacked whole, a frame of empty containers cost
~70x its bytes. A smaller one is checked whole before ``unpackb`` (whole.py: nested
headers announcing items that are not there cost ``unpackb`` a thousand times the bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PrefixKVError
from .decode_large import ARRAY_FIELDS as _ARRAY_FIELDS
from .decode_large import STREAM_FROM, read_batch
from .show import show as _show
from .whole import unpack_whole

Hash = int | bytes
_UINT64 = 1 << 64
MAX_HASH_BYTES = 64
"""The widest bytes block hash decoded (a 512-bit digest; vLLM's and prefixkv's are 32
or 16 bytes). The index keeps each hash: a wider one would let a replica's blocks cost
the router any memory under its block cap (``InProcessIndex.max_per_replica``)."""
MAX_MEDIUM_CHARS = 64
"""The longest ``medium`` name decoded (engines send "GPU", "CPU", "cpu"); kept per
block like the hashes."""


class DecodeError(PrefixKVError):
    """A payload that is not a KVEventBatch (wrong shape, unknown event tag, bad field)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """``hashes`` became findable on ``medium``; ``parent`` precedes ``hashes[0]``.
    ``group``: the layer group (vLLM's ``group_idx``; None when the event has none),
    ``kind`` its ``kv_cache_spec_kind`` and ``window`` its sliding window, None when
    absent. ``block_size``: the replica's block size as the event states it (None when
    not given; 0 when unknown: vLLM 0.33's offloading connector announces a key it holds
    no metadata for so, without token ids); metadata, not compared."""

    hashes: tuple[Hash, ...]
    parent: Hash | None
    medium: str
    group: int | None = None
    kind: str | None = None
    window: int | None = None
    block_size: int | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Removed:
    """``hashes`` were evicted from ``medium`` in layer group ``group`` (None: the event
    names none)."""

    hashes: tuple[Hash, ...]
    medium: str
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """Everything the replica held is gone."""


RouterEvent = Stored | Removed | Cleared



def decode_batch(payload: bytes) -> tuple[float, list[RouterEvent], int | None]:
    """``(ts, events, data_parallel_rank)`` of one payload (rank None when omitted or
    nil). Raises DecodeError, and only DecodeError, for anything that is not a
    KVEventBatch: not msgpack, a batch that is not ``[number, array, int or nil?]``, an
    event that is neither a map nor an array tagged by a known event name, or a field
    the decoder reads holding another type (see the module doc), or a payload that is
    not bytes."""
    if not isinstance(payload, (bytes, bytearray)):
        raise DecodeError(f"a payload is bytes, got {type(payload).__name__}")
    if len(payload) >= STREAM_FROM:  # (read field by field: decode_large.py)
        try:
            ts, events, rank = read_batch(payload, _event, _is_hash, DecodeError)
        except DecodeError:
            raise
        except Exception as exc:  # msgpack raises several unrelated types
            raise DecodeError(f"not msgpack: {_show(exc)}") from None
        if not _is_number(ts):
            raise DecodeError(f"a KVEventBatch is [ts, events, dp_rank?], its ts {_show(ts)}")
        if rank is not None and not _is_int(rank):
            raise DecodeError(f"data_parallel_rank must be an int or nil, got {_show(rank)}")
        return float(ts), events, rank  # type: ignore[arg-type,return-value]
    try:  # (whole first: what unpackb allocates for headers is then bounded, whole.py)
        batch = unpack_whole(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"not msgpack: {_show(exc)}") from None
    if not isinstance(batch, list) or len(batch) not in (2, 3) or not isinstance(
            batch[1], list) or not _is_number(batch[0]):
        raise DecodeError(f"a KVEventBatch is [ts, events, dp_rank?], got {_show(batch)}")
    rank = batch[2] if len(batch) == 3 else None
    if rank is not None and not _is_int(rank):
        raise DecodeError(f"data_parallel_rank must be an int or nil, got {_show(rank)}")
    return float(batch[0]), [_event(e) for e in batch[1]], rank


def _event(raw: object) -> RouterEvent:
    """The event of a map or tagged array as msgpack gives it: a fast path for a map whose
    fields are all of their types (exact types: msgpack makes no subclasses), else
    ``_checked``, which raises DecodeError naming the field (or agrees)."""
    if raw.__class__ is dict:
        get = raw.get
        tag, hashes, medium, group = (get("type"), get("block_hashes"), get("medium"),
                                      get("group_idx"))
        if (tag == "BlockStored" or tag == "BlockRemoved") and hashes.__class__ is list and (
                medium is None or medium.__class__ is str and len(medium) <= MAX_MEDIUM_CHARS
        ) and (group is None or group.__class__ is int) and _all_hashes(hashes):
            if tag == "BlockRemoved":
                return Removed(tuple(hashes), medium or "GPU", group)
            parent, size = get("parent_block_hash"), get("block_size")
            kind, window = get("kv_cache_spec_kind"), get("kv_cache_spec_sliding_window")
            if (parent is None or _is_hash(parent)) and (
                    size is None or size.__class__ is int and size >= 0) and (
                    kind is None or kind.__class__ is str) and (
                    window is None or window.__class__ is int):
                return Stored(tuple(hashes), parent, medium or "GPU", group, kind, window, size)
    return _checked(raw)


def _checked(raw: object) -> RouterEvent:
    if isinstance(raw, list):
        tag = raw[0] if raw else None
        if not isinstance(tag, str) or tag not in _ARRAY_FIELDS:
            raise DecodeError(f"an array event starts with its type name, got {_show(raw)}")
        raw = {"type": tag, **dict(zip(_ARRAY_FIELDS[tag], raw[1:], strict=False))}
    if not isinstance(raw, dict):
        raise DecodeError(f"an event is a map or a tagged array, got {_show(raw)}")
    tag = raw.get("type")
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag not in ("BlockStored", "BlockRemoved"):
        raise DecodeError(f"unknown event type {_show(tag)}")
    hashes = raw.get("block_hashes")
    if not isinstance(hashes, list) or not _all_hashes(hashes):
        raise DecodeError(f"{tag}.block_hashes must be a list of uint64 or bytes of at "
                          f"most {MAX_HASH_BYTES}, "
                          f"got {_show(hashes)}")
    medium = _optional(raw, tag, "medium", str) or "GPU"  # nil: releases before media
    if len(medium) > MAX_MEDIUM_CHARS:  # type: ignore[arg-type]
        raise DecodeError(f"{tag}.medium must be at most {MAX_MEDIUM_CHARS} characters, "
                          f"got {_show(medium)}")
    group = _optional(raw, tag, "group_idx", int)
    if tag == "BlockRemoved":
        return Removed(tuple(hashes), medium, group)  # type: ignore[arg-type]
    parent = raw.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise DecodeError(f"BlockStored.parent_block_hash must be a hash or nil, "
                          f"got {_show(parent)}")
    block_size = _optional(raw, tag, "block_size", int)
    if block_size is not None and block_size < 0:  # type: ignore[operator]
        raise DecodeError(f"BlockStored.block_size must be >= 0, got {block_size}")
    return Stored(tuple(hashes), parent, medium, group,  # type: ignore[arg-type]
                  _optional(raw, tag, "kv_cache_spec_kind", str),  # type: ignore[arg-type]
                  _optional(raw, tag, "kv_cache_spec_sliding_window", int),  # type: ignore[arg-type]
                  block_size)  # type: ignore[arg-type]


def event_problem(event: RouterEvent) -> str | None:
    """What is wrong with a hand-built event's fields, as the decoder would have found it
    on the wire (None: nothing): ``hashes`` a tuple or list of hashes (a uint64 or bytes
    of at most ``MAX_HASH_BYTES``), ``medium`` a str of at most ``MAX_MEDIUM_CHARS``,
    ``group`` and ``window`` an int or None, ``kind`` a str or None, ``parent`` a hash
    or None, ``block_size`` an int >= 0 or None (bools are no ints)."""
    if isinstance(event, Cleared):
        return None
    name = type(event).__name__
    hashes = event.hashes
    if not isinstance(hashes, (tuple, list)) or not all(_is_hash(h) for h in hashes):
        return f"{name}.hashes must be a tuple of uint64 or bytes of at most {MAX_HASH_BYTES}"
    if not isinstance(event.medium, str) or len(event.medium) > MAX_MEDIUM_CHARS:
        return f"{name}.medium must be a str of at most {MAX_MEDIUM_CHARS} characters"
    if event.group is not None and not _is_int(event.group):
        return f"{name}.group must be an int or None"
    if isinstance(event, Removed):
        return None
    if event.parent is not None and not _is_hash(event.parent):
        return "Stored.parent must be a hash or None"
    if event.kind is not None and not isinstance(event.kind, str):
        return "Stored.kind must be a str or None"
    if event.window is not None and not _is_int(event.window):
        return "Stored.window must be an int or None"
    size = event.block_size
    if size is not None and not (_is_int(size) and size >= 0):
        return "Stored.block_size must be an int >= 0 or None"
    return None


def _optional(raw: dict[object, object], tag: str, key: str, kind: type) -> object:
    """``raw[key]``, None when absent or nil; DecodeError when of another type."""
    value = raw.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise DecodeError(f"{tag}.{key} must be {kind.__name__} or nil, got {_show(value)}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, float) or _is_int(value)


def _all_hashes(hashes: list[object]) -> bool:
    """Whether every item is a hash (``_is_hash``), in C-level passes for a list of ints
    alone or bytes alone (a bool's type is not int); item by item otherwise."""
    kinds = set(map(type, hashes))
    if kinds == _INTS:
        ints: list[int] = hashes  # type: ignore[assignment]
        return min(ints) >= 0 and max(ints) < _UINT64
    if kinds == _BYTES:
        return max(map(len, hashes)) <= MAX_HASH_BYTES  # type: ignore[arg-type]
    return all(map(_is_hash, hashes))


_INTS, _BYTES = {int}, {bytes}


def _is_hash(value: object) -> bool:
    """A block hash as vLLM sends it: a uint64 or a digest's bytes (``MAX_HASH_BYTES``)."""
    if isinstance(value, bytes):
        return len(value) <= MAX_HASH_BYTES
    return _is_int(value) and 0 <= value < _UINT64  # type: ignore[operator]
