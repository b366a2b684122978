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

import struct
import tracemalloc

import msgpack
import pytest
import zmq

from prefixkv.fleet.replay import MAX_REQUEST_BYTES
from prefixkv.fleet.replay import _request as replay_request
from prefixkv.router import Router, decode_batch
from prefixkv.router.decode_large import STREAM_FROM
from prefixkv.router.replay_client import ReplayError, read_reply
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


# ---- payloads under 64 KiB (fleet-r18) ------------------------------------------------

def decode_peak(read, payload: bytes) -> int:
    """tracemalloc's peak while ``read(payload)`` runs (what it raises ignored)."""
    tracemalloc.start()
    try:
        try:
            read(payload)
        except Exception:
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def nested_headers(size: int, depth: int = 1000) -> bytes:
    """A KVEventBatch's first bytes, then ``depth`` array32 headers each announcing
    ``size`` items, padded to ``size`` bytes: the items are not there."""
    head = b"\x93\xcb" + struct.pack(">d", 1.0) + (b"\xdd" + struct.pack(">I", size)) * depth
    return (head + b"\0" * size)[:size]


def test_nested_headers_announcing_missing_items_cost_nothing():
    """``unpackb`` allocated each header's item slots before finding them missing: 80 MB
    (1,340x) for this 60,000-byte frame, under the 64 KiB from which payloads were read
    field by field."""
    payload = nested_headers(60_000)
    assert decode_peak(decode_batch, payload) < 3 * len(payload)
    small = nested_headers(STREAM_FROM - 1, 500)  # (the whole check, then unpackb)
    assert decode_peak(decode_batch, small) < 3 * len(small) + 4096


@pytest.mark.parametrize("filler", [[], {}, [-7], "ab"])
def test_a_frame_just_under_64_kib_costs_little_more_than_its_bytes(filler):
    """Read whole by ``unpackb`` below 64 KiB, a frame of empty maps cost 73x its bytes
    (4.4 MB for 61 KB); from ``STREAM_FROM`` (8 KiB) on it is read field by field."""
    payload = msgpack.packb([1.0, [filler] * (61_000 // len(msgpack.packb(filler))), 0])
    assert STREAM_FROM <= len(payload) < 1 << 16
    assert decode_peak(decode_batch, payload) < 3 * len(payload)


def test_below_stream_from_the_cost_is_bounded_in_bytes():
    """The rest: a frame under ``STREAM_FROM`` is unpacked whole, at most ~73x its bytes
    (its empty maps), 0.6 MB at most, whatever it holds."""
    for filler in ([], {}, [-7]):
        payload = msgpack.packb([1.0, [filler] * ((STREAM_FROM - 16) // len(msgpack.packb(
            filler))), 0])
        assert len(payload) < STREAM_FROM
        assert decode_peak(decode_batch, payload) < 80 * STREAM_FROM


def test_a_replay_answer_of_nested_headers_costs_nothing():
    """``{"next": [[[...`` 1,000 array32 headers announcing 8,000 items: 64 MB (8,000x) in
    ``unpackb``, the client's read of an answer under 64 KiB."""
    answer = b"\x81\xa4next" + (b"\xdd" + struct.pack(">I", 8000)) * 1000 + b"\0" * 3000
    assert len(answer) < STREAM_FROM
    assert decode_peak(read_reply, answer) < 64 * 1024
    with pytest.raises(ReplayError):
        read_reply(answer)


def test_a_replay_request_of_nested_headers_costs_the_publisher_nothing():
    """What a peer sends the publisher's replay socket, at most ``MAX_REQUEST_BYTES``: 204
    nested array32 headers announcing 1,000 items cost 1.6 MB in ``unpackb``; now the
    check's ``Unpacker`` (its stack, ~40 KB)."""
    body = (b"\xdd" + struct.pack(">I", 1000)) * (MAX_REQUEST_BYTES // 5)
    assert decode_peak(replay_request, body) < 64 * 1024
    assert replay_request(body) is None
    assert replay_request(msgpack.packb({"start_seq": 5})) == (None, 5, False)
