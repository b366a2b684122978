"""Extra keys: everything besides the token ids that changes a block's KV.

Each kind is encoded with its own one-byte tag and a length, so a LoRA name can never be
read as a cache salt and no two different key sets encode to the same bytes::

    b"L" len:u32 utf8(lora)   b"S" len:u32 utf8(cache_salt)
    b"M" len:u32 hash_bytes start:u64 length:u64      (one per multimodal input)

LoRA and salt apply to every block of a request; a multimodal input applies only to the
blocks whose token range overlaps its placeholder range ``[offset, offset + length)``, so
a shared text prefix before an image is still shared.
"""

from __future__ import annotations

import struct
from bisect import bisect_left
from dataclasses import dataclass, field

from .errors import ExtraKeysError

EMBEDS_TAG = b"\xffprompt_embeds:"
"""The first bytes of a ``MultiModalInput.hash`` that stands for a block's prompt
embeddings (a digest of its rows: ``integrations.vllm.requests``), not a multimodal
input: 0xff starts no UTF-8 text, so no str identifier can spell one. Events announce
it as vLLM does, the bare digest after the salt (``fleet.wire.vllm_extra_keys``)."""

_U32 = struct.Struct("<I")
_U64x2 = struct.Struct("<QQ")


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """One multimodal input: the content hash of its data and the placeholder token range
    ``[offset, offset + length)`` it occupies in the prompt."""

    hash: str | bytes
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.hash, (str, bytes)) or len(self.hash) == 0:
            raise ExtraKeysError(
                f"MultiModalInput.hash must be a non-empty str or bytes, got {self.hash!r}"
            )
        if isinstance(self.hash, str):
            _utf8("MultiModalInput.hash", self.hash)
        for name in ("offset", "length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ExtraKeysError(f"MultiModalInput.{name} must be an int, got {value!r}")
        if self.offset < 0 or self.length <= 0:
            raise ExtraKeysError(
                f"MultiModalInput needs offset >= 0 and length > 0, "
                f"got offset={self.offset}, length={self.length}"
            )


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """The request's keys besides its tokens. Two requests share cached blocks only when
    these are equal for the blocks concerned.

    ``lora``: adapter name (None for the base model); it enters the hash.
    ``lora_path``: where the adapter's weights were loaded from, when the engine lets a
    name be re-pointed at other weights (vLLM's ``lora_path``): it enters the hash too,
    so KV computed with the old weights is never served under the new ones; None: the
    name alone is the identity.
    ``cache_salt``: tenant namespace; requests with different salts never share a block.
    ``mm``: multimodal inputs. ``lora_id``: the engine's integer id of the adapter, carried
    into events (vLLM's ``lora_id`` field) but not hashed: the name is the identity.
    Raises ExtraKeysError on construction when a field has the wrong type, is empty, or
    is a str that cannot be encoded as UTF-8 (a lone surrogate).
    """

    lora: str | None = None
    cache_salt: str | None = None
    mm: tuple[MultiModalInput, ...] = ()
    lora_id: int | None = None
    lora_path: str | None = None
    # many inputs: their positions by offset, the offsets, and the furthest end so far
    # (``for_range`` finds a block's inputs by bisection, not by a pass over them all)
    _by_offset: tuple[tuple[int, ...], list[int], list[int]] | None = field(
        default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("lora", "cache_salt"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value == ""):
                raise ExtraKeysError(f"ExtraKeys.{name} must be None or a non-empty str, got {value!r}")
            if value is not None:
                _utf8(f"ExtraKeys.{name}", value)
        if self.lora_id is not None and (type(self.lora_id) is not int or self.lora_id < 0):
            raise ExtraKeysError(f"ExtraKeys.lora_id must be None or an int >= 0, got {self.lora_id!r}")
        if self.lora_id is not None and self.lora is None:
            raise ExtraKeysError("ExtraKeys.lora_id needs the adapter's name in ExtraKeys.lora")
        if self.lora_path is not None:
            _check_lora_path(self.lora, self.lora_path)
        if not isinstance(self.mm, tuple) or not all(isinstance(m, MultiModalInput) for m in self.mm):
            raise ExtraKeysError(f"ExtraKeys.mm must be a tuple of MultiModalInput, got {self.mm!r}")
        if len(self.mm) > _BISECT_FROM:
            order = tuple(sorted(range(len(self.mm)), key=lambda i: self.mm[i].offset))
            ends, reach = [], 0
            for i in order:
                reach = max(reach, self.mm[i].offset + self.mm[i].length)
                ends.append(reach)
            object.__setattr__(self, "_by_offset", (order, [self.mm[i].offset for i in order], ends))

    def base_bytes(self) -> bytes:
        """The tagged encoding of the keys that apply to every block (LoRA, salt)."""
        out = b""
        if self.lora is not None:
            raw = self.lora.encode()
            out += b"L" + _U32.pack(len(raw)) + raw
            if self.lora_path is not None:
                raw = self.lora_path.encode()
                out += b"P" + _U32.pack(len(raw)) + raw
        if self.cache_salt is not None:
            raw = self.cache_salt.encode()
            out += b"S" + _U32.pack(len(raw)) + raw
        return out

    def for_range(self, start: int, end: int) -> ExtraKeys | None:
        """The keys that enter the hash of the block of tokens ``[start, end)``: LoRA, salt
        and the multimodal inputs overlapping it; None when there are none. Raises
        ExtraKeysError unless both are ints (a bool is not)."""
        if start.__class__ is not int or end.__class__ is not int:
            raise ExtraKeysError(f"for_range takes int token positions, got {start!r}, {end!r}")
        if self._by_offset is None:
            mm = tuple(m for m in self.mm if m.offset < end and m.offset + m.length > start)
        else:  # inputs whose offset is < end, back from the last while one may reach start
            order, offsets, reach = self._by_offset
            k, hits = bisect_left(offsets, end) - 1, []
            while k >= 0 and reach[k] > start:
                m = self.mm[order[k]]
                if m.offset + m.length > start:
                    hits.append(order[k])
                k -= 1
            mm = tuple(self.mm[i] for i in sorted(hits))
        if self.lora is None and self.cache_salt is None and not mm:
            return None
        return self if mm == self.mm else ExtraKeys(self.lora, self.cache_salt, mm, self.lora_id,
                                                           self.lora_path)

    def block_bytes(self, num_blocks: int, block_size: int) -> list[bytes]:
        """The encoding for each of the first ``num_blocks`` blocks: base keys plus the
        multimodal inputs overlapping that block's token range. Raises ExtraKeysError
        unless ``num_blocks`` is an int >= 0 and ``block_size`` one >= 1 (a bool is not)."""
        if num_blocks.__class__ is not int or block_size.__class__ is not int \
                or num_blocks < 0 or block_size < 1:
            raise ExtraKeysError(f"block_bytes takes num_blocks (an int >= 0) and block_size "
                                 f"(an int >= 1), got {num_blocks!r}, {block_size!r}"[:200])
        base = self.base_bytes()
        out = [base] * num_blocks
        for m in self.mm:
            raw = m.hash.encode() if isinstance(m.hash, str) else m.hash  # (``mm_bytes``, inline)
            tagged = b"M" + _U32.pack(len(raw)) + raw + _U64x2.pack(m.offset, m.length)
            first = m.offset // block_size
            last = min((m.offset + m.length - 1) // block_size, num_blocks - 1)
            for i in range(first, last + 1):
                out[i] += tagged
        return out


_BISECT_FROM = 16  # inputs past which ``for_range`` bisects


def mm_bytes(m: MultiModalInput) -> bytes:
    """The tagged encoding of one multimodal input in a block's extra-key bytes."""
    raw = m.hash.encode() if isinstance(m.hash, str) else m.hash
    return b"M" + _U32.pack(len(raw)) + raw + _U64x2.pack(m.offset, m.length)


def _check_lora_path(lora: str | None, path: object) -> None:
    if not isinstance(path, str) or path == "":
        raise ExtraKeysError(f"ExtraKeys.lora_path must be None or a non-empty str, got {path!r}")
    _utf8("ExtraKeys.lora_path", path)
    if lora is None:
        raise ExtraKeysError("ExtraKeys.lora_path needs the adapter's name in ExtraKeys.lora")


def _utf8(name: str, value: str) -> None:
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ExtraKeysError(f"{name} cannot be encoded as UTF-8: {exc.reason} at {exc.start}") from None


def check_extra(extra: object, num_tokens: int) -> ExtraKeys | None:
    """Validate ``extra`` against a prompt of ``num_tokens`` tokens; returns it typed.
    Raises ExtraKeysError when it is not ExtraKeys/None or a multimodal range runs past
    the prompt."""
    if extra is None:
        return None
    if not isinstance(extra, ExtraKeys):
        raise ExtraKeysError(f"extra must be prefixkv.ExtraKeys or None, got {type(extra).__name__}")
    for m in extra.mm:
        if m.offset + m.length > num_tokens:
            raise ExtraKeysError(
                f"multimodal input [{m.offset}, {m.offset + m.length}) runs past the "
                f"prompt of {num_tokens} tokens"
            )
    return extra
