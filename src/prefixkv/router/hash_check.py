"""Whether a replica hashes its blocks as the router hashes prompts: a bounded sample.

A replica whose manager hashes with another mode, seed or hash format than the router
(the default ``xxhash`` with its random seed behind a ``sha256`` router, another
``seed``, ``"bytes"`` hashes to an ``"int"`` router) announces blocks that no prompt's
hashes ever meet: every route misses there, and nothing else says so. A ``BlockStored``
carries what the router needs to tell: the run's token ids, its parent's hash and each
block's extra keys: the router hashes a run's leading blocks as it hashes a prompt
(``hashing.chain_hashes``) and compares them with the hashes announced.

Compared are the blocks of a run whose parent is nil (so the root is the router's own)
up to its first with a multimodal input or prompt embeddings (their length is unsent).
A salt and a LoRA enter every block's hash: vLLM 0.33 sends the LoRA's name in
``lora_name`` and each block's ``extra_keys`` entry, the salt after it in the first
block's only; blocks whose entries hold just these are rehashed with them. A LoRA's
path enters its hash unsent: it is taken from the router's prompts (``learn``: the last
``MAX_PATHS`` paths given each name, so that replicas loading one name from different
paths each match one); a LoRA that no prompt named is not compared. Nor is a run of
another block size (``block_size_mismatches``), of a group the router does not score,
on a medium other than the GPU (a KV connector's tier, vLLM 0.33's CPU and STORAGE,
LMCache's: keyed by the connector, perhaps by its own hash), or whose token ids do not
fill its blocks (a snapshot's).

The sample is bounded: per replica at most ``SAMPLE_BLOCKS`` blocks compared, and at most
``SAMPLE_BATCHES`` batches read for them, from its first batch and again after each
``Router.forget`` (a restart, a resync) and reconnection; then nothing is read, so the
steady state pays one dict look-up a batch. A payload is read field by field, only as
far as the blocks still to compare need (the rest is skipped unbuilt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ExtraKeysError, TokenError
from ..extra_keys import ExtraKeys
from ..hashing import chain_hashes, encode_tokens, make_hash_fn, token_bytes
from .decode import _is_hash
from .decode_large import ARRAY_FIELDS, UNBUILT, _is_array, _is_map, _scalar
from .index import GPU
from .marks import IndexMarks
from .scored import FULL_KIND

__all__ = ["MAX_LORAS", "MAX_PATHS", "SAMPLE_BATCHES", "SAMPLE_BLOCKS", "HashCheck", "sample_runs"]

SAMPLE_BLOCKS = 32
"""Blocks compared per replica after each (re)start of its sample (module doc)."""
SAMPLE_BATCHES = 64
"""Batches read per replica, at most, for those blocks (a replica whose requests all have
an image in their first block, or a LoRA no prompt named, gives none: it stops there)."""
MAX_LORAS = 1024
"""LoRA names whose paths the check remembers (the most recently given; module doc)."""
MAX_PATHS = 4
"""Paths the check remembers per LoRA name (the most recently given; module doc)."""
_MAX_KEYS = 4  # items of an ``extra_keys`` entry read (a LoRA and a salt are 2)
_MASK64 = (1 << 64) - 1
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
    if key == "extra_keys":
        entries = [_entry(u, payload) for _ in range(min(n, limit))]
        for _ in range(n - len(entries)):
            u.skip()
        return n, entries
    take = min(n, limit * block_size if key == "token_ids" else limit)
    items = [_scalar(u, payload) for _ in range(take)]
    for _ in range(n - take):
        u.skip()
    return n, items


def _entry(u: Any, payload: bytes) -> object:
    """One block's ``extra_keys`` entry: None, a tuple of its items (containers
    ``UNBUILT``), or ``UNBUILT`` (no array, or over ``_MAX_KEYS`` items)."""
    if payload[u.tell()] == 0xC0:
        u.skip()
        return None
    if not _is_array(payload, u.tell()):
        u.skip()
        return UNBUILT
    n = u.read_array_header()
    items = tuple(_scalar(u, payload) for _ in range(min(n, _MAX_KEYS)))
    for _ in range(n - len(items)):
        u.skip()
    return items if n <= _MAX_KEYS else UNBUILT


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
    return Sampled(hashes[1][:k], tokens[1][:k * bs], size, raw.get("medium"),
                   raw.get("group_idx"), raw.get("kv_cache_spec_kind"), lora, salt)


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
        self._paths: dict[str, tuple[str | None, ...]] = {}  # LoRA name -> paths prompts gave
        for replica in replicas:
            self.rearm(replica)

    def rearm(self, replica: str) -> None:
        """Sample ``replica`` again from its next batch (a new life may hash otherwise)."""
        self._left[replica] = [SAMPLE_BLOCKS, SAMPLE_BATCHES]

    def learn(self, extra: ExtraKeys | None) -> None:
        """Remember the path a prompt's ``extra`` (checked) gives its LoRA name, if any:
        a run of that LoRA matches when its hashes are those of one of the name's last
        ``MAX_PATHS`` paths (module doc; the last ``MAX_LORAS`` names)."""
        if extra is None or extra.lora is None:
            return
        if not (known := (paths := self._paths).pop(extra.lora, ())) and len(paths) >= MAX_LORAS:
            del paths[next(iter(paths))]
        path = extra.lora_path
        paths[extra.lora] = (*[p for p in known if p != path][1 - MAX_PATHS:], path)

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
            if run.medium not in (None, GPU) or run.block_size not in (None, self._bs) \
                    or run.kind not in (None, FULL_KIND) \
                    or None not in (scored, run.group) and run.group != scored:
                continue
            mine = self._hashes(run, len(run.hashes))
            if not mine:
                continue
            left[0] -= len(run.hashes)
            self.checked[replica] += len(run.hashes)
            if run.hashes not in mine:
                self._marks.hash_mismatched(replica, run.medium)
        if left[0] <= 0 or left[1] <= 0:
            del self._left[replica]

    def _hashes(self, run: Sampled, n: int) -> list[list[int | bytes]]:
        """The first ``n`` blocks' hashes of ``run``'s tokens from the root with its LoRA
        (under each path known for it) and salt, in wire form; none when the token ids
        are not ids or its LoRA's path is unknown (nothing to compare)."""
        out: list[list[int | bytes]] = []
        try:
            data, step = token_bytes(encode_tokens(run.tokens)), 4 * self._bs  # type: ignore[arg-type]
            chunks = [data[i * step:(i + 1) * step] for i in range(n)]
            for path in (None,) if run.lora is None else self._paths.get(run.lora, ()):
                extra = ExtraKeys(lora=run.lora, cache_salt=run.salt, lora_path=path).base_bytes()
                digests = chain_hashes(self._fn, self._root, chunks, [extra] * n)
                out.append(list(digests) if self._format == "bytes"
                           else [int.from_bytes(d, "big") & _MASK64 for d in digests])
        except (TokenError, ExtraKeysError):
            return []
        return out
