"""A late replay answer (the answer to a request that timed out) is never taken as the
next request's answer, in either form of request: a publisher on loopback that answers
the first request only once the second one reached it (a real ROUTER socket, driven
step by step: the interleaving that a busy publisher produces by chance)."""

import threading

import msgpack
import pytest
import zmq

from prefixkv.router.replay_client import END_SEQ, ReplayClient, ReplayTimeout
from waiting import LIVE

SHORT_MS = 100  # the first request's timeout: the publisher answers it later than that


def seq(s):
    return s.to_bytes(8, "big")


@pytest.fixture
def server():
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    yield sock
    sock.close(linger=0)


def late_then_on_time(server, late, on_time, timed_out):
    """The publisher's side: take request 1, wait until its client gave up on it
    (``timed_out``), take request 2, then answer 1 (``late``) and only then 2."""
    def run():
        first = server.recv_multipart()
        assert timed_out.wait(LIVE)
        second = server.recv_multipart()
        for frames in late:
            server.send_multipart((first[0], b"", *frames))
        for frames in on_time:
            server.send_multipart((second[0], b"", *frames))
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_late_map_answer_is_not_the_next_answer(server):
    client = ReplayClient(zmq.Context.instance(), server.getsockopt_string(zmq.LAST_ENDPOINT),
                          SHORT_MS)
    timed_out = threading.Event()
    late = [(msgpack.packb({"publisher_epoch": "e", "next_seq": 1,
                            "replayed_batches": [[0, b"old"]]}),)]
    on_time = [(msgpack.packb({"publisher_epoch": "e", "next_seq": 7,
                               "replayed_batches": [[5, b"p5"], [6, b"p6"]]}),)]
    t = late_then_on_time(server, late, on_time, timed_out)
    try:
        with pytest.raises(ReplayTimeout):
            client.ask(None, 0)
        timed_out.set()
        client.timeout_ms = int(LIVE * 1000)
        # before: the answer for start 0 was read as this one's (a ReplayError: a false
        # bad reply, and the forced snapshot after it would take this answer in turn)
        answer = client.ask("e", 5)
        assert (answer.next_seq, answer.batches) == (7, [(5, b"p5"), (6, b"p6")])
    finally:
        timed_out.set()
        t.join()
        client.close()


def test_the_tail_of_a_late_stream_is_not_the_next_stream(server):
    """vLLM's form: the first answer's first batch came in time, the rest (and its end
    mark) after the client gave up; the second request's answer is its own."""
    client = ReplayClient(zmq.Context.instance(), server.getsockopt_string(zmq.LAST_ENDPOINT),
                          SHORT_MS)
    timed_out = threading.Event()

    def run():
        ident = server.recv_multipart()[0]
        server.send_multipart((ident, b"", b"t", seq(2), b"p2"))      # in time
        assert timed_out.wait(LIVE)
        again = server.recv_multipart()[0]
        for s, p in ((3, b"p3"),):                                   # the late tail
            server.send_multipart((ident, b"", b"t", seq(s), p))
        server.send_multipart((ident, b"", b"", END_SEQ, b""))
        for s, p in ((0, b"q0"), (1, b"q1")):
            server.send_multipart((again, b"", b"t", seq(s), p))
        server.send_multipart((again, b"", b"", END_SEQ, b""))
    t = threading.Thread(target=run)
    t.start()
    try:
        assert client.replayed(2) is None          # no end mark in time
        timed_out.set()
        client.timeout_ms = int(LIVE * 1000)
        # before: [(3, b"p3")], the first stream's tail, answered for start 0
        assert client.replayed(0) == [(0, b"q0"), (1, b"q1")]
    finally:
        timed_out.set()
        t.join()
        client.close()
