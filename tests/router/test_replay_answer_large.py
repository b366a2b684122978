"""A replay answer of ``decode_large.STREAM_FROM`` bytes or more is read field by field
(``decode_large.read_answer``): ``unpackb`` built the whole answer first, and a frame of
empty pairs cost 64x its bytes. Both reads give ``replay_client._check`` the same answer
or both fail (ReplayError), on generated answers (but one whose only fault is a map key that is not a
str or bytes inside a field the client does not read): valid ones, and ones
with a field or an item replaced by any value."""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.router.decode_large import read_answer
from prefixkv.router.replay_client import ReplayError, _check

from .test_wire_fuzz import values


def outcome(read, payload: bytes) -> object:
    """The client's answer, or ReplayError (what it raises for msgpack it cannot read too)."""
    try:
        return _check(read(payload), 3)
    except Exception:
        return ReplayError


@st.composite
def answers(draw):
    n = draw(st.integers(0, 4))
    answer = {"publisher_epoch": "e" * draw(st.integers(0, 3)), "next_seq": 3 + n,
              "replayed_batches": [[3 + i, bytes([i]) * i] for i in range(n)]}
    if draw(st.booleans()):
        answer = {"publisher_epoch": "e", "next_seq": 9, "replayed_batches": [],
                  "snapshot": b"s" * draw(st.integers(0, 4))}
    if draw(st.booleans()):
        key = draw(st.sampled_from([*answer, "other"]))
        answer[key] = draw(values)
    if draw(st.booleans()) and answer["replayed_batches"] and isinstance(
            answer["replayed_batches"], list):
        items = answer["replayed_batches"]
        items[draw(st.integers(0, len(items) - 1))] = draw(values)
    return msgpack.packb(answer) if draw(st.booleans()) else msgpack.packb(draw(values))


@settings(max_examples=300, deadline=None)
@given(answers())
def test_both_reads_of_an_answer_agree(payload):
    plain = outcome(lambda p: msgpack.unpackb(p, raw=False), payload)
    streamed = outcome(read_answer, payload)
    if streamed != plain:  # (only a key that is not a str or bytes inside a field the
        # client does not read: ``unpackb`` refused the answer whole, it is skipped here)
        assert plain is ReplayError and streamed is not ReplayError
        lax = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        assert _check({k: v for k, v in lax.items() if k in (
            "publisher_epoch", "next_seq", "replayed_batches", "snapshot")}, 3) == streamed


@pytest.mark.parametrize("item", [[], {}, [0]])
def test_a_large_answer_of_bad_items_is_refused_at_its_first(item):
    payload = msgpack.packb({"publisher_epoch": "e", "next_seq": 1 << 18,
                             "replayed_batches": [item] * (1 << 18)})
    tracemalloc.start()
    try:
        assert outcome(read_answer, payload) is ReplayError
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(payload), f"{peak:,} bytes at the peak for {len(payload):,}"


def test_a_large_valid_answer_reads_as_unpackb_reads_it():
    payload = msgpack.packb({"publisher_epoch": "e", "next_seq": 3 + 4096, "other": [[1]] * 9,
                             "replayed_batches": [[3 + i, b"b" * 40] for i in range(4096)]})
    assert len(payload) >= 1 << 16
    got = outcome(read_answer, payload)
    assert got == outcome(lambda p: msgpack.unpackb(p, raw=False), payload)
    assert len(got.batches) == 4096  # type: ignore[attr-defined]


def test_the_replay_client_reads_a_large_bad_answer_at_a_fraction_of_unpackb_s_cost():
    """On loopback: a ROUTER answers the client's ``ask`` with a 1 MiB answer of empty
    pairs. The client's peak (tracemalloc, the frame read included) was 64x the frame
    (``unpackb``); now the frame and the reader's copy of it."""
    import threading

    import zmq

    from prefixkv.router.replay_client import ReplayClient

    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.bind("tcp://127.0.0.1:*")
    payload = msgpack.packb({"publisher_epoch": "e", "next_seq": 1,
                             "replayed_batches": [[]] * ((1 << 20) - 64)})

    def answer() -> None:
        ident, empty, _ = server.recv_multipart()
        server.send_multipart((ident, empty, payload))

    client = ReplayClient(ctx, server.getsockopt_string(zmq.LAST_ENDPOINT), 10_000)
    thread = threading.Thread(target=answer)
    thread.start()
    tracemalloc.start()
    try:
        with pytest.raises(ReplayError):
            client.ask("e", 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        thread.join()
        client.sock.close(linger=0)
        server.close(linger=0)
    assert peak < 3 * len(payload), f"{peak:,} bytes at the peak for {len(payload):,}"
