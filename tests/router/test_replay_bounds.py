"""A replay endpoint that never ends its answer, or streams more than a subscriber can
hold: ``ReplayClient`` must give up within its bounds (``STREAM_TIMEOUTS`` timeouts,
``max_message_bytes`` of payloads) and say there is no answer (None), never block or
keep what it read (found by fleet-r10's "never block, never grow" checks)."""

import threading

import pytest
import zmq

from prefixkv.router.replay_client import END_SEQ, ReplayClient
from waiting import PATIENCE

TIMEOUT_MS = 200


def seq(s):
    return s.to_bytes(8, "big")


class Streamer:
    """A ROUTER that answers the first request with ``head`` (a list of replies), then,
    if ``endless``, replies of a good shape every millisecond until closed."""

    def __init__(self, head, endless):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stop = threading.Event()
        self.head, self.endless = head, endless
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        if not self.sock.poll(PATIENCE * 1000):
            return
        ident = self.sock.recv_multipart()[0]
        for frames in self.head:
            self.sock.send_multipart((ident, b"", *frames))
        n = 0
        while self.endless and not self.stop.wait(0.001):
            self.sock.send_multipart((ident, b"", b"kv-events", seq(n), b"\x90"))
            n += 1

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close(linger=0)


def answered(client, start):
    """``client.replayed(start)`` on a thread; (returned, value) after up to PATIENCE."""
    out = []
    t = threading.Thread(target=lambda: out.append(client.replayed(start)), daemon=True)
    t.start()
    t.join(PATIENCE)
    return (not t.is_alive()), (out[0] if out else "still running")


@pytest.mark.parametrize("head", [[(b"odd",)], [(b"kv-other", seq(0), b"\x90")]],
                         ids=["bad-shape", "other-topic"])
def test_an_answer_that_never_ends_after_a_bad_reply_does_not_hold_the_client(head):
    # the bad reply sends the client draining to the end mark, which never comes
    server = Streamer(head, endless=True)
    client = ReplayClient(zmq.Context.instance(), server.endpoint, TIMEOUT_MS, b"kv-events")
    try:
        returned, value = answered(client, 0)
        assert returned and value is None
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize(("batches", "kept"), [(200, False), (20, True)])
def test_an_answer_past_max_message_bytes_is_not_kept(batches, kept):
    head = [(b"kv-events", seq(i), b"x" * 1000) for i in range(batches)] + [(b"", END_SEQ, b"")]
    server = Streamer(head, endless=False)
    client = ReplayClient(zmq.Context.instance(), server.endpoint, TIMEOUT_MS, b"kv-events",
                          max_message_bytes=50_000)
    try:  # 200,000 bytes of payloads: no answer; 20,000: the whole answer
        returned, value = answered(client, 0)
        assert returned and value == ([(i, b"x" * 1000) for i in range(batches)] if kept else None)
    finally:
        client.close()
        server.close()
