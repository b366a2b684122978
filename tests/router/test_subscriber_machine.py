"""The subscriber against a plain model of what its replica holds, on a real publisher
over loopback ZeroMQ: Hypothesis publishes steps of a manager (admissions, frees,
evictions), loses some of them on the way, injects frames that are not the replica's
(foreign payloads numbered anywhere up to the last 8-byte number) and restarts the
publisher on the same endpoints (once a run). Whenever the last batch sent was delivered, the
router's index may understate what the manager holds, never overstate it: for every
prompt, the router's cached tokens are at most the manager's ``lookup``. Both replay
forms, drawn per run: prefixkv's map request, and vLLM's 8-byte request only. (It found
the two defects fixed in 4f38081.)"""

import shutil
import tempfile
import time

from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixkv import KVCacheManager
from prefixkv.fleet.wire import encode_batch
from prefixkv.router import Router
from prefixkv.router.subscriber import Subscriber
from waiting import GRACE, await_subscribed, wait_until

from .test_subscriber import BS, LegacyReplay, discard, make

PROMPTS = [list(range(1, 13)), list(range(1, 9)) + [7, 7, 7, 7], [5] * 8, list(range(20, 28))]
FOREIGN = [list(range(40, 52)), [9] * 8]
LAST = (1 << 64) - 1


def foreign_payload(prompt):
    other = KVCacheManager(64, BS, hash_mode="sha256", enable_events=True)
    other.add_request("x", prompt)
    return encode_batch(other.take_events(), block_size=BS)


class SubscriberMachine(RuleBasedStateMachine):

    @initialize(legacy=st.booleans())
    def setup(self, legacy):
        self.legacy = legacy  # the publisher answers vLLM's 8-byte replay request only
        self.folder = tempfile.mkdtemp(prefix="prefixkv-sub-")  # (ipc: a restart binds again
        self.pub, self.mgr = self._publisher((f"ipc://{self.folder}/pub",  # at once, where
                                              f"ipc://{self.folder}/replay"))  # a port may wait)
        self.router = Router(["r"], block_size=BS)
        # a replay request lost with a dead life costs a timeout, and a timeout costs a
        # resync only (an understatement, which the invariant allows): keep it short
        self.sub = Subscriber(self.router, {"r": (self.pub.endpoint, self.pub.replay_endpoint)},
                              replay_timeout=0.5)
        await_subscribed(self.sub)
        self.synced = True  # the last batch sent was delivered (or none was sent)
        self.restarted = False
        self.next_id = 0

    def _publisher(self, endpoints):
        pub, _, _ = make(buffer_steps=3, endpoint=endpoints[0], replay=endpoints[1])
        if self.legacy:
            pub.replay = LegacyReplay(3)
        return pub, KVCacheManager(6, BS, hash_mode="sha256", enable_events=True)

    @rule(prompt=st.sampled_from(PROMPTS), lost=st.booleans())
    def step(self, prompt, lost):
        """One step: admit a prompt (its blocks computed and cached, evicting others),
        free it; its events go out as one batch, lost on the way or delivered."""
        rid, self.next_id = str(self.next_id), self.next_id + 1
        assert self.mgr.add_request(rid, prompt) is not None
        self.mgr.free(rid)
        events = self.mgr.take_events()
        if not events:
            return
        sent = self.pub.published_batches
        assert self.pub.publish(events)
        wait_until(lambda: self.pub.published_batches > sent, "the batch sent")
        if lost:
            discard(self.sub, 1)
            self.synced = False
            return
        handled = [0]

        def delivered():
            handled[0] += self.sub.poll(0.05)
            return handled[0] >= 1
        wait_until(delivered, "the batch delivered", step=lambda: None)
        self.synced = True

    @rule(prompt=st.sampled_from(FOREIGN), seq=st.sampled_from([0, 1, 2, 5, 9, 1 << 40, LAST]))
    def foreign(self, prompt, seq):
        """A frame that is not the replica's (another publisher's payload) arrives,
        numbered other than the next number expected (such a frame passes for the
        replica's own: the wire has nothing else to tell them apart)."""
        last = self.sub.last_seq.get("r")
        assume(seq != (0 if last is None else last + 1))
        with self.sub.lock:
            self.sub._on_message("r", seq, foreign_payload(prompt))

    @precondition(lambda self: not self.restarted)  # (one a run: a reconnection takes 0.2 s)
    @rule()
    def restart(self):
        """The publisher restarts on the same endpoints, empty; the subscriber sees the
        disconnect and connects again (a PUB socket drops what it sends before that)."""
        endpoints = self.pub.endpoint, self.pub.replay_endpoint
        seen = self.sub.disconnects
        self.pub.close()
        self.pub, self.mgr = self._publisher(endpoints)
        self.synced, self.restarted = False, True
        wait_until(lambda: self.sub.disconnects > seen and self.sub.connected["r"],
                   "the subscriber connected again", step=lambda: self.sub.poll(0.05))
        time.sleep(GRACE)                            # (its subscription travels: waiting.py)

    @invariant()
    def never_overstated(self):
        if not hasattr(self, "sub"):
            return
        assert self.sub.errors == 0, self.sub.last_error
        if self.synced:
            for p in PROMPTS + FOREIGN:  # (one token more: lookup finds every full block)
                held = self.mgr.lookup(p + [0])
                assert self.router.cached_tokens(p)["r"] <= held, (p, held, self.sub.health())

    def teardown(self):
        if hasattr(self, "sub"):
            self.sub.close()
            self.pub.close()
        if hasattr(self, "folder"):
            shutil.rmtree(self.folder, ignore_errors=True)


TestSubscriberMachine = SubscriberMachine.TestCase
TestSubscriberMachine.settings = settings(max_examples=25, stateful_step_count=8, deadline=None)
