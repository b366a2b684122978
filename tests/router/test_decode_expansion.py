"""How much memory one frame under ``max_message_bytes`` costs the subscriber once
msgpack unpacks it: ``decode_batch`` unpacks the whole payload (``msgpack.unpackb``,
whose length limits default to the frame's bytes) before it checks the shape, so every
container and element of the frame is built first. Real sockets on loopback: a PUB
sends the subscriber a 1 MiB frame (the cap 2 MiB); the subscriber's peak (tracemalloc)
while it reads and rejects it is measured (risks-r17: 64.5x the frame's bytes for empty
arrays, 72.5x for empty maps, 13.6x for a legal event of 349,525 token ids 300).
``MAXMSGSIZE`` and ``max_*_len`` limits bound one container or one frame, not the
number of containers in a frame; a decoder that skips the fields it does not read and
refuses a container where a scalar belongs (``Unpacker.read_array_header``/``skip``)
would bound it (open: docs/router.md)."""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest
import zmq

from prefixkv.router import Router
from prefixkv.router.subscriber import Subscriber
from waiting import await_subscribed, poll_until

BS = 4
N = 1 << 20


def peak_reading(payload: bytes) -> tuple[int, Subscriber]:
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    router = Router(["r"], block_size=BS)
    sub = Subscriber(router, {"r": (pub.getsockopt_string(zmq.LAST_ENDPOINT), None)},
                     max_message_bytes=2 * N)
    try:
        await_subscribed(sub)
        tracemalloc.start()
        pub.send_multipart((b"kv-events", (0).to_bytes(8, "big"), payload))
        assert poll_until(sub, lambda: sub.bad_batches + router.index.num_blocks("r") > 0)
        return tracemalloc.get_traced_memory()[1], sub
    finally:
        tracemalloc.stop()
        sub.close()
        pub.close(linger=0)


def test_a_legal_frame_is_read():
    payload = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [7, 8],
                                    "parent_block_hash": None, "token_ids": [300] * 8,
                                    "block_size": BS}], 0])
    peak, sub = peak_reading(payload)
    assert sub.bad_batches == 0


@pytest.mark.xfail(strict=True, reason="decode_batch builds every container of a frame "
                   "before checking it: a frame of empty arrays costs ~64x its bytes")
@pytest.mark.parametrize("filler", [[], {}])
def test_a_frame_of_empty_containers_costs_at_most_16_times_its_bytes(filler):
    payload = msgpack.packb([1.0, [filler] * (N - 16)])
    assert len(payload) <= N
    peak, sub = peak_reading(payload)
    assert sub.bad_batches == 1
    assert peak < 16 * len(payload), f"{peak:,} bytes at the peak for a frame of {len(payload):,}"
