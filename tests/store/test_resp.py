"""prefixkv's RESP reader on a real server: a value read into buffers, nil, a value of
another length skipped with the stream kept in step, an error reply for one key, and a
deadline that has passed."""

import time

import pytest

from prefixkv.store.resp import Resp, RespError, pack
from waiting import LIVE


@pytest.fixture
def conn(redis_url):
    if not redis_url.startswith("unix://"):
        pytest.skip("the reader is tested on the local server's Unix socket")
    c = Resp(("unix", redis_url[len("unix://"):]))
    c.open(time.monotonic() + LIVE)
    yield c
    c.close()


def test_replies_into_buffers(conn):
    d = time.monotonic() + LIVE
    conn.send(pack(b"SET", b"resp:a", b"0123456789") + pack(b"DEL", b"resp:l")
              + pack(b"RPUSH", b"resp:l", b"x"), d)
    assert [conn.reply(d) for _ in range(3)] == [b"OK", 0, 1]
    a, b = bytearray(4), bytearray(6)
    conn.send(pack(b"GET", b"resp:a") + pack(b"GET", b"resp:none") + pack(b"GET", b"resp:a")
              + pack(b"GET", b"resp:l") + pack(b"PING"), d)
    assert conn.bulk_into([memoryview(a), memoryview(b)], 10, d) is True
    assert (bytes(a), bytes(b)) == (b"0123", b"456789")
    assert conn.bulk_into([memoryview(bytearray(3))], 3, d) is None
    assert conn.bulk_into([memoryview(bytearray(3))], 3, d) == 10     # skipped, not written
    wrong = conn.bulk_into([memoryview(bytearray(3))], 3, d)
    assert isinstance(wrong, RespError) and str(wrong).startswith("WRONGTYPE")
    assert conn.reply(d) == b"PONG"                                   # still in step


def test_a_deadline_that_passed_raises_at_once(conn):
    with pytest.raises(TimeoutError):
        conn.send(pack(b"PING"), time.monotonic() - 1)
