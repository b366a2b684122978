"""``record.value_checked``: a value read in place (head and tail apart from the payload)
is accepted exactly when ``decode_value`` accepts the same bytes whole."""

from prefixkv.store import decode_value, encode_value
from prefixkv.store.record import block_head, value_checked

HEAD = block_head(b"L" * 16, 4, b"p" * 32, b"t" * 16, b"")
FRONT = len(HEAD) + len(encode_value(b"", b""))


def read_in_place(value: bytes, head: bytes, payload_len: int, parts: int) -> bool:
    """``value`` read as the fetchers read it: a front buffer, the payload in ``parts``."""
    front = bytearray(value[:len(head) + FRONT - len(HEAD)])
    payload = bytearray(value[len(front):])
    cut = [len(payload) * i // parts for i in range(parts + 1)]
    views = [memoryview(payload)[a:b] for a, b in zip(cut, cut[1:], strict=False)]
    return value_checked(front, head, views, payload_len)


def test_value_checked_agrees_with_decode_value():
    good = encode_value(HEAD, b"kv" * 4)
    other_head = block_head(b"L" * 16, 4, b"p" * 32, b"t" * 16, b"x")
    corrupt = bytearray(good)
    corrupt[-1] ^= 1
    cases = [(good, HEAD, 8), (bytes(corrupt), HEAD, 8), (good, other_head[:len(HEAD)], 8),
             (encode_value(HEAD, b"kv" * 3 + b"k"), HEAD, 7), (good, HEAD, 8)]
    for value, head, n in cases:
        for parts in (1, 2, 3):
            if len(value) == len(head) + FRONT - len(HEAD) + n:
                assert read_in_place(value, head, n, parts) == (decode_value(value, head, n) is not None)
    assert read_in_place(good, HEAD, 8, 2)
    assert not read_in_place(bytes(corrupt), HEAD, 8, 2)
    tail_says_7 = encode_value(HEAD, b"kv" * 3 + b"k") + b"!"  # a tail naming 7 bytes, 8 read
    assert not read_in_place(tail_says_7, HEAD, 8, 1)
