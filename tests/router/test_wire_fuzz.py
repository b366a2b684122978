"""A fuzzer on the event wire: whatever a replica sends, the decoder raises DecodeError
or gives events the router applies, and a running subscriber keeps going (issue 22.2).

Payloads: Hypothesis-generated msgpack values, valid batches mutated at a random place
in their structure, raw bytes, and messages of the wrong frame shape. The live test
sends them over real ZeroMQ on loopback to a subscriber in thread mode, each example
followed by a good batch that must be applied.
"""

import itertools
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager
from prefixkv.fleet.wire import encode_batch
from prefixkv.router import DecodeError, Router, decode_batch
from prefixkv.router.subscriber import Subscriber
from waiting import PATIENCE, await_subscribed

BS = 4
TOPIC = b"kv-events"

leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
          | st.text(max_size=6) | st.binary(max_size=6)
          | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type"]))
values = st.recursive(
    leaves, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6) | st.integers(-(2**63), 2**64 - 1) | st.sampled_from(
        ["type", "block_hashes", "medium", "group_idx", "parent_block_hash", "block_size"]),
        inner, max_size=4),
    max_leaves=16)


def valid_batch():
    """A batch of every shape the decoder reads: map events (one per kind, group fields,
    a snapshot-like store) and legacy array events."""
    return [1.0, [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": [1] * 8, "block_size": BS, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 8], "medium": "CPU", "group_idx": 1},
        ["BlockStored", [3], 2, [1] * 4, BS, None, "GPU", None, None, 1, "sliding_window", 8],
        ["BlockRemoved", [3], "GPU"],
        {"type": "AllBlocksCleared"}, ["AllBlocksCleared"],
    ], 0]


@st.composite
def mutated(draw):
    """``valid_batch()`` with one node, at a random depth, replaced, dropped or grown."""
    batch = valid_batch()
    node = batch
    while True:
        keys = list(range(len(node))) if isinstance(node, list) else list(node)
        if not keys:
            break
        key = draw(st.sampled_from(keys))
        child = node[key]
        if isinstance(child, (list, dict)) and child and draw(st.booleans()):
            node = child
            continue
        action = draw(st.sampled_from(["replace", "drop", "grow"]))
        if action == "replace":
            node[key] = draw(values)
        elif action == "drop" and isinstance(node, dict):
            del node[key]
        elif action == "drop":
            node.pop(key)
        elif isinstance(node, dict):
            node[draw(st.text(max_size=4))] = draw(values)
        else:
            node.append(draw(values))
        break
    return msgpack.packb(batch)


@st.composite
def swapped(draw):
    """``valid_batch()`` with one field of one event holding any value."""
    batch = valid_batch()
    events = batch[1]
    i = draw(st.integers(0, len(events) - 1))
    ev = events[i]
    key = draw(st.sampled_from(list(ev) if isinstance(ev, dict) else range(len(ev))))
    ev[key] = draw(values)
    batch[1] = [ev]
    return msgpack.packb(batch)


payloads = (values.map(msgpack.packb) | mutated() | swapped() | st.binary(max_size=48))


def test_the_issue_examples_are_decode_errors():
    with pytest.raises(DecodeError, match="array event"):
        decode_batch(msgpack.packb([1.0, [[["BlockStored"], [1]]], 0]))
    for medium in ([1], {"a": 1}):
        for tag in ("BlockStored", "BlockRemoved"):
            bad = {"type": tag, "block_hashes": [1], "parent_block_hash": None, "medium": medium}
            with pytest.raises(DecodeError, match="medium"):
                decode_batch(msgpack.packb([1.0, [bad], 0]))


@pytest.mark.parametrize("field, value", [
    ("block_hashes", [True]), ("block_hashes", [-1]), ("block_hashes", [2**64 - 1, None]),
    ("parent_block_hash", [1]), ("parent_block_hash", "x"), ("block_size", -1),
    ("block_size", "4"), ("group_idx", True), ("kv_cache_spec_kind", 1),
    ("kv_cache_spec_sliding_window", 1.5)])
def test_each_field_read_is_type_checked(field, value):
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, field: value}
    with pytest.raises(DecodeError, match=field):
        decode_batch(msgpack.packb([1.0, [ev], 0]))


@pytest.mark.parametrize("batch", [[True, []], [1.0, [], "0"], [1.0, [], 1.5]])
def test_batch_fields_are_type_checked(batch):
    with pytest.raises(DecodeError):
        decode_batch(msgpack.packb(batch))


@settings(max_examples=400, deadline=None)
@given(payloads)
def test_decode_raises_only_decode_error_and_the_router_takes_what_it_gives(payload):
    router = Router(["r"], block_size=BS)
    try:
        _, events, _ = decode_batch(payload)
    except DecodeError:
        return
    router.apply("r", events)  # must not raise


# ---- the live subscriber -------------------------------------------------------------


class Wire:
    """A raw PUB socket on loopback standing in for a replica that sends anything, and a
    subscriber following it in a thread."""

    def __init__(self):
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = Router(["r"], block_size=BS)
        self.sub = Subscriber(self.router, {"r": (self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                                                  None)})
        self.seq = itertools.count()
        self.prompts = itertools.count()
        self.sub.start()
        await_subscribed(self.sub)  # PUB drops messages sent before the subscription arrives
        # the publisher's own batches come first, as a running replica's do: they state its
        # rank (0), so a fuzzed batch stating another is another publisher's, refused
        # (tests/router/test_subscriber_foreign.py); had one come first, the replica's own
        # would be the foreign ones
        assert self.good_batch_applied()

    def send(self, payload):
        self.pub.send_multipart((TOPIC, next(self.seq).to_bytes(8, "big"), payload))

    def good_batch_applied(self):
        """Send a real manager's batch for a new prompt; whether the router indexed it."""
        n = next(self.prompts)
        prompt = [10_000 + 16 * n + i for i in range(2 * BS)]
        mgr = KVCacheManager(8, BS, hash_mode="sha256", enable_events=True)
        mgr.add_request("x", prompt)
        self.send(encode_batch(mgr.take_events(), block_size=BS))
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            with self.sub.lock:
                if self.router.cached_tokens(prompt + [1])["r"] == 2 * BS:
                    return True
            time.sleep(0.005)
        return False

    def close(self):
        self.sub.close()
        self.pub.close(linger=0)


@pytest.fixture(scope="module")
def wire():
    w = Wire()
    yield w
    w.close()


bad_frames = st.one_of(
    st.lists(st.binary(max_size=9), min_size=0, max_size=5).filter(lambda f: len(f) != 2),
    st.tuples(st.binary(max_size=12).filter(lambda b: len(b) != 8), st.binary(max_size=8)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(payloads, min_size=1, max_size=4), st.lists(bad_frames, max_size=2))
def test_a_running_subscriber_survives_the_fuzzer(wire, sent, frames):
    for payload in sent:
        wire.send(payload)
    for extra in frames:  # after the topic: a wrong count of frames, or a bad seq frame
        wire.pub.send_multipart((TOPIC, *extra))
    assert wire.good_batch_applied()
    assert wire.sub.alive and wire.sub.errors == 0, wire.sub.last_error


def test_the_fuzzed_subscriber_counted_what_it_skipped(wire):
    before = wire.sub.bad_batches
    for payload in (b"\xc1", msgpack.packb([1.0, [[["BlockStored"], [1]]], 0])):
        wire.send(payload)
    wire.pub.send_multipart((TOPIC, b"\x00"))
    assert wire.good_batch_applied()
    health = wire.sub.health()
    assert health["counters"]["bad_batches"] == before + 3
    assert health["alive"] and health["counters"]["errors"] == 0


def test_a_foreign_batch_first_after_a_forget_does_not_lock_the_replica_out(wire):
    """A gap (no replay buffer: a resync) forgets the replica's index; the frame that
    caused it is undecodable, so no batch states the origin again; then a batch of
    another rank. It was taken as the new origin, and every later batch of the
    replica's own rank refused as foreign, for ever (the fuzzer found it)."""
    next(wire.seq)  # a number never sent: the next frame opens a gap
    wire.send(b"\xc0")
    mgr = KVCacheManager(8, BS, hash_mode="sha256", enable_events=True)
    mgr.add_request("x", [7] * (2 * BS))
    wire.send(encode_batch(mgr.take_events(), block_size=BS, dp_rank=3))
    assert wire.good_batch_applied()
    assert wire.router.cached_tokens([7] * (2 * BS) + [1])["r"] == 0
