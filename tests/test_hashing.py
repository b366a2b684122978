"""The hash chain, its encodings, and why a collision can never serve wrong KV."""

import ctypes
import os
import subprocess
import sys

import pytest

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput, TokenError
from prefixkv.hashing import encode_tokens, make_hash_fn, token_bytes


def test_token_encoding_is_uint32_little_endian():
    assert token_bytes(encode_tokens([1, 256, 2**32 - 1])) == bytes.fromhex("01000000" "00010000" "ffffffff")


@pytest.mark.parametrize("item", [ctypes.c_int32, ctypes.c_uint16, ctypes.c_int64, ctypes.c_uint64,
                                  ctypes.c_uint32.__ctype_be__, ctypes.c_int64.__ctype_be__,
                                  ctypes.c_uint16.__ctype_be__])
def test_buffers_with_an_explicit_byte_order_are_token_ids(item):
    """ctypes arrays (and numpy's non-native ones, '>i8') state their byte order in their
    format ('<i', '>Q'), which ``memoryview.tolist`` cannot read: they raised
    NotImplementedError, an untyped error for valid token ids."""
    ids = [1, 256, 40_000]
    buf = (item * 3)(*ids)
    assert memoryview(buf).format[0] in "<>"
    assert list(encode_tokens(buf)) == ids
    m = KVCacheManager(4, 2)
    m.add_request("a", ids + [7])
    assert m.lookup(buf) == 2 == m.lookup((item * 4)(*ids, 7))


def test_a_negative_id_in_a_buffer_with_a_byte_order_is_a_token_error():
    with pytest.raises(TokenError):
        encode_tokens((ctypes.c_int64.__ctype_be__ * 2)(1, -1))


def test_extra_keys_are_tagged_so_kinds_never_alias():
    assert ExtraKeys(lora="x").base_bytes() != ExtraKeys(cache_salt="x").base_bytes()
    assert ExtraKeys(lora="ab").base_bytes() != ExtraKeys(lora="a", cache_salt="b").base_bytes()
    mm = ExtraKeys(mm=(MultiModalInput("img", 5, 6),)).block_bytes(4, 4)
    assert mm[0] == b"" and mm[1] == mm[2] != b"" and mm[3] == b""  # tokens 5..10: blocks 1, 2


def test_multimodal_input_changes_only_the_blocks_it_covers():
    m = KVCacheManager(16, 4, seed=0)
    prompt = list(range(1, 14))
    m.add_request("a", prompt, extra=ExtraKeys(mm=(MultiModalInput("cat", 8, 4),)))
    assert m.lookup(prompt) == 8  # the text before the image is shared
    assert m.lookup(prompt, extra=ExtraKeys(mm=(MultiModalInput("dog", 8, 4),))) == 8
    assert m.lookup(prompt, extra=ExtraKeys(mm=(MultiModalInput("cat", 8, 4),))) == 12


SHA_SCRIPT = """
from prefixkv import KVCacheManager
m = KVCacheManager(8, 4, hash_mode="sha256", enable_events=True)
m.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
print(",".join(h.hex() for e in m.take_events() for h in e.block_hashes))
"""


def test_sha256_ids_are_the_same_in_every_process():
    runs = [subprocess.run([sys.executable, "-c", SHA_SCRIPT], capture_output=True, text=True,
                           check=True, env=os.environ | {"PYTHONHASHSEED": str(i)}).stdout
            for i in (1, 2)]
    assert runs[0] == runs[1] and len(runs[0].split(",")) == 2


def test_xxhash_default_seed_is_random_per_manager_but_seed_makes_it_reproducible():
    assert make_hash_fn("xxhash", None)[1] != make_hash_fn("xxhash", None)[1]
    assert make_hash_fn("xxhash", 7)[1] == make_hash_fn("xxhash", 7)[1]
    assert len(make_hash_fn("xxhash", 7)[1]) == 16 and len(make_hash_fn("sha256", None)[1]) == 32


def constant_hash(data: bytes) -> bytes:
    return b"\x00" * 16


def test_a_colliding_hash_never_serves_wrong_kv_nor_costs_a_hit():
    """Hits are found by content: a hash that collides on everything changes nothing
    but the events, which then announce one hash per content (a consumer counts them)."""
    m = KVCacheManager(16, 4, hash_mode=constant_hash, enable_events=True)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    m.add_request("a", a)          # both blocks carry the one hash there is
    assert m.num_cached_blocks == 2
    assert [e.block_hashes for e in m.take_events()] == [[b"\x00" * 16] * 2]
    assert m.lookup(a) == 8
    assert m.add_request("b", [1, 2, 3, 4, 50, 51, 52, 53, 9]).num_cached_tokens == 4
    assert m.add_request("c", [7, 7, 7, 7, 5, 6, 7, 8, 9]).num_cached_tokens == 0
    assert m.add_request("d", [1, 2, 3, 4], extra=ExtraKeys(cache_salt="s")).num_cached_tokens == 0
    m.check_invariants()


def test_duplicate_blocks_keep_their_children_findable():
    m = KVCacheManager(16, 4, seed=0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]       # exactly two blocks: block 1 is recomputed
    m.add_request("a", prompt)
    m.add_request("b", prompt)              # b's block 1 duplicates a's
    m.append_tokens("b", [9, 10, 11, 12])   # a child of the duplicate
    m.free("a")
    m.free("b")
    assert m.lookup(prompt + [9, 10, 11, 12, 13]) == 12
    m.check_invariants()


@pytest.mark.parametrize("mode", ["xxhash", "sha256"])
def test_both_modes_hit(mode):
    m = KVCacheManager(8, 4, hash_mode=mode)
    m.add_request("a", [1, 2, 3, 4, 5])
    assert m.lookup([1, 2, 3, 4, 6]) == 4


def test_stored_events_carry_the_keys_of_their_own_block():
    m = KVCacheManager(16, 4, seed=0, enable_events=True)
    img = MultiModalInput("cat", 4, 4)
    m.add_request("a", list(range(1, 14)), extra=ExtraKeys(lora="ad", mm=(img,)))
    [run] = m.take_events()
    assert run.extra == ExtraKeys(lora="ad", mm=(img,))  # the run's: every block's keys
    extras = [run.block_extra(i) for i in range(3)]
    assert extras == [ExtraKeys(lora="ad"), ExtraKeys(lora="ad", mm=(img,)), ExtraKeys(lora="ad")]
    m.add_request("b", [7] * 5, extra=ExtraKeys(mm=(MultiModalInput("x", 4, 1),)))
    [run] = m.take_events()
    assert run.extra is None and run.block_extra(0) is None


@pytest.mark.parametrize(("tokens", "named"), [
    ([5, 6, -2, 7], r"token 2 of 4 is -2$"),
    ((5, 1 << 32), r"token 1 of 2 is 4294967296$"),
    ([5, 6.0], r"token 1 of 2 is 6\.0$"),
    ([5, None, 6], r"token 1 of 3 is None$"),
    ([True, 5], r"token 0 of 2 is True, a bool$"),
])
def test_a_bad_token_id_is_named_with_its_position(tokens, named):
    """An engine handing padded or float logits' ids gets the first bad id and where it
    is. Before, the message was the array module's (``can't convert negative value to
    unsigned int``), naming neither; the request is not admitted."""
    m = KVCacheManager(8, 4)
    with pytest.raises(TokenError, match=named):
        m.add_request("a", tokens)
    assert m.num_free_blocks == 8


def test_an_id_past_vocab_size_is_named_with_its_position_and_the_valid_range():
    """The first id at or past ``vocab_size`` (not the largest), where it is, and the
    range ids must be in. Before: ``token id 150 is >= vocab_size 100``."""
    m = KVCacheManager(8, 4, vocab_size=100)
    with pytest.raises(TokenError, match=r"token 2 of 5 is 120: ids must be in \[0, 100\)"):
        m.add_request("a", [1, 2, 120, 3, 150])
    with pytest.raises(TokenError, match=r"token 1 of 2 is 100: ids must be in \[0, 100\)"):
        m.prepare([0, 100])
    assert m.num_free_blocks == 8
