"""The hash chain that names full blocks, and the canonical token encoding.

    root        = H(seed)
    id(block 0) = H(root          || tokens[0:bs]       || extra_0)
    id(block i) = H(id(block i-1) || tokens[i*bs:(i+1)*bs] || extra_i)

Token ids are encoded once per prompt as uint32 little-endian; the parent digest and the
token chunk have fixed lengths, so the tagged extra bytes that follow are unambiguous.
The hash names blocks outside the process (events, routers, stores); inside, the index
finds blocks by their content (``prefixkv.index.content``).
"""

from __future__ import annotations

import hashlib
import operator
import os
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import xxhash

from .errors import ConfigError, TokenError
from .extra_keys import ExtraKeys, check_extra, mm_bytes

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

HashFn = Callable[[bytes], bytes]

_TYPECODE = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder != "little"


_INT_FORMATS = frozenset("hHiIlLqQnN")  # a buffer's integer item formats, one-byte ones aside
_NOT_TOKENS = (str, bytes, bytearray, dict, set, frozenset)


def encode_tokens(token_ids: Sequence[int], vocab_size: int | None = None) -> array[int]:
    """Encode token ids as a new uint32 array (the canonical form, also kept as the
    request's token store). Accepts a list or tuple of ints, an ``array`` of integers,
    any buffer of integers (a uint32 buffer is taken without re-encoding), or another
    iterable of ints. Raises TokenError for an id outside [0, 2**32) or >= ``vocab_size``,
    a non-integer (a bool first or last id; see ``_no_bools``), or a container that is not
    a sequence of token ids (str, bytes, bytearray, dict, set, None, a bare int, a buffer
    of bytes)."""
    t = type(token_ids)
    arr: array[int]
    try:
        if type(token_ids) is list:  # (``type(...) is`` again, not ``t``: it narrows the type)
            arr = array(_TYPECODE)
            arr.fromlist(token_ids)  # faster than array(typecode, list)
            if arr and (type(token_ids[0]) is bool or type(token_ids[-1]) is bool):
                raise TypeError("token ids are bools, not ints")  # (as _no_bools, inlined)
        elif type(token_ids) is array:
            if token_ids.typecode in "fduw":  # (floats, and the two kinds of characters)
                raise TypeError(f"an array of typecode {token_ids.typecode!r}")
            arr = token_ids[:] if token_ids.typecode == _TYPECODE else array(_TYPECODE, token_ids)
        elif t is tuple:
            arr = array(_TYPECODE, token_ids)
            _no_bools(token_ids, arr)
        elif isinstance(token_ids, _NOT_TOKENS) or token_ids is None or isinstance(token_ids, int):
            raise TypeError(f"a {t.__name__} is not a sequence of token ids")
        else:
            arr = _from_other(token_ids)
    except (OverflowError, TypeError, ValueError) as exc:
        raise TokenError(f"token ids must be ints in [0, 2**32): {_bad_token(token_ids) or exc}") from None
    if vocab_size is not None and arr and max(arr) >= vocab_size:
        i = next(i for i, t in enumerate(arr) if t >= vocab_size)
        raise TokenError(f"token {i} of {len(arr)} is {arr[i]}: ids must be in [0, {vocab_size}) "
                         f"(vocab_size {vocab_size})")
    return arr


def _bad_token(token_ids: object) -> str:
    """Where a list or tuple of token ids fails to encode: the first id that is not an
    int in [0, 2**32), or a bool first or last (see ``_no_bools``), with its position;
    '' for other containers (their errors say what is wrong). Runs only on failure."""
    if type(token_ids) is not list and type(token_ids) is not tuple:
        return ""
    for i, t in enumerate(token_ids):
        try:
            bad = not 0 <= operator.index(t) < 1 << 32
        except TypeError:
            bad = True
        if bad:
            return f"token {i} of {len(token_ids)} is {t!r}"
    for i in (0, len(token_ids) - 1):
        if type(token_ids[i]) is bool:
            return f"token {i} of {len(token_ids)} is {token_ids[i]!r}, a bool"
    return ""


def _from_other(token_ids: object) -> array[int]:
    try:
        view = memoryview(token_ids)  # type: ignore[arg-type]
    except TypeError:
        seq = list(token_ids)  # type: ignore[call-overload]
        arr = array(_TYPECODE)
        arr.fromlist(seq)
        _no_bools(seq, arr)
        return arr
    fmt = view.format.lstrip("@=<>!")
    if view.ndim != 1 or fmt not in _INT_FORMATS:
        raise TypeError(f"a buffer of format {view.format!r} and {view.ndim} dimensions "
                        f"(token ids are a 1-d buffer of integers of 2 bytes or more)")
    little = view.format[:1] == "<" or (not _SWAP and view.format[:1] in "@=IL")
    if fmt in "IL" and view.itemsize == 4 and little and view.c_contiguous:
        arr = array(_TYPECODE)
        arr.frombytes(view.cast("B"))
        return arr
    order = view.format[:1]
    if order and order in "<>!=":  # memoryview.tolist() reads native formats only (ctypes, numpy '>i8')
        try:
            layout = struct.Struct(f"{order}{len(view)}{fmt}")
        except struct.error as exc:  # 'n'/'N' have no standard size
            raise TypeError(f"a buffer of format {view.format!r}: {exc}") from None
        if layout.size != view.nbytes:
            raise TypeError(f"a buffer of format {view.format!r} with {view.itemsize}-byte items")
        return array(_TYPECODE, layout.unpack(view.tobytes()))
    return array(_TYPECODE, view.tolist())


def _no_bools(items: Sequence[object], arr: array[int]) -> None:
    """Raise TypeError if the first or last id is a bool. Python's bool is an int, so a
    bool elsewhere reads as 0 or 1: checking every element's type would cost more than
    the encoding itself (~2x on a 32k prompt), on every admission."""
    if arr and (type(items[0]) is bool or type(items[-1]) is bool):
        raise TypeError("token ids are bools, not ints")


_GROUP = 64  # blocks split by one cached struct.Struct call


@lru_cache(maxsize=512)
def _splitter(step: int, count: int) -> struct.Struct:
    return struct.Struct(f"{step}s" * count)


def block_chunks(data: ReadableBuffer, step: int, count: int) -> list[bytes]:
    """``data[0:step]``, ``data[step:2*step]``, ... (``count`` chunks), split in C by a
    cached ``struct.Struct`` of 64 fields at a time: ~5x faster than slicing in a loop."""
    out: list[bytes] = []
    whole, rest = divmod(count, _GROUP)
    if whole:
        unpack, width = _splitter(step, _GROUP).unpack_from, step * _GROUP
        for off in range(0, whole * width, width):
            out += unpack(data, off)
    if rest:
        out += _splitter(step, rest).unpack_from(data, whole * step * _GROUP)
    return out


def token_buffer(arr: array[int]) -> bytes | array[int]:
    """The little-endian bytes of an encoded token array as a buffer: the array itself on
    little-endian hosts (no copy), else ``token_bytes``."""
    return token_bytes(arr) if _SWAP else arr


def token_bytes(arr: array[int]) -> bytes:
    """The little-endian bytes of an encoded token array."""
    if _SWAP:  # pragma: no cover - big-endian hosts only
        arr = array(_TYPECODE, arr)
        arr.byteswap()
    return arr.tobytes()


def make_hash_fn(mode: str | HashFn, seed: int | bytes | None) -> tuple[HashFn, bytes]:
    """Return ``(digest, root)`` for a hash mode.

    ``"xxhash"``: xxh3-128, fast. With ``seed=None`` the seed is drawn at random per
    manager, so block ids cannot be predicted (and collisions cannot be prepared) from
    outside. ``"sha256"``: slower, cryptographic; ``seed=None`` means a fixed seed, so the
    ids are the same in every process and machine (for events, routers, shared stores).
    A callable ``bytes -> bytes`` is taken as is (tests use a deliberately colliding one).
    Raises ConfigError for an unknown mode, a callable that raises on bytes or does not
    return non-empty bytes (it is called once here), or a seed that is not int/bytes/None.
    """
    if seed is not None and not isinstance(seed, (int, bytes)) or isinstance(seed, bool):
        raise ConfigError(f"seed must be an int, bytes or None, got {seed!r}")
    if isinstance(seed, int):
        if seed < 0:
            raise ConfigError(f"seed must be >= 0, got {seed}")
        seed = seed.to_bytes((seed.bit_length() + 8) // 8, "little")
    name = mode if isinstance(mode, str) else None  # (no ``==`` on an array: no truth value)
    if name == "xxhash":
        fn: HashFn = xxhash.xxh3_128_digest
        seed_bytes = os.urandom(16) if seed is None else seed
    elif name == "sha256":
        fn = _sha256
        seed_bytes = b"prefixkv" if seed is None else seed
    elif name is None and callable(mode):
        fn = mode
        seed_bytes = b"" if seed is None else seed
    else:
        raise ConfigError(f"hash_mode must be 'xxhash', 'sha256' or a callable, got {mode!r}")
    try:  # a callable is probed here, once: it must take bytes and give bytes
        root = fn(b"prefixkv-root" + seed_bytes)
    except Exception as exc:
        raise ConfigError(f"the hash_mode callable raised {exc!r} on bytes (it must map "
                          f"bytes to non-empty bytes)") from exc
    if not isinstance(root, bytes) or not root:
        raise ConfigError(f"a hash_mode callable must return non-empty bytes, got {root!r}")
    return fn, root


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def chain(fn: HashFn, parent: bytes, data: bytes, extras: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
    """Hash ``len(extras)`` consecutive full blocks whose token bytes are ``data``, the
    first one's parent being ``parent``; ``extras[i]`` is block i's extra-key encoding.
    Returns ``(hashes, chunks)``: each block's digest and its token bytes."""
    if not extras:
        return [], []
    step = len(data) // len(extras)
    chunks = [data[o:o + step] for o in range(0, len(data), step)]
    return chain_hashes(fn, parent, chunks, extras), chunks


def chain_hashes(fn: HashFn, parent: bytes, chunks: Sequence[bytes],
                 extras: Sequence[bytes]) -> list[bytes]:
    """The digests of consecutive full blocks (token bytes ``chunks``, extra-key bytes
    ``extras``), the first one's parent being ``parent``: the one definition of the chain."""
    # (a plain loop: a walrus in a comprehension makes ``h`` a closure cell, ~1.5x slower)
    h = parent
    out: list[bytes] = []
    append = out.append
    if any(extras):
        for c, e in zip(chunks, extras, strict=True):
            h = fn(h + c + e)
            append(h)
        return out
    for c in chunks:  # the common case: no concatenation with b""
        h = fn(h + c)
        append(h)
    return out


def lookahead_bytes(extra: ExtraKeys | None, tokens: array[int], end: int, lookahead: int,
                    start: int = 0) -> bytes:
    """What follows the extra-key bytes of the block that ends at token ``end`` under
    lookahead keys (vLLM's ``num_hash_lookahead_tokens`` = ``lookahead``): the
    multimodal inputs of ``extra`` that start in ``[end, end + lookahead)`` (tagged as in
    ``ExtraKeys.block_bytes``: vLLM's extra keys of such a block cover that window too),
    then ``b"A" || lookahead:u32 || tokens[end:end + lookahead]`` (uint32 LE each: the
    last ``4 * lookahead`` bytes are the tokens). ``start``: the position of
    ``tokens[0]`` (``tokens`` a window of the request's from there)."""
    later = b""
    if extra is not None and extra.mm:
        later = b"".join(mm_bytes(m) for m in extra.mm if end <= m.offset < end + lookahead)
    return later + b"A" + struct.pack("<I", lookahead) + token_bytes(
        tokens[end - start:end - start + lookahead])


def block_hashes(
    token_ids: Sequence[int], block_size: int, *, hash_mode: str | HashFn = "sha256",
    seed: int | bytes | None = None, extra: object = None, hash_lookahead_tokens: int = 0,
) -> list[bytes]:
    """The chain hashes of the full blocks of ``token_ids``, exactly as a
    ``KVCacheManager(block_size=block_size, hash_mode=hash_mode, seed=seed)`` names them
    in its ``BlockStored`` events, so that a router can score a prompt it has never seen.

    The chain, for ``n = len(token_ids) // block_size`` full blocks (a partial last block
    has no hash)::

        seed_bytes  = seed as bytes: an int as little-endian in (bit_length + 8) // 8
                      bytes (0 -> b"\\x00"), bytes as given; None -> b"prefixkv" (sha256)
        root        = H(b"prefixkv-root" + seed_bytes)     # never sent: block 0's parent
        hash[0]     = H(root      + tokens[0:bs] as uint32 LE + extra_bytes[0])
        hash[i]     = H(hash[i-1] + tokens[i*bs:(i+1)*bs] as uint32 LE + extra_bytes[i])

    ``H`` is sha256 (32-byte digests) or xxh3-128 (16 bytes); ``extra_bytes[i]`` is the
    tagged encoding of ``extra`` for block i (``ExtraKeys.block_bytes``: LoRA, salt, and
    the multimodal inputs overlapping the block; empty when ``extra`` is None).

    With ``hash_lookahead_tokens`` = L > 0 (a ``LookaheadKVCacheManager``'s, vLLM's
    ``num_hash_lookahead_tokens``), ``extra_bytes[i]`` is followed by the multimodal
    inputs of ``extra`` that start in the L tokens after the block (tagged as
    ``ExtraKeys.block_bytes`` tags them), then ``b"A" || L:u32 ||
    tokens[(i+1)*bs:(i+1)*bs+L]`` (``lookahead_bytes``), and only the
    ``(len(token_ids) - L) // block_size`` blocks whose L following tokens are given have
    a hash.

    Returns one digest per full block (an empty list for fewer than ``block_size``
    tokens). Raises ConfigError for a ``block_size`` < 1, an unknown ``hash_mode``, a bad
    seed, or ``hash_mode="xxhash"`` without a seed (a manager draws a random one then,
    which no one outside can reproduce); TokenError for ids outside [0, 2**32);
    ExtraKeysError for malformed ``extra`` or a multimodal range past the prompt;
    ConfigError for a ``hash_lookahead_tokens`` that is not an int >= 0.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
    la = hash_lookahead_tokens
    if la.__class__ is not int or la < 0:
        raise ConfigError(f"hash_lookahead_tokens must be an int >= 0, got {la!r}")
    if hash_mode == "xxhash" and seed is None:
        raise ConfigError("hash_mode='xxhash' needs the manager's seed: without one each "
                          "manager draws a random seed that cannot be reproduced")
    fn, root = make_hash_fn(hash_mode, seed)
    arr = encode_tokens(token_ids)
    keys = check_extra(extra, len(arr))
    n = max(0, len(arr) - la) // block_size
    extras = keys.block_bytes(n, block_size) if keys is not None else [b""] * n
    if la:
        ends = range(block_size, (n + 1) * block_size, block_size)
        extras = [e + lookahead_bytes(keys, arr, end, la) for e, end in zip(extras, ends, strict=True)]
    return chain(fn, root, token_bytes(arr[:n * block_size]), extras)[0]
