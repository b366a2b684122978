"""vLLM's KV-event wire format (vLLM 0.33), written from docs/events.md.

One engine step's events become one ``KVEventBatch``, a msgpack array
``[ts: float64, events: array, data_parallel_rank: int]``. Each event is a msgpack map
whose first key is ``"type"`` (``"BlockStored"``, ``"BlockRemoved"``,
``"AllBlocksCleared"``), then vLLM's field names in vLLM's order. Fields that vLLM
declares without a default are always present (nil when unknown); fields with a default
are omitted when they hold it. The core's events are runs already (one ``BlockStored`` a
run of stored blocks, as vLLM's); consecutive runs that continue one chain travel as one
``BlockStored``, consecutive removals as one ``BlockRemoved``, never across media or
layer groups.

Layer groups (vLLM's hybrid KV cache): every ``BlockStored`` names its group
(``group_idx``) and the group's spec (``kv_cache_spec_kind``, and for a sliding window
``kv_cache_spec_sliding_window`` = W, omitted otherwise); every ``BlockRemoved`` names
its group. The core's events (one group) are group 0, ``"full_attention"``; a hybrid
manager's ``GroupBlockStored``/``GroupBlockRemoved`` carry their own group and spec.

Block hashes: ``"int"`` (vLLM's default) sends the low 64 bits of our digest, i.e. its
last 8 bytes read big-endian, as a msgpack unsigned int; ``"bytes"`` sends the whole
digest (16 bytes for xxhash, 32 for sha256) as msgpack bin.

Extra keys (``extra_keys``, one entry per block): as vLLM 0.33 publishes them, untagged:
the LoRA name, ``(identifier, offset in the block)`` per multimodal input overlapping
the block, the cache salt on a request's first block only, and a block's
prompt-embeddings digest, bare (``vllm_extra_keys``; the events carry each run's position
in its request, so the offsets are always known).

Lookahead keys (a ``LookaheadKVCacheManager``'s events, vLLM's lookahead hashing): a
``BlockStored`` also sends ``lookahead_token_ids`` (per block, the ``L`` tokens after it,
which its hash covers), and each ``extra_keys`` entry covers the block and those tokens,
as vLLM 0.33's do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import PrefixKVError
from ..events import AllBlocksCleared, BlockRemoved, BlockStored
from ..extra_keys import EMBEDS_TAG, ExtraKeys

VLLM_VERSION = "0.33"
HASH_FORMATS = ("int", "bytes")
MEDIUM_GPU = "GPU"
FULL_KIND = "full_attention"
"""vLLM's ``kv_cache_spec_kind`` of a full-attention group (``KVCacheSpecKind``)."""
SLIDING_KIND = "sliding_window"
"""... of a sliding-window group, the only kind that sends its window."""

_MASK64 = (1 << 64) - 1


class WireError(PrefixKVError):
    """A wire option out of range (hash format, block size, rank) or an object that is
    not one of the core's events."""


def wire_hash(digest: bytes, hash_format: str = "int") -> int | bytes:
    """Our digest as it goes on the wire: its last 8 bytes as a big-endian uint64
    (``"int"``), or the digest itself (``"bytes"``)."""
    return int.from_bytes(digest, "big") & _MASK64 if hash_format == "int" else digest


def check_options(block_size: object, hash_format: object, dp_rank: object) -> None:
    """Raise WireError unless ``block_size`` >= 1, ``hash_format`` in HASH_FORMATS and
    ``dp_rank`` in [0, 2**63) (all ints; a rank past msgpack's ints failed every batch
    in the publisher's thread)."""
    for name, value, low in (("block_size", block_size, 1), ("dp_rank", dp_rank, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise WireError(f"{name} must be an int >= {low}, got {value!r}")
    if dp_rank >= 1 << 63:  # type: ignore[operator]
        raise WireError(f"dp_rank must be an int below 2**63, got {dp_rank!r}")
    if hash_format not in HASH_FORMATS:
        raise WireError(f"hash_format must be one of {HASH_FORMATS}, got {hash_format!r}")


def _medium(ev: object) -> str:
    return getattr(ev, "medium", MEDIUM_GPU)  # the core adds ``medium`` later


def group_of(ev: object) -> tuple[int, str, int | None]:
    """``(group_idx, kv_cache_spec_kind, sliding window or None)`` of a core event (group
    0, full attention) or a hybrid manager's group event."""
    kind = getattr(ev, "spec_kind", FULL_KIND)
    return (getattr(ev, "group_idx", 0), kind,
            getattr(ev, "spec_tokens", None) if kind == SLIDING_KIND else None)


def group_fields(group: tuple[int, str | None, int | None]) -> dict[str, Any]:
    """The group keys of a ``BlockStored`` map, in vLLM's order (the window only when
    there is one: vLLM omits fields that hold their default, nil)."""
    idx, kind, window = group
    out: dict[str, Any] = {"group_idx": idx, "kv_cache_spec_kind": kind}
    if window is not None:
        out["kv_cache_spec_sliding_window"] = window
    return out


def vllm_extra_keys(extra: ExtraKeys | None, start: int, block_size: int) -> tuple[Any, ...] | None:
    """The ``extra_keys`` entry vLLM 0.33 publishes for the block of tokens ``[start,
    start + block_size)`` of a request with these keys (``kv_cache_utils.to_event_extra_keys``
    of ``generate_block_hash_extra_keys``): the LoRA name; each multimodal input overlapping
    the block as ``(identifier, its offset minus start)`` (negative when it began in an
    earlier block; a bytes identifier as hex: vLLM's identifiers are str, a digest in hex);
    the cache salt when ``start`` is 0; then the block's prompt-embeddings digest, bare
    bytes (an input tagged ``EMBEDS_TAG``). None when empty. The one builder of both
    event paths: this wire and the vLLM plug-in's events (``integrations.vllm.events``)."""
    own = extra.for_range(start, start + block_size) if extra is not None else None
    if own is None:
        return None
    out: list[Any] = [own.lora] if own.lora is not None else []
    embeds: list[bytes] = []
    for m in own.mm:
        h = m.hash
        if isinstance(h, str):
            out.append((h, m.offset - start))
        elif h.startswith(EMBEDS_TAG):
            embeds.append(h[len(EMBEDS_TAG):])
        else:
            out.append((h.hex(), m.offset - start))
    if own.cache_salt is not None and start == 0:
        out.append(own.cache_salt)
    out += embeds
    return tuple(out) if out else None


def _lora(ev: BlockStored) -> tuple[int | None, str | None]:
    x = ev.extra
    return (getattr(x, "lora_id", None), x.lora) if x is not None else (None, None)


def _extra_keys(ev: BlockStored, lookahead: int = 0) -> list[tuple[Any, ...] | None]:
    """The ``extra_keys`` entries of every block of ``ev`` (each over the block and the
    ``lookahead`` tokens after it, as vLLM's under lookahead hashing)."""
    x = ev.extra
    if x is None:
        return [None] * len(ev.block_hashes)
    bs = ev.block_size
    width = bs + lookahead
    return [vllm_extra_keys(x, j * bs, width)
            for j in range(ev.first_block, ev.first_block + len(ev.block_hashes))]


def lookahead_of(ev: BlockStored) -> int:
    """The tokens after each block that ``ev``'s hashes cover: a lookahead manager's
    ``LookaheadBlockStored`` (``core.lookahead_events``), else 0."""
    return 0 if ev.__class__ is BlockStored else getattr(ev, "lookahead", 0)


def _stored(run: list[BlockStored], block_size: int, fmt: str) -> dict[str, Any]:
    first = run[0]
    lora_id, lora_name = _lora(first)
    parent = first.parent_block_hash
    hashes: list[int | bytes] = []
    tokens: list[int] = []
    extra_keys: list[tuple[Any, ...] | None] = []
    lookahead = 0 if first.__class__ is BlockStored else getattr(first, "lookahead", 0)  # (lookahead_of)
    for ev in run:
        hashes += [wire_hash(h, fmt) for h in ev.block_hashes]
        tokens += ev.token_ids
        extra_keys += _extra_keys(ev, lookahead)
    out = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None if parent is None else wire_hash(parent, fmt),
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": _medium(first),
        "lora_name": lora_name,
        "extra_keys": extra_keys,
        **group_fields(group_of(first)),
    }
    if lookahead:  # (vLLM's last field: per block, the tokens after it its hash covers)
        out["lookahead_token_ids"] = [ids for ev in run for ids in ev.lookahead_token_ids]  # type: ignore[attr-defined]
    return out


def _continues(run: list[Any], ev: Any) -> bool:
    """Whether ``ev`` extends ``run`` into one wire event: stores that continue one chain
    (each one's parent the hash before it) with the same LoRA, or removals; within one
    medium and layer group."""
    last = run[-1]
    if type(ev) is not type(last) or _medium(ev) != _medium(last) \
            or group_of(ev) != group_of(last):
        return False
    if isinstance(ev, BlockStored):
        return ev.parent_block_hash == last.block_hashes[-1] and _lora(ev) == _lora(last)
    return True


def to_wire_events(events: Iterable[object], block_size: int,
                   hash_format: str = "int") -> list[dict[str, Any]]:
    """The wire maps of one step's core events, in order, runs grouped (see module doc).
    Raises WireError for an object that is not BlockStored/BlockRemoved/
    AllBlocksCleared."""
    runs: list[list[Any]] = []
    for ev in events:
        if not isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise WireError(f"not a prefixkv event: {type(ev).__name__}")
        if runs and not isinstance(ev, AllBlocksCleared) and _continues(runs[-1], ev):
            runs[-1].append(ev)
        else:
            runs.append([ev])
    out: list[dict[str, Any]] = []
    for run in runs:
        first = run[0]
        if isinstance(first, BlockStored):
            out.append(_stored(run, block_size, hash_format))
        elif isinstance(first, BlockRemoved):
            out.append({"type": "BlockRemoved",
                        "block_hashes": [wire_hash(h, hash_format)
                                         for ev in run for h in ev.block_hashes],
                        "medium": _medium(first), "group_idx": group_of(first)[0]})
        else:
            out.append({"type": "AllBlocksCleared"})
    return out


def encode_batch(events: Sequence[object], *, block_size: int, hash_format: str = "int",
                 dp_rank: int = 0, ts: float | None = None) -> bytes:
    """One step's events as a msgpack ``KVEventBatch`` payload (the third frame of a
    published message). ``ts``: seconds since the epoch, a finite int or float (default:
    now). Raises WireError (bad option or event; ``events`` not an iterable)."""
    check_options(block_size, hash_format, dp_rank)
    if ts is not None and (not isinstance(ts, (int, float)) or isinstance(ts, bool)
                           or not math.isfinite(ts)):
        raise WireError(f"ts must be None or a finite number of seconds, got {ts!r}"[:200])
    if not isinstance(events, Iterable):
        raise WireError(f"events must be a list of prefixkv events, got {type(events).__name__}")
    return pack([time.time() if ts is None else float(ts),
                 to_wire_events(events, block_size, hash_format), dp_rank])


def pack(obj: object) -> bytes:
    """msgpack with str as str, bytes as bin, floats as float64 (msgpack imported here:
    it is the ``events`` extra)."""
    import msgpack

    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed
