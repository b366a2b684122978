"""``Prompt``: a prompt checked, encoded and cut into blocks once, off the scheduler's thread.

Everything admission does to a prompt that does not depend on the pool is done here, by
``KVCacheManager.prepare`` (or ``HybridKVCacheManager.prepare``), on any thread: the
checks (``TokenError``, ``ExtraKeysError``), the canonical encoding, the block chunks,
the request's extra-key bytes and, when the manager consumes them as blocks are stored,
the chain hashes of the full blocks. ``add_request`` then takes the result where it takes
token ids and does only the work that needs the pool. vLLM does the same where a request
enters the engine: its ``Request`` hashes its blocks on the engine's input thread.

A prepared prompt is tied to its manager's configuration (block size, vocabulary size,
hash function and seed), never to its state: it stays valid while the cache changes, and
may be admitted any number of times (n > 1 sampling, re-admission after preemption, a
``StoreWait`` retried), each admission with its own copy of the tokens. The first
admission's copy is made here too (``spare``): the request owns its token array, which
decoding appends to, and copying a prompt is work that does not depend on the pool.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

from ..chunks import Chunks
from ..errors import PromptError, TokenError
from ..extra_keys import ExtraKeys, check_extra
from ..hashing import block_chunks, encode_tokens, token_buffer, token_bytes
from ..index.hasher import Hasher
from .block import blocks_for
from .request import GROW_AT, PLAIN_KEYS, RequestKeys, grow_room

# A prompt of this many full blocks or more has its chunks cut as they are read: a miss
# reads few of them (2,048 cut up front were ~30 us of a 32k miss, ``miss2x-r13b.md``);
# below it a list costs less to read than the ``Chunks`` calls (~5 us a 2k hit's)
CUT_LATE = 512


class Prompt:
    """A prompt prepared by a manager's ``prepare``: pass it to that manager's
    ``add_request``, ``lookup`` or ``lookup_block_ids`` in place of the token ids.

    Immutable (attributes cannot be set; the arrays and lists it holds are never written
    by prefixkv, and must not be by anyone, but ``spare``: an iterator over the copy of
    the tokens that the first admission takes for its request, ``_give_back`` replacing
    it). Read ``token_ids``, ``extra``, ``block_hashes`` and ``len()``; the other
    attributes are the manager's.
    """

    __slots__ = ("tokens", "keys", "chunks", "extras", "data", "hashes", "config", "spare")

    tokens: array[int]
    keys: RequestKeys
    chunks: list[bytes]
    extras: list[bytes]
    data: bytes
    hashes: list[bytes] | None
    config: tuple[Hashable, ...]
    spare: Iterator[array[int]]

    def __init__(self, tokens: array[int], keys: RequestKeys, chunks: list[bytes],
                 hashes: list[bytes] | None, config: tuple[Hashable, ...],
                 extras: list[bytes] | None = None) -> None:
        # ``spare``: an iterator over a copy of ``tokens`` (with room to grow when long,
        # as ``grow_room`` leaves it) that the first admission takes for its request
        # (``for tokens in p.spare: break``: one taker, whatever the threads, each step of
        # an iterator being one opcode, ``FOR_ITER``, with no call: ``list.pop``'s C path
        # was cold in an admission, benchmarks/results/events-r24.md); later admissions
        # copy ``tokens``
        spare = array(tokens.typecode, tokens)
        if len(spare) >= GROW_AT:
            grow_room(spare)
        # ``data``: the tokens' bytes in one piece, which ``chunks`` cut (``Index.claim``
        # compares a run of cached blocks with it as one memcmp); ``extras``: each full
        # block's extra-key bytes (``add_request`` slices them: no list made by ``*``;
        # given by ``prepare_prompt``, which hashes with them)
        if extras is None:
            extras = keys.of_blocks(0, len(chunks))
        for name, value in (("tokens", tokens), ("keys", keys), ("chunks", chunks),
                            ("extras", extras),
                            ("data", token_bytes(tokens)), ("hashes", hashes),
                            ("config", config), ("spare", iter((spare,)))):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Prompt is immutable (cannot set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a Prompt is immutable (cannot delete {name!r})")

    def __len__(self) -> int:
        return len(self.tokens)

    def _give_back(self, tokens: array[int]) -> None:
        """Make ``tokens``, a spare this prompt gave that its admission did not write
        (the pool was short), the next admission's. (Two threads giving back at once
        leave one of them: the next admission then copies, as a later one does.)"""
        object.__setattr__(self, "spare", iter((tokens,)))

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The prompt's token ids (a new tuple each call)."""
        return tuple(self.tokens)

    @property
    def extra(self) -> ExtraKeys | None:
        """The extra keys it was prepared with (checked), or None."""
        return self.keys.extra

    @property
    def block_hashes(self) -> tuple[bytes, ...] | None:
        """The chain hashes of its full blocks when its manager consumes them as blocks
        are stored (a shared store, a host tier with events on, a caller's hash callable
        with events on), else None: computed then only where needed, or by the event
        publisher's thread."""
        return None if self.hashes is None else tuple(self.hashes)

    def __repr__(self) -> str:
        return (f"Prompt({len(self.tokens)} tokens, {len(self.chunks)} full blocks, "
                f"hashed={self.hashes is not None})")


def encode_prompt(token_ids: Sequence[int], extra: ExtraKeys | None, block_size: int,
                  vocab_size: int | None, grow: bool = False
                  ) -> tuple[array[int], RequestKeys, Sequence[bytes]]:
    """Check and encode a prompt: its tokens, keys and full blocks' token bytes: from
    ``CUT_LATE`` full blocks on, a ``Chunks`` (cut as they are read; ``Chunks.buf`` is
    all the tokens' bytes), else a list. ``grow``: a long token array is grown
    (``grow_room``) first, before its bytes are copied out (grown after, it is moved:
    ~60 us a 32k hit, measured). Raises TokenError (empty prompt, bad ids or
    container), ExtraKeysError."""
    tokens = encode_tokens(token_ids, vocab_size)
    n = len(tokens)
    if n == 0:
        raise TokenError("the prompt is empty: at least one token is needed")
    keys = PLAIN_KEYS if extra is None else RequestKeys.of(check_extra(extra, n),
                                                           blocks_for(n, block_size), block_size)
    if grow and n >= GROW_AT:
        grow_room(tokens)
    full = n // block_size
    if full < CUT_LATE:
        return tokens, keys, block_chunks(token_buffer(tokens), 4 * block_size, full)
    return tokens, keys, Chunks(token_bytes(tokens), 4 * block_size, 0, full)


def prepare_prompt(token_ids: Sequence[int], extra: ExtraKeys | None, block_size: int,
                   vocab_size: int | None, hasher: Hasher | None,
                   config: tuple[Hashable, ...]) -> Prompt:
    """``encode_prompt`` and, when ``hasher`` is given, the chain hashes of every full
    block from the root. Reads only its arguments: safe on any thread. Raises as
    ``encode_prompt``, PromptError for a ``Prompt`` (already prepared), ConfigError (a
    hash_mode callable failed)."""
    if isinstance(token_ids, Prompt):
        raise PromptError("this prompt is prepared already: pass the Prompt itself")
    tokens, keys, cut = encode_prompt(token_ids, extra, block_size, vocab_size)
    chunks = list(cut)  # (a prepared prompt's are cut here, off the scheduler's thread)
    extras = keys.of_blocks(0, len(chunks))
    hashes = hasher.chain(hasher.root, chunks, extras) if hasher is not None else None
    return Prompt(tokens, keys, chunks, hashes, config, extras)


def unpack_prompt(prompt: Prompt, extra: ExtraKeys | None,
                  config: tuple[Hashable, ...]) -> Prompt:
    """``prompt``, checked against the admitting manager's ``config`` and ``extra``
    (which must be None). Raises PromptError; changes nothing."""
    if prompt.config is not config and prompt.config != config:
        raise PromptError(f"this Prompt was prepared by a manager of another configuration: "
                          f"{config_difference(prompt.config, config)}; prepare it with the "
                          f"manager that admits it, or one of equal configuration")
    if extra is not None:
        raise PromptError("extra= given with a Prompt: its extra keys were given to prepare()")
    return prompt


def config_difference(theirs: tuple[Hashable, ...], ours: tuple[Hashable, ...]) -> str:
    """What differs between two managers' prompt configurations ``(block_size,
    vocab_size, hash function, chain root)``, in words, for a PromptError."""
    parts = [f"{name} {a!r} where this manager has {b!r}"
             for name, a, b in (("block_size", theirs[0], ours[0]),
                                ("vocab_size", theirs[1], ours[1])) if a != b]
    if theirs[2] != ours[2]:
        parts.append("another hash_mode (the chain hash names blocks differently)")
    elif theirs[3] != ours[3]:
        parts.append("another chain seed (hash_mode='xxhash' without seed= draws a random "
                     "one per manager: give every manager the same seed=)")
    return "; ".join(parts)
