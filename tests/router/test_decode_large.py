"""A payload of ``STREAM_FROM`` bytes or more is read field by field (router/
decode_large.py): only the fields the router reads are built. Its answer is the
``unpackb`` path's for every msgpack payload: the wire fuzzer's payloads
(tests/router/test_wire_fuzz.py: values, valid batches mutated or with a field swapped,
raw bytes) decoded both ways (the threshold set to 0 for one) give the same events, or
DecodeError both. And large payloads: a vLLM-like batch of long token lists, and frames
of empty containers, which cost a fraction of what ``unpackb`` built for them."""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest
from hypothesis import given, settings

from prefixkv.router import DecodeError, decode_batch
from prefixkv.router import decode as decoding

from .test_wire_fuzz import payloads, valid_batch


def both(payload: bytes) -> tuple[object, object]:
    def once() -> object:
        try:
            return decode_batch(payload)
        except DecodeError:
            return DecodeError
    plain = once()
    saved, decoding.STREAM_FROM = decoding.STREAM_FROM, 0
    try:
        return plain, once()
    finally:
        decoding.STREAM_FROM = saved


@settings(max_examples=300, deadline=None)
@given(payloads)
def test_the_field_by_field_read_answers_as_unpackb(payload):
    plain, streamed = both(payload)
    assert streamed == plain


def test_every_shape_of_the_valid_batch_reads_the_same():
    plain, streamed = both(msgpack.packb(valid_batch()))
    assert plain is not DecodeError and streamed == plain


def test_a_field_the_router_does_not_read_is_not_built_or_checked():
    """A token list holding what ``unpackb`` cannot build (a map with an array key): the
    field-by-field read skips it, ``unpackb`` refused the whole payload."""
    bad_token_ids = b"\x81\x91\x01\x02"  # {[1]: 2}
    event = msgpack.packb({"type": "BlockRemoved", "block_hashes": [5]})
    payload = b"\x92\xcb" + msgpack.packb(1.0)[1:] + b"\x91" + event[:1].replace(
        b"\x82", b"\x83") + event[1:] + msgpack.packb("token_ids") + b"\x91" + bad_token_ids
    plain, streamed = both(payload)
    assert plain is DecodeError
    assert streamed[1][0].hashes == (5,)  # type: ignore[index]


def large(events: list[object]) -> bytes:
    payload = msgpack.packb([1.0, events, 0])
    assert len(payload) >= decoding.STREAM_FROM
    return payload


def peak(payload: bytes) -> tuple[int, object]:
    tracemalloc.start()
    try:
        try:
            out: object = decode_batch(payload)
        except DecodeError:
            out = DecodeError
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


def test_a_large_batch_of_long_token_lists_builds_its_hashes_alone():
    events = [{"type": "BlockStored", "block_hashes": list(range(1000 + 64 * i, 1064 + 64 * i)),
               "parent_block_hash": None, "token_ids": [300 + t for t in range(1024)],
               "block_size": 16, "medium": "GPU"} for i in range(32)]
    payload = large(events)
    got, out = peak(payload)
    assert out != DecodeError and len(out[1]) == 32  # type: ignore[index]
    assert out == both(payload)[0]
    assert got < 3 * len(payload), f"{got:,} bytes at the peak for {len(payload):,}"


@pytest.mark.parametrize("filler", [[], {}, [0], "ab"])
def test_a_large_frame_of_small_values_is_refused_at_its_first(filler):
    payload = large([filler] * (1 << 18))
    got, out = peak(payload)
    assert out is DecodeError
    assert got < 2 * len(payload), f"{got:,} bytes at the peak for {len(payload):,}"


def test_a_large_hash_list_of_containers_is_refused_unbuilt():
    payload = large([{"type": "BlockStored", "block_hashes": [[]] * (1 << 18)}])
    got, out = peak(payload)
    assert out is DecodeError and got < 2 * len(payload)
