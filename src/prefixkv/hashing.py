"""The hash chain that names full blocks, and the canonical token encoding.

    root        = H(seed)
    id(block 0) = H(root          || tokens[0:bs]       || extra_0)
    id(block i) = H(id(block i-1) || tokens[i*bs:(i+1)*bs] || extra_i)

Token ids are encoded once per prompt as uint32 little-endian; the parent digest and the
token chunk have fixed lengths, so the tagged extra bytes that follow are unambiguous.
The hash only nominates a block: the pool confirms a hit against the stored content.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Callable, Sequence

import xxhash

from .errors import ConfigError, TokenError
from .extra_keys import check_extra

HashFn = Callable[[bytes], bytes]

_TYPECODE = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder != "little"


def encode_tokens(token_ids: Sequence[int], vocab_size: int | None = None) -> array:
    """Encode token ids as a uint32 array (the canonical form, also kept as the request's
    token store). Raises TokenError for an id outside [0, 2**32) or >= ``vocab_size``,
    or a non-integer."""
    try:
        if isinstance(token_ids, list):
            arr = array(_TYPECODE)
            arr.fromlist(token_ids)  # faster than array(typecode, list)
        else:
            arr = array(_TYPECODE, token_ids)
    except (OverflowError, TypeError) as exc:
        raise TokenError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if vocab_size is not None and arr and max(arr) >= vocab_size:
        raise TokenError(f"token id {max(arr)} is >= vocab_size {vocab_size}")
    return arr


def token_bytes(arr: array) -> bytes:
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
    Raises ConfigError for an unknown mode, a callable that does not return non-empty
    bytes, or a seed that is not int/bytes/None.
    """
    if seed is not None and not isinstance(seed, (int, bytes)) or isinstance(seed, bool):
        raise ConfigError(f"seed must be an int, bytes or None, got {seed!r}")
    if isinstance(seed, int):
        if seed < 0:
            raise ConfigError(f"seed must be >= 0, got {seed}")
        seed = seed.to_bytes((seed.bit_length() + 8) // 8, "little")
    if mode == "xxhash":
        fn: HashFn = xxhash.xxh3_128_digest
        seed_bytes = os.urandom(16) if seed is None else seed
    elif mode == "sha256":
        fn = _sha256
        seed_bytes = b"prefixkv" if seed is None else seed
    elif callable(mode):
        fn = mode
        seed_bytes = b"" if seed is None else seed
    else:
        raise ConfigError(f"hash_mode must be 'xxhash', 'sha256' or a callable, got {mode!r}")
    root = fn(b"prefixkv-root" + seed_bytes)
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
    h = parent
    if any(extras):
        hashes = [h := fn(h + c + e) for c, e in zip(chunks, extras)]
    else:  # the common case, kept free of per-block concatenation with b""
        hashes = [h := fn(h + c) for c in chunks]
    return hashes, chunks


def block_hashes(
    token_ids: Sequence[int], block_size: int, *, hash_mode: str | HashFn = "sha256",
    seed: int | bytes | None = None, extra: object = None,
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

    Returns one digest per full block (an empty list for fewer than ``block_size``
    tokens). Raises ConfigError for a ``block_size`` < 1, an unknown ``hash_mode``, a bad
    seed, or ``hash_mode="xxhash"`` without a seed (a manager draws a random one then,
    which no one outside can reproduce); TokenError for ids outside [0, 2**32);
    ExtraKeysError for malformed ``extra`` or a multimodal range past the prompt.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
    if hash_mode == "xxhash" and seed is None:
        raise ConfigError("hash_mode='xxhash' needs the manager's seed: without one each "
                          "manager draws a random seed that cannot be reproduced")
    fn, root = make_hash_fn(hash_mode, seed)
    arr = encode_tokens(token_ids)
    keys = check_extra(extra, len(arr))
    n = len(arr) // block_size
    extras = keys.block_bytes(n, block_size) if keys is not None else [b""] * n
    return chain(fn, root, token_bytes(arr[:n * block_size]), extras)[0]
