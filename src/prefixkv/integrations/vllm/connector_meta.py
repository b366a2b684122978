"""What the scheduler side of ``PrefixKVConnector`` tells the workers each step.

A ``BlockRun`` names consecutive full blocks of one request by everything a worker needs
to find and check them in the store without the request: their prefixkv chain hashes,
the parent hash of the first, their token bytes and extra-key bytes (the content check)
and the request's cache salt and the scheduler's reset tag (the key), with the device block ids they are
read from or written into. Plain bytes, ints and strs: vLLM sends the metadata to the
worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class BlockRun:
    """Blocks ``block_ids[i]`` of request ``req_id`` hold content ``hashes[i]`` (token
    bytes ``chunks[i]``, extra-key bytes ``extras[i]``); ``parent``: the chain hash
    before ``hashes[0]``; ``salt``: the request's cache salt (None: none); ``tag``: what
    the blocks' keys carry after the namespace, the ``store.link.reset_tag`` of the
    scheduler's resets when it stated the run (b"" before any)."""

    req_id: str
    salt: str | None
    parent: bytes
    hashes: tuple[bytes, ...]
    chunks: tuple[bytes, ...]
    extras: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    tag: bytes = b""

    def parents(self) -> list[bytes]:
        """The parent chain hash of each block."""
        return [self.parent, *self.hashes[:-1]]


@dataclass
class PrefixKVConnectorMetadata(KVConnectorMetadata):
    """One step's work: ``loads`` (asynchronous, from the store into fresh blocks of
    requests waiting for them), ``saves`` (blocks the step's forward pass completes, into
    the store) and ``finals`` (a finished request's last blocks, whose free waits until
    the workers report the request sent)."""

    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)
    finals: list[BlockRun] = field(default_factory=list)
