"""A publisher's message of many frames, each under ``max_message_bytes``: ZeroMQ's
``MAXMSGSIZE`` caps a frame, not a message, so the subscriber read all of them into one
Python list (``recv_multipart``) before it could count the message as bad: a copy of
the whole message beside ZeroMQ's own (found by wirefuzz-r16: 200 MB in 50,000 frames of
4,000 bytes read whole with ``max_message_bytes=4096``; the reading process's peak grew
385 MB while ZeroMQ held it, 579 MB once read). It keeps ``frames.MAX_FRAMES`` frames
now and drops the rest unread into Python. (ZeroMQ itself still holds a message whole
before any of it can be read: no socket option bounds a message's frames; docs/router.md.)
"""

import tracemalloc

import msgpack
import zmq

from prefixkv.router import Router
from prefixkv.router.frames import MAX_FRAMES
from prefixkv.router.subscriber import Subscriber
from waiting import await_subscribed, poll_until

BS = 4


def test_a_message_of_many_frames_is_not_copied_whole():
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.set_hwm(0)
    pub.bind("tcp://127.0.0.1:*")
    router = Router(["r"], block_size=BS)
    sub = Subscriber(router, {"r": (pub.getsockopt_string(zmq.LAST_ENDPOINT), None)},
                     max_message_bytes=4096)
    frame = b"k" * 4000
    try:
        await_subscribed(sub)
        pub.send(b"kv-events", zmq.SNDMORE)
        for _ in range(2000):  # 8 MB in one message
            pub.send(frame, zmq.SNDMORE)
        pub.send(frame)
        good = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [7, 8],
                                     "parent_block_hash": None, "token_ids": [],
                                     "block_size": BS}], 0])
        pub.send_multipart((b"kv-events", (0).to_bytes(8, "big"), good))
        tracemalloc.start()
        assert poll_until(sub, lambda: router.index.num_blocks("r") == 2)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < (MAX_FRAMES + 64) * 4096, f"{peak} bytes read for one bad message"
        assert sub.bad_batches == 1 and sub.errors == 0
    finally:
        tracemalloc.stop()
        sub.close()
        pub.close(linger=0)
