"""The wire format, checked byte by byte against docs/events.md and decoded back."""

import struct
from dataclasses import dataclass

import msgpack
import pytest

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput, block_hashes
from prefixkv.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixkv.fleet.wire import WireError, encode_batch, to_wire_events, wire_hash
from prefixkv.router import Cleared, DecodeError, Removed, Stored, decode_batch

STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
               "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
               "kv_cache_spec_kind"]


def manager(**kw):
    return KVCacheManager(64, 4, hash_mode="sha256", enable_events=True, **kw)


def test_batch_layout_and_field_order():
    m = manager()
    m.add_request("a", list(range(1, 11)))  # two full blocks
    payload = encode_batch(m.take_events(), block_size=4, ts=12.5, dp_rank=3)
    assert payload[0] == 0x93  # fixarray of 3: ts, events, rank
    assert payload[1:10] == b"\xcb" + struct.pack(">d", 12.5)  # float64, big-endian
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (12.5, 3)
    (ev,) = events
    assert list(ev) == STORED_KEYS
    digests = block_hashes(list(range(1, 11)), 4)
    assert ev["block_hashes"] == [int.from_bytes(d[-8:], "big") for d in digests]
    assert ev["parent_block_hash"] is None and ev["lora_id"] is None and ev["lora_name"] is None
    assert ev["token_ids"] == list(range(1, 9)) and ev["block_size"] == 4
    assert ev["medium"] == "GPU" and ev["extra_keys"] == [None, None]
    assert (ev["group_idx"], ev["kv_cache_spec_kind"]) == (0, "full_attention")


def test_nil_fields_are_present_and_encoded_as_nil():
    ev = BlockStored([b"\x00" * 31 + b"\x05"], None, struct.pack("<2I", 1, 2), [0], None, 0)
    payload = encode_batch([ev], block_size=2, ts=0.0)
    assert b"\xaflora_id\xc0" in payload.replace(b"\xa7lora_id", b"\xaflora_id")  # key, nil
    assert b"\xb1parent_block_hash\xc0" in payload
    assert b"\xa9lora_name\xc0" in payload
    assert b"\xa9sliding_window" not in payload  # defaulted fields are omitted


def test_hash_integer_widths():
    big = b"\xff" * 24 + b"\x80" + b"\x00" * 7      # low 64 bits >= 2**63: uint64 (0xcf)
    small = b"\xff" * 24 + b"\x00" * 7 + b"\x07"     # 7: positive fixint
    payload = encode_batch([BlockRemoved([big], [0]), BlockRemoved([small], [1])], block_size=4,
                           ts=0.0)
    assert b"\xcf\x80" + b"\x00" * 7 in payload
    (ev,) = msgpack.unpackb(payload)[1]
    assert ev == {"type": "BlockRemoved", "block_hashes": [1 << 63, 7], "medium": "GPU",
                  "group_idx": 0}
    raw = encode_batch([BlockRemoved([big], [0])], block_size=4, hash_format="bytes", ts=0.0)
    assert b"\xc4\x20" + big in raw  # bin 8, 32 bytes
    assert wire_hash(big) == 1 << 63 and wire_hash(big, "bytes") == big


def test_runs_of_one_chain_group_and_others_split():
    m = manager()
    m.add_request("a", list(range(1, 13)))      # blocks a0 a1 a2
    m.add_request("b", list(range(50, 59)))     # b0 b1: a new chain, a new event
    wire = to_wire_events(m.take_events(), 4)
    assert [len(e["block_hashes"]) for e in wire] == [3, 2]
    assert wire[0]["token_ids"] == list(range(1, 13))
    # decoding later continues a chain: the parent is the last block already sent
    m.append_tokens("b", [1, 2, 3, 4])
    (ev,) = to_wire_events(m.take_events(), 4)
    assert ev["parent_block_hash"] == wire[1]["block_hashes"][-1]


def test_extra_keys_per_block_and_lora():
    extra = ExtraKeys(lora="ad", cache_salt="s", mm=(MultiModalInput(b"\xab", 5, 2),))
    m = manager()
    m.add_request("a", list(range(1, 14)), extra=extra)
    (ev,) = to_wire_events(m.take_events(), 4)
    assert ev["lora_name"] == "ad" and ev["lora_id"] is None
    # vLLM 0.33's shape: (identifier, offset in the block), the salt on the first block
    assert ev["extra_keys"] == [("ad", "s"), ("ad", ("ab", 1)), ("ad",)]


def test_extra_keys_as_vllm_sends_them():
    """Issue 26.2: vLLM sends [['tenant-x'], [['img-1', 1]], None] for this request."""
    extra = ExtraKeys(cache_salt="tenant-x", mm=(MultiModalInput("img-1", 5, 2),))
    m = manager()
    m.add_request("a", list(range(1, 14)), extra=extra)
    payload = encode_batch(m.take_events(), block_size=4, ts=0.0)
    (ev,) = msgpack.unpackb(payload)[1]
    assert ev["extra_keys"] == [["tenant-x"], [["img-1", 1]], None]


def test_multimodal_offsets_span_blocks_and_batches():
    """An input that began in an earlier block has a negative offset in the later ones;
    a chain continued in a later batch keeps its positions (each event carries its run's
    position in the request, so no publisher needs to track them)."""
    m = manager()
    m.add_request("a", list(range(1, 10)))                     # blocks 0, 1
    first = m.take_events()
    extra = ExtraKeys(mm=(MultiModalInput(b"\x0f", 9, 4),))    # tokens 9..12
    m.add_request("b", list(range(1, 18)), extra=extra)        # hits 0, 1; stores 2, 3
    later = m.take_events()
    assert len(first) == 1
    (ev,) = to_wire_events(later, 4)  # alone: the run says it starts at block 2
    assert ev["extra_keys"] == [(("0f", 1),), (("0f", -3),)]


@dataclass(frozen=True, slots=True)
class CPUStored(BlockStored):  # the core's BlockStored once it carries ``medium``
    medium: str = "CPU"


@dataclass(frozen=True, slots=True)
class LoraWithId(ExtraKeys):  # ExtraKeys once it carries ``lora_id``
    lora_id: int | None = None


def test_medium_and_lora_id_are_read_when_the_core_has_them():
    extra = LoraWithId(lora="ad", lora_id=7)
    a = CPUStored([b"\x01" * 16], None, struct.pack("<2I", 1, 2), [0], extra, 0)
    b = CPUStored([b"\x02" * 16], b"\x01" * 16, struct.pack("<2I", 3, 4), [1], extra, 1)
    gpu = BlockStored([b"\x03" * 16], b"\x02" * 16, struct.pack("<2I", 5, 6), [2], extra, 2)
    wire = to_wire_events([a, b, gpu], 2)
    assert [(e["medium"], len(e["block_hashes"]), e["lora_id"]) for e in wire] == [
        ("CPU", 2, 7), ("GPU", 1, 7)]
    assert to_wire_events([BlockRemoved([b"\x01" * 16], [0])], 4)[0]["medium"] == "GPU"


def test_cleared_and_decode_round_trip():
    m = manager()
    m.add_request("a", list(range(1, 9)))
    m.free("a")
    m.reset_prefix_cache()
    m.add_request("b", list(range(1, 9)))
    m.free("b")
    m.add_request("c", list(range(100, 100 + 4 * 64)))  # evicts
    evs = m.take_events()
    ts, decoded, rank = decode_batch(encode_batch(evs, block_size=4, ts=1.0))
    kinds = [type(e) for e in decoded]
    assert kinds[:3] == [Stored, Cleared, Stored] and Removed in kinds
    assert rank == 0 and ts == 1.0
    assert decoded[0].hashes == tuple(wire_hash(d) for d in block_hashes(list(range(1, 9)), 4))


def test_decoder_reads_old_array_events():
    old = msgpack.packb([1.0, [["BlockStored", [5, 6], None, [1, 2, 3, 4], 2, None, None],
                               ["BlockRemoved", [5]], ["AllBlocksCleared"]]])
    _, evs, rank = decode_batch(old)
    assert evs == [Stored((5, 6), None, "GPU"), Removed((5,), "GPU"), Cleared()]
    assert rank is None


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [{"type": "X"}]]),
                                     msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]),
                                     msgpack.packb([1.0, [7]]),
                                     None, 5])  # (not bytes: TypeError from len, review-r21)
def test_decode_errors(payload):
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_wire_errors():
    with pytest.raises(WireError, match="hash_format"):
        encode_batch([], block_size=4, hash_format="hex")
    with pytest.raises(WireError, match="block_size"):
        encode_batch([], block_size=0)
    with pytest.raises(WireError, match="dp_rank"):
        encode_batch([], block_size=4, dp_rank=-1)
    with pytest.raises(WireError, match="not a prefixkv event"):
        encode_batch(["BlockStored"], block_size=4)
    assert AllBlocksCleared() == AllBlocksCleared()


@pytest.mark.parametrize(("kw", "word"), [
    pytest.param(dict(dp_rank=2**64), "dp_rank", id="dp_rank-past-msgpack"),
    pytest.param(dict(dp_rank=2**70), "dp_rank", id="dp_rank-huge"),
    pytest.param(dict(ts="x"), "ts", id="ts-str"),
    pytest.param(dict(ts=[]), "ts", id="ts-list"),
    pytest.param(dict(ts=True), "ts", id="ts-bool"),
    pytest.param(dict(ts=float("nan")), "ts", id="ts-nan"),
    pytest.param(dict(ts=float("inf")), "ts", id="ts-inf"),
    pytest.param(dict(events=None), "events", id="events-None"),
    pytest.param(dict(events=5), "events", id="events-int"),
])
def test_every_bad_argument_of_encode_batch_is_a_wire_error(kw, word):
    """``encode_batch`` raises WireError for a bad option or event (its contract): a
    dp_rank past msgpack's ints was an OverflowError from the packer, a ts that is no
    number a ValueError or TypeError, and events that are no iterable a TypeError; a
    NaN or infinite ts was sent, which no consumer can place in time (review-r21)."""
    args = {"events": [AllBlocksCleared()], "block_size": 4, **kw}
    events = args.pop("events")
    with pytest.raises(WireError, match=word):
        encode_batch(events, **args)
