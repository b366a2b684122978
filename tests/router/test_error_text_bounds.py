"""The text of a decode or replay error about a wire value is short, and so is what
making it costs: ``_show`` (and the replay client's checks) made the value's whole
``repr`` before cutting it to 80 characters, so a bad frame of N bytes cost another
~4N (a bytes value's repr takes up to 4 characters a byte): a 256 MiB frame, ~1 GiB
more for one error message (found by wirefuzz-r16's hostile peers)."""

import tracemalloc

import msgpack
import pytest

from prefixkv.router import DecodeError, decode_batch
from prefixkv.router.replay_client import ReplayError, _check

N = 1 << 22  # 4 MiB
BIG = [b"\x00" * N, "\x00" * N, [b"\x00" * (N // 8)] * 8, {"k": b"\x00" * N}]


def peak_of(call):
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("value", BIG, ids=["bytes", "str", "list", "map"])
def test_a_decode_error_about_a_big_value_costs_no_copy_of_it(value):
    payloads = [msgpack.packb([1.0, [], value]), msgpack.packb(value),
                msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [value]}]])]
    for payload in payloads:
        def decode(payload=payload):
            with pytest.raises(DecodeError) as err:
                decode_batch(payload)
            assert len(str(err.value)) < 300
        assert peak_of(decode) < 1.5 * N  # (the unpacked value itself: ~N)


@pytest.mark.parametrize("value", BIG, ids=["bytes", "str", "list", "map"])
def test_a_replay_error_about_a_big_value_costs_no_copy_of_it(value):
    answers = [value, {"publisher_epoch": value},
               {"publisher_epoch": "e", "next_seq": value},
               {"publisher_epoch": "e", "next_seq": 1, "replayed_batches": value},
               {"publisher_epoch": "e", "next_seq": 1, "replayed_batches": [value]}]
    for answer in answers:
        def check(answer=answer):
            with pytest.raises(ReplayError) as err:
                _check(answer, 0)
            assert len(str(err.value)) < 300
        assert peak_of(check) < 0.5 * N
