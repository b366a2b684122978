"""How much memory one frame under ``max_message_bytes`` costs the subscriber once
decoded. ``decode_batch`` unpacked the whole payload (``msgpack.unpackb``, whose length
limits default to the frame's bytes) before it checked the shape, so every container and
element of the frame was built first: on loopback, a PUB sending the subscriber a 1 MiB
frame of empty arrays (the cap 2 MiB) made its peak (tracemalloc) 68.7 MB, 65x the
frame, and one of empty maps 77.1 MB, 73x (risks-r17; a legal event's uint16 token ids,
which the router does not read, 13.6x). ``MAXMSGSIZE`` and ``max_*_len`` limits bound
one frame or one container, not the number of containers in a frame; a payload of
``decode_large.STREAM_FROM`` bytes or more is now read field by field, unread fields
skipped unbuilt and a container where a scalar belongs refused at once."""

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


@pytest.mark.parametrize("filler", [[], {}])
def test_a_frame_of_empty_containers_costs_at_most_three_times_its_bytes(filler):
    """The frame read from the socket (1x) and the decoder's copy of it (1x), little more."""
    payload = msgpack.packb([1.0, [filler] * (N - 16)])
    assert len(payload) <= N
    peak, sub = peak_reading(payload)
    assert sub.bad_batches == 1
    assert peak < 3 * len(payload), f"{peak:,} bytes at the peak for a frame of {len(payload):,}"
