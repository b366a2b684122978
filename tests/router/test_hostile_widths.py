"""A hostile replica's wide fields: what one block may cost the router's memory.

``InProcessIndex`` caps the blocks one replica may have (``max_per_replica``) and its
doc prices a block at ~500 bytes, but the decoder took a bytes block hash of any width
and a ``medium`` name of any length, and the index keeps both per block. A replica
announcing blocks with 64 KiB hashes (or a 64 KiB medium name, a new str object per
event) grew the router by 64 KiB a block: at the cap that is 128 GiB, bounded by the
message cap only per message (found by wirefuzz-r16's hostile peers). No hash a
replica's manager makes is wider than 64 bytes (sha256 and vLLM's digests: 32; xxh3-128:
16; a 512-bit digest: 64) and no engine names a medium in more than a few characters,
so wider ones are bad batches now: counted, never indexed.
"""

import tracemalloc

import msgpack
import pytest

from prefixkv.router import DecodeError, Router, decode_batch
from prefixkv.router.decode import MAX_HASH_BYTES, MAX_MEDIUM_CHARS
from prefixkv.router.subscriber import Subscriber

BS = 4
WIDE = 64 << 10


def stored(hashes, medium="GPU"):
    return msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": hashes,
                                 "parent_block_hash": None, "token_ids": [],
                                 "block_size": BS, "medium": medium}], 0])


def hostile_batches(n):
    """``n`` batches of one block each: a wide hash, or a wide medium name."""
    for seq in range(n):
        if seq % 2:
            yield stored([seq.to_bytes(8, "big") * (WIDE // 8)])
        else:
            yield stored([seq], "M" * (WIDE - 1) + chr(65 + seq % 2))


def test_a_replica_of_wide_fields_costs_the_router_no_more_than_small_ones():
    router = Router(["r"], block_size=BS)
    sub = Subscriber(router, {"r": ("tcp://127.0.0.1:1", None)})
    try:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for seq, payload in enumerate(hostile_batches(64)):
            with sub.lock:
                sub._on_message("r", seq, payload, b"kv-events")
            del payload
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert grown < 64 * 2048, f"the index grew {grown} bytes for 64 blocks"
        assert router.index.num_blocks("r") == 0
        health = sub.health()
        assert health["counters"]["bad_batches"] == 64 and sub.errors == 0
    finally:
        tracemalloc.stop()
        sub.close()


@pytest.mark.parametrize("hashes, medium", [
    ([b"\x01" * (MAX_HASH_BYTES + 1)], "GPU"),
    ([1, 2, b"\x01" * (MAX_HASH_BYTES + 1)], "GPU"),
    ([1], "G" * (MAX_MEDIUM_CHARS + 1)),
])
def test_a_wide_hash_or_medium_is_a_decode_error(hashes, medium):
    with pytest.raises(DecodeError):
        decode_batch(stored(hashes, medium))
    removed = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": hashes,
                                    "medium": medium}], 0])
    with pytest.raises(DecodeError):
        decode_batch(removed)
    parent = msgpack.packb([1.0, [["BlockStored", [1], hashes[-1], [], BS, None, medium]]])
    with pytest.raises(DecodeError):
        decode_batch(parent)


def test_the_widest_hash_and_medium_are_decoded():
    wide = b"\x02" * MAX_HASH_BYTES
    _, events, _ = decode_batch(stored([wide, 3], "C" * MAX_MEDIUM_CHARS))
    assert events[0].hashes == (wide, 3) and events[0].medium == "C" * MAX_MEDIUM_CHARS
