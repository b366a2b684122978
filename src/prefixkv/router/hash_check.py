"""Whether a replica hashes its blocks as the router hashes prompts: a bounded sample.

A replica whose manager hashes with another mode, seed or hash format than the router
(the default ``xxhash`` with its random seed behind a ``sha256`` router, another
``seed``, ``"bytes"`` hashes to an ``"int"`` router) announces blocks that no prompt's
hashes ever meet: every route misses there, and nothing else says so. A ``BlockStored``
carries what the router needs to tell: the run's token ids, its parent's hash and each
block's extra keys. Where the run starts a chain (parent nil), the router hashes its
leading blocks as it hashes a prompt (``hashing.chain_hashes`` from its root) and
compares them with the hashes announced.

Only blocks whose hashes are known to take nothing the wire omits are compared: those
of a run whose parent is nil (its first block is a request's first, so the root is the
router's own), up to the first block that carries extra keys (LoRA, a cache salt, a
multimodal input, prompt embeddings: their wire form is not what enters the hash: an
input's length, a LoRA's path are not sent, and a salt is sent on a request's first
block only, though it enters every block's hash). Nothing is compared for a run whose
block size differs (``block_size_mismatches``), of a group the router does not score,
or whose token ids do not fill its blocks (a snapshot's runs carry none).

The sample is bounded: per replica at most ``SAMPLE_BLOCKS`` blocks compared, and at most
``SAMPLE_BATCHES`` batches read for them, from its first batch and again after each
``Router.forget`` (a restart, a resync) and reconnection; then nothing is read, so the
steady state pays one dict look-up a batch. A payload is read field by field here, and
only as much of each field as the blocks still to compare need (the rest is skipped
unbuilt: a batch of 64 KiB of small containers costs what its compared blocks do).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import TokenError
from ..hashing import chain_hashes, encode_tokens, make_hash_fn, token_bytes
from .decode import _is_hash
from .decode_large import ARRAY_FIELDS, UNBUILT, _is_array, _is_map, _scalar
from .marks import IndexMarks
from .scored import FULL_KIND

__all__ = ["SAMPLE_BATCHES", "SAMPLE_BLOCKS", "HashCheck", "sample_runs"]

SAMPLE_BLOCKS = 32
"""Blocks compared per replica after each (re)start of its sample (module doc)."""
SAMPLE_BATCHES = 64
"""Batches read per replica, at most, for those blocks (a replica whose requests are all
salted or multimodal gives none: the reading stops there too)."""
_MASK64 = (1 << 64) - 1
_SCALARS = frozenset(("type", "parent_block_hash", "block_size", "medium", "group_idx",
                      "kv_cache_spec_kind", "lora_name", "lora_id"))


@dataclass(frozen=True, slots=True)
class Sampled:
    """A ``BlockStored`` run that starts a chain, cut to its leading blocks without extra
    keys: ``hashes`` as announced (wire form), ``tokens`` theirs (``block_size`` each),
    and the fields that say whether the router indexes it."""

    hashes: list[object]
    tokens: list[object]
    block_size: object
    medium: object
    group: object
    kind: object


def sample_runs(payload: bytes, block_size: int, max_blocks: int) -> list[Sampled]:
    """The runs of ``payload`` (a KVEventBatch) that start a chain (``parent_block_hash``
    nil) with token ids filling their blocks (``block_size`` each, the event's own when it
    states one), each cut to its leading blocks whose ``extra_keys`` entry is nil, at
    most ``max_blocks`` blocks in all. Anything of another shape gives nothing (the
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
        fields = ARRAY_FIELDS.get(tag, ()) if isinstance(tag, str) else ()
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
    if name in ("block_hashes", "token_ids", "extra_keys"):
        raw[name] = _field(u, payload, name, block_size, limit)
    elif name in _SCALARS:
        raw[name] = _scalar(u, payload)
    else:
        u.skip()


def _field(u: Any, payload: bytes, key: str, block_size: int, limit: int) -> object:
    """``(count, first items)`` of an array field (hashes: ``limit``; token ids: ``limit``
    blocks' worth; extra keys: how many of the first ``limit`` entries lead nil, as a
    count); None for nil; ``UNBUILT`` for anything else (skipped)."""
    at = u.tell()
    if payload[at] == 0xC0:
        u.skip()
        return None
    if not _is_array(payload, at):
        u.skip()
        return UNBUILT
    n = u.read_array_header()
    if key == "extra_keys":
        plain = 0
        while plain < min(n, limit) and payload[u.tell()] == 0xC0:
            u.skip()
            plain += 1
        for _ in range(n - plain):
            u.skip()
        return n, plain
    take = min(n, limit * block_size if key == "token_ids" else limit)
    items = [_scalar(u, payload) for _ in range(take)]
    for _ in range(n - take):
        u.skip()
    return n, items


def _cut(raw: dict[object, object], block_size: int, limit: int) -> Sampled | None:
    if raw.get("type") != "BlockStored" or raw.get("parent_block_hash") is not None:
        return None
    hashes, tokens, keys = raw.get("block_hashes"), raw.get("token_ids"), raw.get("extra_keys")
    size = raw.get("block_size")
    bs = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else block_size
    if not (isinstance(hashes, tuple) and isinstance(tokens, tuple)) or tokens[0] != hashes[0] * bs:
        return None  # (no tokens, as a snapshot's runs; or not one block's worth a hash)
    plain = hashes[0] if keys is None else keys[1] if isinstance(keys, tuple) else 0
    if raw.get("lora_name") is not None or raw.get("lora_id") is not None:
        plain = 0  # (a LoRA's hashes take its name, and perhaps its path: not compared)
    k = min(len(hashes[1]), plain, limit, len(tokens[1]) // bs)
    if k <= 0 or not all(_is_hash(h) for h in hashes[1][:k]):
        return None
    return Sampled(hashes[1][:k], tokens[1][:k * bs], size, raw.get("medium"),
                   raw.get("group_idx"), raw.get("kv_cache_spec_kind"))


class HashCheck:
    """The sample of the module doc for ``replicas`` (names the caller checked), hashed
    as the router hashes prompts (``block_size``, ``hash_mode``, ``seed``,
    ``hash_format``, checked by the router); a run that differs is counted in ``marks``
    (``hash_mismatches``, warned once per replica). ``checked``: blocks compared per
    replica, all lives together (0: nothing known yet)."""

    def __init__(self, replicas: Sequence[str], block_size: int, hash_mode: Any,
                 seed: int | bytes | None, hash_format: str, marks: IndexMarks) -> None:
        self._fn, self._root = make_hash_fn(hash_mode, seed)
        self._bs, self._format, self._marks = block_size, hash_format, marks
        self.checked = dict.fromkeys(replicas, 0)
        self._left: dict[str, list[int]] = {}  # replica -> [blocks, batches] still to read
        for replica in replicas:
            self.rearm(replica)

    def rearm(self, replica: str) -> None:
        """Sample ``replica`` again from its next batch (a new life may hash otherwise)."""
        self._left[replica] = [SAMPLE_BLOCKS, SAMPLE_BATCHES]

    def due(self, replica: str) -> bool:
        """Whether ``replica``'s next batch is read for the sample."""
        return replica in self._left

    def check(self, replica: str, payload: bytes, scored: int | None) -> None:
        """Compare the runs of ``payload`` (a batch of ``replica``'s, applied) that the
        router indexes (``scored``: the replica's scored group, None for none yet) and
        can rehash (module doc); nothing when the sample is spent."""
        left = self._left.get(replica)
        if left is None:
            return
        left[1] -= 1
        for run in sample_runs(payload, self._bs, left[0]):
            if run.block_size not in (None, self._bs) or run.kind not in (None, FULL_KIND) \
                    or None not in (scored, run.group) and run.group != scored:
                continue
            mine = self._hashes(run.tokens, len(run.hashes))
            if mine is None:
                continue
            left[0] -= len(mine)
            self.checked[replica] += len(mine)
            if mine != run.hashes:
                self._marks.hash_mismatched(replica, run.medium)
        if left[0] <= 0 or left[1] <= 0:
            del self._left[replica]

    def _hashes(self, tokens: list[object], n: int) -> list[int | bytes] | None:
        """The first ``n`` blocks' hashes of ``tokens`` from the root, in wire form; None
        when the token ids are not ids (nothing to compare)."""
        try:
            data = token_bytes(encode_tokens(tokens))  # type: ignore[arg-type]
        except TokenError:
            return None
        step = 4 * self._bs
        digests = chain_hashes(self._fn, self._root,
                               [data[i * step:(i + 1) * step] for i in range(n)], [b""] * n)
        if self._format == "bytes":
            return list(digests)
        return [int.from_bytes(d, "big") & _MASK64 for d in digests]
