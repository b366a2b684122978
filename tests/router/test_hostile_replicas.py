"""Hostile replicas over real ZeroMQ on loopback, checked against a reference index
built from their valid batches only (wirefuzz-r16).

Three replicas, each its own PUB socket, send Hypothesis-drawn streams: valid batches
(stores, removals, clears of a small pool of hashes on two media, some stating another
block size), undecodable payloads in their place in the numbering (garbage, truncated
msgpack, wrong field types, hashes too wide, a medium name too long), messages of the
wrong frame shape, frames of another topic, and a batch sent again under its number.
Whatever they send, the subscriber must go on, count each, and hold for each replica
exactly what its valid batches say: an undecodable batch is lost (``lossy``), a frame
of another shape or topic changes nothing, a number sent again is a restart (the index
forgotten, then the batch applied; from a number above 0, a resync too), a block of
another size is not indexed.
No replay endpoints: what the numbering alone decides.
"""

import time

import msgpack
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.router import Router
from prefixkv.router.decode import MAX_HASH_BYTES, MAX_MEDIUM_CHARS
from prefixkv.router.subscriber import Subscriber
from waiting import PATIENCE, await_subscribed

BS = 4
TOPIC = b"kv-events"
REPLICAS = ("a", "b", "c")
hashes = st.lists(st.integers(0, 11), min_size=1, max_size=4)
media = st.sampled_from(["GPU", "CPU"])
stored = st.builds(lambda h, m, bs: {"type": "BlockStored", "block_hashes": h,
                                      "parent_block_hash": None, "token_ids": [],
                                      "block_size": bs, "medium": m},
                   hashes, media, st.sampled_from([BS, BS, None, 2 * BS]))
removed = st.builds(lambda h, m: {"type": "BlockRemoved", "block_hashes": h, "medium": m},
                    hashes, media)
cleared = st.just({"type": "AllBlocksCleared"})
events = st.lists(stored | stored | removed | cleared, max_size=4)
GARBAGE = [b"", b"\xc1", b"\x93\x01", msgpack.packb([1.0, [{"type": "BlockStored"}]]),
           msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [-1]}]]),
           msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1.5]}]]),
           msgpack.packb([1.0, [{"type": "BlockStored",
                                 "block_hashes": [b"\x01" * (MAX_HASH_BYTES + 1)]}]]),
           msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1],
                                 "medium": "G" * (MAX_MEDIUM_CHARS + 1)}]]),
           msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                 "medium": ["GPU"]}]]),
           msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                 "block_size": -1}]]),
           msgpack.packb([1.0, [["NoSuchEvent", [1]]]]), msgpack.packb("kv"),
           msgpack.packb([float("nan"), [], "rank"]), msgpack.packb([1.0, {}, 0])]
SHAPES = [(TOPIC,), (TOPIC, b"\x00" * 7, b""), (TOPIC, b"\x00" * 9, b""),
          (TOPIC, b"\x00" * 8, b"", b"")]
steps = st.lists(st.tuples(st.just("valid"), events)
                 | st.tuples(st.just("garbage"), st.sampled_from(GARBAGE))
                 | st.tuples(st.just("shape"), st.sampled_from(SHAPES))
                 | st.tuples(st.just("foreign"), events)
                 | st.tuples(st.just("again"), st.none()), max_size=10)


def apply_reference(held, evs):
    """What a replica holds after ``evs`` (valid, decoded as sent): hash -> media."""
    for ev in evs:
        if ev["type"] == "AllBlocksCleared":
            held.clear()
        elif ev["type"] == "BlockRemoved":
            for h in ev["block_hashes"]:
                held.get(h, set()).discard(ev["medium"])
                if not held.get(h, True):
                    del held[h]
        elif ev["block_size"] in (None, BS):
            for h in ev["block_hashes"]:
                held.setdefault(h, set()).add(ev["medium"])


def indexed(router, replica):
    holders = router.index._holders
    return {h: set(by[replica]) for h, by in holders.items() if replica in by}


@settings(max_examples=25, deadline=None)
@given(streams=st.tuples(steps, steps, steps))
def test_hostile_replicas_leave_each_index_as_its_valid_batches_say(streams):
    ctx = zmq.Context.instance()
    pubs = {}
    try:
        for r in REPLICAS:
            pubs[r] = ctx.socket(zmq.PUB)
            pubs[r].bind("tcp://127.0.0.1:*")
        router = Router(list(REPLICAS), block_size=BS)
        sub = Subscriber(router, {r: (p.getsockopt_string(zmq.LAST_ENDPOINT), None)
                                  for r, p in pubs.items()})
        try:
            await_subscribed(sub)
            sent_total = 0
            expect, last = {}, {}
            counts = dict.fromkeys(("bad", "lossy", "foreign", "restarts", "resyncs"), 0)
            for r, stream in zip(REPLICAS, streams, strict=True):
                held, seq, ts, sent = {}, 0, 1.0, None
                # first a valid batch: a replica's origin is its first applied batch's
                for kind, arg in [("valid", [])] + list(stream):
                    if kind == "valid" or kind == "foreign":
                        ts += 1.0
                        payload = msgpack.packb([ts, arg, 0])
                        if kind == "foreign":  # another topic: changes nothing
                            pubs[r].send_multipart((TOPIC + b"-x", seq.to_bytes(8, "big"),
                                                    payload))
                            counts["foreign"] += 1
                            continue
                        pubs[r].send_multipart((TOPIC, seq.to_bytes(8, "big"), payload))
                        apply_reference(held, arg)
                        sent, seq = (seq, payload, arg), seq + 1
                    elif kind == "garbage":  # lost in its place in the numbering
                        pubs[r].send_multipart((TOPIC, seq.to_bytes(8, "big"), arg))
                        counts["bad"] += 1
                        counts["lossy"] += 1
                        seq += 1
                    elif kind == "shape":
                        pubs[r].send_multipart(arg)
                        counts["bad"] += 1
                    elif sent is not None:  # the last valid batch again, under its number
                        again, payload, evs = sent
                        pubs[r].send_multipart((TOPIC, again.to_bytes(8, "big"), payload))
                        counts["restarts"] += 1  # (a number not above the last applied)
                        counts["resyncs"] += again > 0  # (then a gap from 0: followed)
                        held.clear()
                        apply_reference(held, evs)
                        seq = again + 1
                ts += 1.0
                pubs[r].send_multipart((TOPIC, seq.to_bytes(8, "big"),
                                        msgpack.packb([ts, [], 0])))
                expect[r], last[r] = held, seq
                sent_total += len(stream) + 2  # (with the first batch and the last)
            # every message sent is one handled (a last_seq may come back: no mark by it)
            deadline, handled = time.monotonic() + PATIENCE, 0
            while handled < sent_total and time.monotonic() < deadline:
                handled += sub.poll(0.05)
            assert handled == sent_total and sub.last_seq == last
            for r in REPLICAS:
                assert indexed(router, r) == expect[r], r
            assert sub.errors == 0 and sub.resyncs == counts["resyncs"]
            assert sub.bad_batches == counts["bad"]
            assert sub.foreign_frames == counts["foreign"]
            assert sub.restarts == counts["restarts"]
            assert sub.lossy_batches == counts["lossy"]
        finally:
            sub.close()
    finally:
        for p in pubs.values():
            p.close(linger=0)
