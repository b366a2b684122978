"""Small frozen result types of plain ints handed back to the engine, and the KV
operations it runs for the manager."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class _HasBlockId(Protocol):
    """What an admission reads of the manager's blocks (``core.block.Block``)."""

    @property
    def block_id(self) -> int: ...


class Admission:
    """A request admitted by ``add_request``.

    ``block_ids``: the request's blocks in order (cached prefix first), built when first
    read. ``group_block_ids``: the same, per layer group (one group today).
    ``num_cached_tokens``: prompt tokens whose KV is already in those blocks (a multiple
    of block_size, and always < the prompt length). ``num_new_tokens``: tokens scheduled
    now, whose KV the engine computes in this step (positions ``num_cached_tokens`` to
    ``num_cached_tokens + num_new_tokens - 1``).
    """

    __slots__ = ("request_id", "num_cached_tokens", "num_new_tokens", "_blocks", "_n", "_ids")
    request_id: Hashable
    num_cached_tokens: int
    num_new_tokens: int
    _blocks: Sequence[_HasBlockId] | None
    _n: int  # how many of ``_blocks`` are this admission's (set by ``of``)
    _ids: tuple[int, ...] | None

    def __init__(self, request_id: Hashable, block_ids: Sequence[int], num_cached_tokens: int,
                 num_new_tokens: int) -> None:
        self.request_id = request_id
        self.num_cached_tokens = num_cached_tokens
        self.num_new_tokens = num_new_tokens
        self._blocks = None
        self._ids = tuple(block_ids)

    @classmethod
    def of(cls, request_id: Hashable, blocks: Sequence[_HasBlockId], num_cached_tokens: int,
           num_new_tokens: int) -> Admission:
        """An admission over the first ``len(blocks)`` of the request's block list, whose
        ids are read on demand: the manager only appends to that list, so its first
        entries stay what they are now (no copy is made)."""
        return admission_of(request_id, blocks, num_cached_tokens, num_new_tokens)

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The request's block ids in token order (cached prefix first)."""
        if self._ids is None:
            assert self._blocks is not None, "an admission holds its ids or its blocks"
            self._ids = tuple([b.block_id for b in self._blocks[:self._n]])
            self._blocks = None
        return self._ids

    def block_ids_from(self, first: int) -> tuple[int, ...]:
        """``block_ids[first:]`` (``first`` >= 0), without listing the ids before
        ``first`` when ``block_ids`` has not been read: e.g. the blocks past a hit of
        ``first`` blocks, where a long hit's ids are not wanted."""
        if self._ids is not None:
            return self._ids[first:]
        assert self._blocks is not None, "an admission holds its ids or its blocks"
        return tuple([b.block_id for b in self._blocks[first:self._n]])

    @property
    def group_block_ids(self) -> tuple[tuple[int, ...], ...]:
        """``block_ids`` per layer group, in group order (one group today)."""
        return (self.block_ids,)

    def _astuple(self) -> tuple[Any, ...]:
        return (self.request_id, self.block_ids, self.num_cached_tokens, self.num_new_tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Admission) and self._astuple() == other._astuple()

    def __hash__(self) -> int:
        return hash(self._astuple())

    def __repr__(self) -> str:
        return (f"Admission(request_id={self.request_id!r}, block_ids={self.block_ids}, "
                f"num_cached_tokens={self.num_cached_tokens}, "
                f"num_new_tokens={self.num_new_tokens})")


class _Admitted(Admission):
    """An ``Admission`` as ``admission_of`` makes it: called with no argument, it runs
    no ``__init__`` of Python (``object.__init__``, the C slot: the call is ``type_call``,
    ``object_new``, ``object_init``, paths the step runs anyway for its ``Request``),
    where ``object.__new__(Admission)`` parses an argument tuple in C paths of its own
    (``tp_new_wrapper``, ``PyTuple_GetSlice``: cold after the forward pass;
    benchmarks/results/events-r23.md). An ``Admission`` in every other way."""

    __slots__ = ()
    __init__ = object.__init__


def admission_of(request_id: Hashable, blocks: Sequence[_HasBlockId], num_cached_tokens: int,
                 num_new_tokens: int) -> Admission:
    """``Admission.of``, as a function: the manager's admission path calls it so (a
    classmethod called makes a bound method, ``cm_descr_get``, ``PyMethod_New``: C paths
    cold after the forward pass). The admission is an ``Admission`` of a private
    subclass (``_Admitted``: made with no ``__init__`` run)."""
    adm: Admission = _Admitted()
    adm.request_id = request_id
    adm.num_cached_tokens = num_cached_tokens
    adm.num_new_tokens = num_new_tokens
    adm._blocks = blocks
    adm._n = len(blocks)
    adm._ids = None
    return adm


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy the KV of block ``src`` into block ``dst`` (all block_size slots) before the
    next forward pass."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class BlockOffloads:
    """Copy device block ``src[i]`` into host slot ``dst[i]``, for each i in order, before
    the next forward pass (which may overwrite each ``src``: the pool just handed it to
    another request): every offload of a step in one op (the content of evicted blocks,
    kept in host memory). ``src`` and ``dst`` are equally long (at least 1). One op for the
    step, not one per block: an eviction of n blocks adds n ints to each list, not n
    objects."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockLoads:
    """Copy host slot ``src[i]`` into device block ``dst[i]``, for each i in order, before
    the next forward pass: every load of a step in one op (prefixes found in host memory;
    each ``dst`` is then read as cached KV). ``src`` and ``dst`` are equally long (at
    least 1). One op for the step, not one per block: its ids go to a transfer call as
    two index lists, and an admission of n host hits adds n ints to them, not n objects."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclass(frozen=True, slots=True, repr=False)
class StorePut:
    """Write device block ``src`` to the shared store, before the next forward pass
    (its KV was computed by an earlier step's): read its KV bytes (all layers, the
    ``StoreLayout``'s ``block_bytes``) now, and store ``encode_value(head, payload)``
    under ``key``, synchronously or from another thread (``StoreWriter``)."""

    src: int
    key: bytes
    head: bytes

    def __repr__(self) -> str:
        return f"StorePut(src={self.src}, key={self.key!r}, head=<{len(self.head)} bytes>)"


@dataclass(frozen=True, slots=True, repr=False)
class StoreFetched:
    """Write ``payload`` (a block's KV bytes, all layers, fetched from the shared store
    and checked) into host slot ``dst``, before the loads of the same plan (one of them
    copies ``dst`` into a device block). Stated only when the engine did not attach its
    host slots' memory (``KVCacheManager.attach_host_memory``): with it, a fetch reads
    straight into the slot and no op is needed. ``payload`` is a read-only view of the
    manager's staging memory for that slot: run the plan before the next scheduling call
    (a later fetch may write there)."""

    dst: int
    payload: bytes | memoryview

    def __repr__(self) -> str:
        return f"StoreFetched(dst={self.dst}, payload=<{len(self.payload)} bytes>)"


@dataclass(frozen=True, slots=True)
class StoreWait:
    """``add_request``'s answer when the request's prefix continues past the device and
    host into the shared store and a fetch of up to ``num_blocks`` blocks started (vLLM's
    WAITING_FOR_REMOTE_KVS). Nothing is held for the request and nothing was counted: the
    engine keeps it waiting and calls ``add_request`` again, with the same arguments, once
    ``poll_store()`` has listed its id (a call before that returns this again). That
    admission finds what arrived, checked, in host slots and loads it; a fetch that
    failed, timed out or lost a race leaves those tokens to compute. ``free(request_id)``
    abandons the wait."""

    request_id: Hashable
    num_blocks: int


KVOp = BlockOffloads | StorePut | StoreFetched | BlockLoads | BlockCopy
"""A KV operation the engine runs before the next forward pass (``take_kv_ops()``), in
the order given: the offloads, every store write, every store fetch, the loads, then
every copy."""


@dataclass(frozen=True, slots=True)
class Fork:
    """A child created by ``fork``: its blocks, and the copies the engine must make
    (copy-on-write of the parent's partial last block; empty when there is none)."""

    request_id: Hashable
    block_ids: tuple[int, ...]
    copies: tuple[BlockCopy, ...]


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """What ``append_step`` did. ``grown``: ``(request_id, new block ids)`` for each
    request that took a new block. ``short``: requests that needed a block and could not
    get one; they are unchanged (their token was not appended)."""

    grown: tuple[tuple[Hashable, tuple[int, ...]], ...]
    short: tuple[Hashable, ...]


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Requests of a batch that hold the same first ``num_blocks`` blocks (the same
    physical ids, so the same KV): ``members`` are their positions in the list of request
    ids asked about (at least two). Cascade attention reads those blocks once per group
    (``prefixkv.kernels.build_cascade_batch``)."""

    num_blocks: int
    members: tuple[int, ...]
