"""The subscriber and its replay path fuzzed against vLLM 0.33's own ``ZmqEventPublisher``
and ``kv_events.py`` structs (executed from the release wheel, unmodified:
tests/fleet/vllm_kv_events.py), with a plain model: the engine's own manager.

Hypothesis runs engine steps (admissions that evict), each published by vLLM's
publisher as vLLM's ``KVEventBatch``; its frame (read back from vLLM's replay buffer: the
bytes its PUB socket sent) reaches the subscriber delivered, lost, twice, held back and
delivered later in any order, or truncated (a frame cut off, a short sequence number, a
payload cut in half). Between the subscriber's replay client and vLLM's replay socket a
tap cuts answers short: no end mark (a timeout), an end mark after the first batches
(an answer that ends early), or the publisher restarted mid-answer. The publisher also
restarts between steps (the socket's monitor reports the old connection's end and the
new one's handshake, as it would; the old connection's queued frames die with it).

At each sync (held frames delivered, then one more step delivered whole, every replay
answered whole) the router's index for the replica must not overstate the manager for
any prompt, and must equal it unless the subscriber counted the loss (``resyncs``: a
gap its buffer lost, or no answer; the index then understates, never the other way)."""

import struct
import threading
import time

import zmq
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fleet.test_vllm_interop import free_ports
from fleet.vllm_kv_events import kv_events
from prefixkv import KVCacheManager
from prefixkv.fleet.wire import to_wire_events
from prefixkv.router import Router
from prefixkv.router.replay_client import END_SEQ
from prefixkv.router.subscriber import Subscriber
from waiting import PATIENCE

BS = 4
TOPIC = "kv-events"
PROMPTS = [list(range(1, 13)), list(range(1, 9)) + [7, 7, 7, 7], [5] * 8, list(range(20, 28)),
           list(range(30, 42)), [9] * 12]
FATES = ("deliver", "deliver", "deliver", "drop", "twice", "hold", "truncate")
TAPS = ("whole", "no_end", "early_end", "restart", "reversed", "doubled", "other_topic")


def vllm_publisher(kv, ports, buffer_steps):
    deadline = time.monotonic() + PATIENCE
    while True:
        try:
            return kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{ports[0]}",
                                        replay_endpoint=f"tcp://*:{ports[1]}", topic=TOPIC,
                                        buffer_steps=buffer_steps)
        except zmq.ZMQError:  # a restarted one may wait for its ports
            assert time.monotonic() < deadline
            time.sleep(0.05)


class Dealer:
    """A DEALER on vLLM's replay socket that asks again on a new socket when no answer
    comes in a second (a request sent into a connection that was dying is lost)."""

    def __init__(self, port):
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.connect(self.endpoint)

    def ask(self, body):
        """vLLM's whole answer to the request ``body``: its messages after the empty
        delimiter, the end mark last."""
        deadline = time.monotonic() + PATIENCE
        while True:
            self.sock.send_multipart((b"", body))
            out = []
            while self.sock.poll(1000):
                out.append(self.sock.recv_multipart()[1:])
                if out[-1][1] == END_SEQ:
                    return out
            assert time.monotonic() < deadline, "vLLM's replay did not answer"
            self.close()
            self.sock = zmq.Context.instance().socket(zmq.DEALER)
            self.sock.connect(self.endpoint)

    def close(self):
        self.sock.close(linger=0)


class Tap:
    """A ROUTER the subscriber's replay client connects to, forwarding each request to
    vLLM's replay socket and the answer back, as ``faults`` (consumed one a request)
    say: ``whole``; ``no_end`` (the first batch, no end mark); ``early_end`` (the first
    batch, then the end mark); ``restart`` (the first batch, then the publisher restarts,
    nothing more); ``reversed`` (every batch, last first); ``doubled`` (the first batch
    again after the last); ``other_topic`` (the first batch under a unicode topic the
    subscription does not match)."""

    def __init__(self, port, restart):
        ctx = zmq.Context.instance()
        self.front = ctx.socket(zmq.ROUTER)
        self.front.bind("tcp://127.0.0.1:*")
        self.endpoint = self.front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.back = Dealer(port)
        self.faults: list[str] = []
        self.restarted = 0
        self.error: BaseException | None = None  # what stopped the tap, if anything
        self._restart, self._stop = restart, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self._serve()
        except BaseException as exc:  # seen by the machine's invariant
            self.error = exc

    def _serve(self):
        while not self._stop.is_set():
            if not self.front.poll(20):
                continue
            ident, _, body = self.front.recv_multipart()
            answer = [(b"", *f) for f in self.back.ask(body)]
            fault = self.faults.pop(0) if self.faults else "whole"
            if fault == "restart" and self.restarted >= 1:
                fault = "no_end"
            if fault in ("whole", "reversed", "doubled", "other_topic"):
                send, end = answer[:-1], answer[-1:]
                if fault == "reversed":  # the batches in another order than sent
                    send = send[::-1]
                elif fault == "doubled":  # a batch twice, the second out of its place
                    send = send + send[:1]
                elif fault == "other_topic" and send:  # one batch of a topic not followed
                    send = [(b"", "kv-événements".encode(), *send[0][2:]), *send[1:]]
                send = send + end
            else:
                send = answer[:min(1, len(answer) - 1)]
                if fault == "early_end":
                    send.append(answer[-1])
            for frames in send:
                self.front.send_multipart((ident, *frames))
            if fault == "restart":
                self._restart()
                self.restarted += 1

    def close(self):
        self._stop.set()
        self.thread.join()
        self.front.close(linger=0)
        self.back.close()


def monitor_event(event):
    return [struct.pack("=hi", event, 0), b"tcp://127.0.0.1:1"]


class VllmWire(RuleBasedStateMachine):

    @initialize(buffer_steps=st.sampled_from([3, 100]))
    def setup(self, buffer_steps):
        self.kv = kv_events()
        self.buffer_steps = buffer_steps
        self.engine = threading.Lock()  # held by a step, and by a restart
        self.ports = free_ports(2)
        self.pub = vllm_publisher(self.kv, self.ports, buffer_steps)
        self.mgr = KVCacheManager(8, BS, hash_mode="sha256", enable_events=True)
        self.capture = Dealer(self.ports[1])
        self.sent = 0  # frames vLLM's publisher sent in this life
        self.tap = Tap(self.ports[1], self._restart)
        self.router = Router(["v"], block_size=BS)
        # its live socket reaches nothing: the frames are handed to it (``_on_frames``)
        self.sub = Subscriber(self.router, {"v": (f"tcp://127.0.0.1:{free_ports(1)[0]}",
                                                  self.tap.endpoint)}, replay_timeout=0.2)
        self.held: list[list[bytes]] = []
        self.next_id = self.restarts = self.seen = 0

    def teardown(self):
        if hasattr(self, "sub"):
            self.sub.close()
            self.tap.close()
            self.capture.close()
            self.pub.shutdown()

    def _restart(self):
        """The engine restarts, empty, on the same ports (never within a step)."""
        with self.engine:
            self.pub.shutdown()
            self.pub = vllm_publisher(self.kv, self.ports, self.buffer_steps)
            self.mgr = KVCacheManager(8, BS, hash_mode="sha256", enable_events=True)
            self.sent = 0

    def _handle(self, frames):
        self._monitor()
        with self.sub.lock:
            (sock,) = self.sub._sockets.subs  # (a disconnect replaces it)
            self.sub._on_frames(sock, frames)
        self._monitor()

    def _monitor(self):
        """What the socket's monitor reports of the restarts the tap made mid-answer (it
        may make one after the client gave up on the answer: at any time)."""
        while self.tap.restarted > self.seen:
            self.seen += 1
            self._reconnected()

    def _reconnected(self):
        self.held.clear()  # queued on the dead connection: dropped with it
        with self.sub.lock:
            self.sub._on_monitor("v", monitor_event(zmq.EVENT_DISCONNECTED))
        with self.sub.lock:  # (the verification's replay may restart it again)
            self.sub._on_monitor("v", monitor_event(zmq.EVENT_HANDSHAKE_SUCCEEDED))

    def _step(self, prompt):
        """One engine step, published by vLLM's publisher; its frame as sent, or None."""
        self._monitor()
        with self.engine:
            return self._publish(prompt)

    def _publish(self, prompt):
        rid, self.next_id = str(self.next_id), self.next_id + 1
        if self.mgr.add_request(rid, prompt) is None:
            return None
        self.mgr.free(rid)
        kinds = {"BlockStored": self.kv.BlockStored, "BlockRemoved": self.kv.BlockRemoved,
                 "AllBlocksCleared": self.kv.AllBlocksCleared}
        events = [kinds[m.pop("type")](**m) for m in to_wire_events(self.mgr.take_events(), BS)]
        if not events:
            return None
        self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=events))
        seq, self.sent = self.sent, self.sent + 1
        deadline = time.monotonic() + PATIENCE
        while True:
            got = [f for f in self.capture.ask(seq.to_bytes(8, "big"))
                   if f[1] != END_SEQ and int.from_bytes(f[1], "big") == seq]
            if got:
                return list(got[0])
            assert time.monotonic() < deadline, f"vLLM's publisher did not send batch {seq}"
            time.sleep(0.01)

    @rule(prompt=st.sampled_from(PROMPTS), fate=st.sampled_from(FATES), cut=st.integers(0, 2))
    def step(self, prompt, fate, cut):
        frames = self._step(prompt)
        if frames is None or fate == "drop":
            return
        if fate == "hold":
            self.held.append(frames)
            return
        if fate == "truncate":  # (the frame itself is lost)
            frames = [frames[:2], [frames[0], frames[1][1:], frames[2]],
                      [frames[0], frames[1], frames[2][:len(frames[2]) // 2]]][cut]
        self._handle(frames)
        if fate == "twice":
            self._handle(frames)

    @rule(order=st.permutations(range(4)))
    def release(self, order):
        held, self.held = self.held, []
        for i in sorted(range(len(held)), key=lambda i: order[i % 4] + 4 * (i // 4)):
            self._handle(held[i])

    @rule(fault=st.sampled_from(TAPS))
    def tap_fault(self, fault):
        self.tap.faults.append(fault)

    @precondition(lambda self: self.restarts < 2)
    @rule()
    def restart(self):
        """The engine restarts between steps: at most two restarts in all, the tap's
        included. The precondition reads only the machine's own count: the tap's flag is
        set by its thread whenever the subscriber's replay request reaches it, so a
        precondition reading it (as ``_monitor``'s sample ``seen`` would) chose other
        rules for the same draws under load (Hypothesis's FlakyStrategyDefinition). A
        restart the tap made is counted here, in the rule, where it draws nothing."""
        self._monitor()
        if self.seen + self.restarts >= 2:
            return
        self.restarts += 1
        self._restart()
        self._reconnected()

    @rule(prompt=st.sampled_from(PROMPTS))
    def sync(self, prompt):
        self.release(list(range(4)))
        self.tap.faults.clear()
        while (frames := self._step(prompt)) is None:
            prompt = [t + 1000 + self.next_id for t in prompt]
        self._handle(frames)
        with self.engine:  # (a restart the tap makes late: not in sync; a later sync is)
            if self.tap.restarted == self.seen:
                self.check()

    def check(self):
        sub, lost = self.sub, self.sub.resyncs > 0
        for p in PROMPTS:
            # (one token more: a manager leaves the last prompt token to compute)
            got, want = self.router.cached_tokens(p)["v"], self.mgr.lookup([*p, 99_999])
            assert got <= want, (p, got, want, sub.health())
            assert lost or got == want, (p, got, want, sub.health())

    @invariant()
    def nothing_raised(self):
        if hasattr(self, "sub"):
            assert self.sub.errors == 0, self.sub.last_error
            assert self.tap.error is None, repr(self.tap.error)


VllmWire.TestCase.settings = settings(
    max_examples=15, stateful_step_count=20, deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),  # (shrinking restarts takes minutes)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestVllmWire = VllmWire.TestCase
