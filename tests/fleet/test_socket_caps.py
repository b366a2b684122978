"""Every ZeroMQ socket prefixkv opens that reads from a peer caps the frames it reads
(``MAXMSGSIZE``): the subscriber's SUB, the replay client's DEALER, the publisher's
replay ROUTER, and the publisher's PUB, whose peers' subscriptions it reads (a peer that
subscribed with a frame of any size was read whole, into the PUB's subscription trie, in
the engine's process). ``MAXMSGSIZE`` caps each frame, not a message's number of frames
(``router/frames.py``: those are dropped uncopied). Real sockets on loopback."""

from __future__ import annotations

import zmq

from prefixkv.fleet.bind import INBOUND_HWM
from prefixkv.fleet.publisher import EventPublisher
from prefixkv.fleet.replay import MAX_REQUEST_BYTES
from prefixkv.router import Router
from prefixkv.router.subscriber import Subscriber


def test_every_socket_that_reads_a_peer_caps_its_frames(monkeypatch):
    made: list[zmq.Socket] = []
    socket = zmq.Context.socket

    def recording(self, kind, *args, **kwargs):  # type: ignore[no-untyped-def]
        s = socket(self, kind, *args, **kwargs)
        made.append(s)
        return s

    monkeypatch.setattr(zmq.Context, "socket", recording)
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", block_size=4)
    sub = Subscriber(Router(["r"], block_size=4), {"r": (pub.endpoint, pub.replay_endpoint)},
                     max_message_bytes=1 << 20)
    try:
        kinds = {s.type: s.getsockopt(zmq.MAXMSGSIZE) for s in made if s.type != zmq.PAIR}
        assert kinds == {zmq.PUB: MAX_REQUEST_BYTES, zmq.ROUTER: MAX_REQUEST_BYTES,
                         zmq.SUB: 1 << 20, zmq.DEALER: 1 << 20}
        # (the publisher's: what a peer can queue unread, bind.py)
        assert {s.type: s.getsockopt(zmq.RCVHWM) for s in made if s.type in (
            zmq.PUB, zmq.ROUTER)} == {zmq.PUB: INBOUND_HWM, zmq.ROUTER: INBOUND_HWM}
        # (PAIR: the subscriber's monitor sockets, inproc from its own SUB sockets)
        assert all(s.getsockopt_string(zmq.LAST_ENDPOINT).startswith("inproc://")
                   for s in made if s.type == zmq.PAIR)
    finally:
        sub.close()
        pub.close()


def test_a_peer_subscribing_with_a_large_frame_is_disconnected_by_the_publisher():
    """A SUB peer whose subscription frame is past the cap is dropped by the publisher's
    ZeroMQ before the frame is read (its monitor sees the disconnect); one whose topic
    fits stays connected and gets the batches."""
    pub = EventPublisher("tcp://127.0.0.1:*", block_size=4, heartbeat=0.05)
    ctx = zmq.Context.instance()
    big, fine = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        big.setsockopt(zmq.SUBSCRIBE, b"k" * (MAX_REQUEST_BYTES + 1))
        fine.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        big.connect(pub.endpoint)
        fine.connect(pub.endpoint)
        assert monitor.poll(10_000), "the publisher kept a peer whose subscription is past its cap"
        assert fine.poll(10_000), "a subscriber within the cap got no batch (heartbeat)"
        assert fine.recv_multipart()[0] == b"kv-events"
    finally:
        big.disable_monitor()
        monitor.close(linger=0)
        big.close(linger=0)
        fine.close(linger=0)
        pub.close()


def test_a_peer_flooding_the_replay_socket_is_held_to_a_few_messages():
    """The replay ROUTER queued 100,000 unread messages per peer (``hwm``): a peer that
    sent 1 KiB requests without reading the answers made the replica hold ~100 MB. Now
    ``INBOUND_HWM``: ZeroMQ stops reading the peer's connection, and the peer's own sends
    block after that, its socket's queue and the kernel's buffers."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", block_size=4, heartbeat=None)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.connect(pub.replay_endpoint)
    sent = 0
    try:
        junk = b"x" * MAX_REQUEST_BYTES  # (no request: never answered)
        while sent < 200_000:
            try:
                peer.send(junk, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                if not peer.poll(500, zmq.POLLOUT):
                    break  # (nothing taken for half a second: held back)
        assert sent < 50_000, f"{sent:,} requests of 1 KiB taken"
    finally:
        peer.close(linger=0)
        pub.close()
