"""Decode a vLLM ``KVEventBatch`` payload, as docs/events.md describes it, into the few
facts a router needs. Accepts vLLM 0.33's map-encoded events and the positional
(array) events of older vLLM releases in the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from ..errors import PrefixKVError

_T = TypeVar("_T")

Hash = int | bytes


class DecodeError(PrefixKVError):
    """A payload that is not a KVEventBatch (wrong shape, unknown event tag, bad field)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """``hashes`` became findable on ``medium``; ``parent`` precedes ``hashes[0]``.
    ``group``: the layer group (vLLM's ``group_idx``; None when the event has none),
    ``kind`` its ``kv_cache_spec_kind`` and ``window`` its sliding window, None when
    absent."""

    hashes: tuple[Hash, ...]
    parent: Hash | None
    medium: str
    group: int | None = None
    kind: str | None = None
    window: int | None = None


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

# Positional layout of the pre-0.2x array encoding: tag first, then the fields in the
# structs' declaration order (fields added later come last; trailing defaults omitted).
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                    "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def decode_batch(payload: bytes) -> tuple[float, list[RouterEvent], int | None]:
    """``(ts, events, data_parallel_rank)`` of one payload (rank None when omitted).
    Raises DecodeError for anything that is not a KVEventBatch."""
    import msgpack

    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) not in (2, 3) or not isinstance(
            batch[1], list) or not isinstance(batch[0], (int, float)):
        raise DecodeError(f"a KVEventBatch is [ts, events, dp_rank?], got {str(batch)[:80]}")
    return float(batch[0]), [_event(e) for e in batch[1]], batch[2] if len(batch) == 3 else None


def _event(raw: object) -> RouterEvent:
    if isinstance(raw, list) and raw and raw[0] in _ARRAY_FIELDS:
        # an older sender omits the trailing fields a newer vLLM added: they read as absent
        raw = {"type": raw[0], **dict(zip(_ARRAY_FIELDS[raw[0]], raw[1:], strict=False))}
    if not isinstance(raw, dict):
        raise DecodeError(f"an event is a map or a tagged array, got {str(raw)[:80]}")
    tag = raw.get("type")
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag not in ("BlockStored", "BlockRemoved"):
        raise DecodeError(f"unknown event type {tag!r}")
    hashes = raw.get("block_hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, (int, bytes)) for h in hashes):
        raise DecodeError(f"{tag}.block_hashes must be a list of ints or bytes")
    medium = raw.get("medium") or "GPU"  # nil: vLLM releases before media existed
    group = _optional(raw, tag, "group_idx", int)
    if tag == "BlockRemoved":
        return Removed(tuple(hashes), medium, group)
    return Stored(tuple(hashes), raw.get("parent_block_hash"), medium, group,
                  _optional(raw, tag, "kv_cache_spec_kind", str),
                  _optional(raw, tag, "kv_cache_spec_sliding_window", int))


def _optional(raw: dict[str, object], tag: str, key: str, kind: type[_T]) -> _T | None:
    """``raw[key]``, None when absent or nil; DecodeError when of another type."""
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DecodeError(f"{tag}.{key} must be {kind.__name__} or nil, got {value!r}")
    return value
