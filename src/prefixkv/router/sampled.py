"""The runs of a KVEventBatch that ``HashCheck`` (hash_check.py) can rehash, read field by
field from its msgpack bytes and only as far as the comparison needs (the rest skipped
unbuilt): ``BlockStored`` runs that start a chain, cut to their leading blocks whose extra
keys hold a LoRA's name and a salt alone (hash_check.py's module doc says which and why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .decode import _is_hash
from .decode_large import ARRAY_FIELDS, UNBUILT, _is_array, _is_map, _scalar

__all__ = ["Sampled", "sample_runs"]

_MAX_KEYS = 4  # items of an ``extra_keys`` entry read (a LoRA and a salt are 2)
_STORED = (*ARRAY_FIELDS["BlockStored"], "locality", "ownership", "session_id",
           "lookahead_token_ids")  # (vLLM 0.33's array form, in order)
_MAX_LOOKAHEAD = 64  # tokens of a block's ``lookahead_token_ids`` entry read
_SCALARS = frozenset(("type", "parent_block_hash", "block_size", "medium", "group_idx",
                      "kv_cache_spec_kind", "lora_name", "lora_id"))


@dataclass(frozen=True, slots=True)
class Sampled:
    """A ``BlockStored`` run that starts a chain, cut to its leading blocks with no extra
    keys but its ``lora`` and ``salt``: ``hashes`` as announced (wire form), ``tokens``
    theirs (``block_size`` each), and the fields that say whether the router indexes it."""

    hashes: list[object]
    tokens: list[object]
    block_size: object
    medium: object
    group: object
    kind: object
    lora: str | None = None
    salt: str | None = None
    lookahead: list[tuple[object, ...]] | None = None  # (per block: the tokens after it)


def sample_runs(payload: bytes, block_size: int, max_blocks: int) -> list[Sampled]:
    """The runs of ``payload`` (a KVEventBatch) that start a chain (``parent_block_hash``
    nil) with token ids filling their blocks (``block_size`` each, the event's own when it
    states one), each cut to its leading blocks whose ``extra_keys`` entry holds the
    run's LoRA name alone (nil without one), the first block's the salt after it (module
    doc), at most ``max_blocks`` blocks in all. Anything of another shape gives nothing (the
    decoder judges the payload; this reads only what the comparison needs). Never raises."""
    try:
        return _runs(payload, block_size, max_blocks)
    except Exception:  # (msgpack raises several unrelated types; nothing to compare then)
        return []


def _runs(payload: bytes, block_size: int, max_blocks: int) -> list[Sampled]:
    import msgpack

    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(payload))
    u.feed(payload)
    if not payload or not _is_array(payload, 0) or u.read_array_header() not in (2, 3):
        return []
    u.skip()  # ts
    if not _is_array(payload, u.tell()):
        return []
    out: list[Sampled] = []
    for _ in range(u.read_array_header()):
        if max_blocks <= 0:
            break
        run = _run(u, payload, block_size, max_blocks)
        if run is not None:
            out.append(run)
            max_blocks -= len(run.hashes)
    return out


def _run(u: Any, payload: bytes, block_size: int, limit: int) -> Sampled | None:
    raw: dict[object, object] = {}
    if _is_map(payload, u.tell()):
        for _ in range(u.read_map_header()):
            _read(u, payload, raw, _scalar(u, payload), block_size, limit)
    elif _is_array(payload, u.tell()):
        n = u.read_array_header()
        tag = _scalar(u, payload) if n else None
        fields = _STORED if tag == "BlockStored" else ()
        raw["type"] = tag
        for i in range(n - 1):
            _read(u, payload, raw, fields[i] if i < len(fields) else None, block_size, limit)
    else:
        u.skip()
        return None
    return _cut(raw, block_size, limit)


def _read(u: Any, payload: bytes, raw: dict[object, object], name: object, block_size: int,
          limit: int) -> None:
    """The value of field ``name`` into ``raw`` if the comparison reads it, else skipped."""
    if name in ("block_hashes", "token_ids", "extra_keys", "lookahead_token_ids"):
        raw[name] = _field(u, payload, name, block_size, limit)
    elif name in _SCALARS:
        raw[name] = _scalar(u, payload)
    else:
        u.skip()


def _field(u: Any, payload: bytes, key: str, block_size: int, limit: int) -> object:
    """``(count, first items)`` of an array field (hashes: ``limit``; token ids: ``limit``
    blocks' worth; extra keys: the first ``limit`` entries, each None, a tuple of its
    scalars, or ``UNBUILT`` past ``_MAX_KEYS`` items); None for nil; ``UNBUILT`` for
    anything else (skipped)."""
    at = u.tell()
    if payload[at] == 0xC0:
        u.skip()
        return None
    if not _is_array(payload, at):
        u.skip()
        return UNBUILT
    n = u.read_array_header()
    if key in ("extra_keys", "lookahead_token_ids"):
        width = _MAX_KEYS if key == "extra_keys" else _MAX_LOOKAHEAD
        entries = [_entry(u, payload, width) for _ in range(min(n, limit))]
        for _ in range(n - len(entries)):
            u.skip()
        return n, entries
    take = min(n, limit * block_size if key == "token_ids" else limit)
    items = [_scalar(u, payload) for _ in range(take)]
    for _ in range(n - take):
        u.skip()
    return n, items


def _entry(u: Any, payload: bytes, width: int = _MAX_KEYS) -> object:
    """One block's ``extra_keys`` (or ``lookahead_token_ids``) entry: None, a tuple of its
    items (containers ``UNBUILT``), or ``UNBUILT`` (no array, or over ``width`` items)."""
    if payload[u.tell()] == 0xC0:
        u.skip()
        return None
    if not _is_array(payload, u.tell()):
        u.skip()
        return UNBUILT
    n = u.read_array_header()
    items = tuple(_scalar(u, payload) for _ in range(min(n, width)))
    for _ in range(n - len(items)):
        u.skip()
    return items if n <= width else UNBUILT


def _plain(keys: object, lora: str | None, n: int) -> tuple[str | None, int]:
    """``(salt, k)``: the first ``k`` blocks' entries (``keys`` as ``_field`` reads it;
    ``n`` blocks at most) hold the LoRA's name alone (nil without one), the first block's
    ``salt`` after it when it has one (vLLM 0.33's form: module doc)."""
    if keys is None:
        return None, 0 if lora is not None else n  # (no keys: a LoRA's would be there)
    if not isinstance(keys, tuple) or not keys[1]:
        return None, 0
    own = () if lora is None else (lora,)
    first, salt = keys[1][0], None
    head = () if first is None else first
    if not isinstance(head, tuple) or head[:len(own)] != own or len(head) > len(own) + 1:
        return None, 0
    if len(head) > len(own):
        salt = head[-1]
        if not isinstance(salt, str) or salt == "":
            return None, 0
    expect = own or None
    k = 1
    while k < min(n, len(keys[1])) and keys[1][k] == expect:
        k += 1
    return salt, min(k, n)


def _cut(raw: dict[object, object], block_size: int, limit: int) -> Sampled | None:
    if raw.get("type") != "BlockStored" or raw.get("parent_block_hash") is not None:
        return None
    hashes, tokens, keys = raw.get("block_hashes"), raw.get("token_ids"), raw.get("extra_keys")
    size = raw.get("block_size")
    bs = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else block_size
    if not (isinstance(hashes, tuple) and isinstance(tokens, tuple)) or tokens[0] != hashes[0] * bs:
        return None  # (no tokens, as a snapshot's runs; or not one block's worth a hash)
    lora = raw.get("lora_name")
    if lora is None and raw.get("lora_id") is not None or lora is not None and (
            not isinstance(lora, str) or lora == ""):
        return None  # (a LoRA's id without its name: an older engine's; name unknown)
    salt, k = _plain(keys, lora, min(len(hashes[1]), limit, len(tokens[1]) // bs))
    if k <= 0 or not all(_is_hash(h) for h in hashes[1][:k]):
        return None
    after = raw.get("lookahead_token_ids")
    if after is not None and not (isinstance(after, tuple) and after[0] == hashes[0]
                                  and all(isinstance(e, tuple) for e in after[1][:k])):
        return None  # (not one entry a block, or one unread: nothing to compare)
    return Sampled(hashes[1][:k], tokens[1][:k * bs], size, raw.get("medium"),
                   raw.get("group_idx"), raw.get("kv_cache_spec_kind"), lora, salt,
                   None if after is None else after[1][:k])
