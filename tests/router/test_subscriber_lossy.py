"""A replica's batch whose events are lost (undecodable, its place in the stream taken):
its removals may be missed, so its index is marked lossy (``Router.lossy``, the
scorer's ``ReplicaView.lossy``, ``health()``) and kept, not emptied. Driven by hand on
a subscriber without a replay endpoint (nothing can be asked again)."""

import msgpack
import pytest

from prefixkv import KVCacheManager
from prefixkv.fleet.wire import encode_batch
from prefixkv.router import Router, Stored
from prefixkv.router.scorer import AffinityScorer
from prefixkv.router.subscriber import Subscriber

BS = 4
P = [list(range(100 * i + 1, 100 * i + 13)) for i in range(3)]  # 3 blocks each


class Recording(AffinityScorer):
    """The default scorer, keeping the views it was shown."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def pick(self, views, turn):
        self.seen = list(views)
        return super().pick(views, turn)


@pytest.fixture
def following():
    """A subscriber following replica "r" (no replay endpoint), seq 0 (P[0]) applied."""
    scorer = Recording()
    router = Router(["r", "s"], block_size=BS, scorer=scorer)
    sub = Subscriber(router, {"r": ("tcp://127.0.0.1:1", None)})
    mgr = KVCacheManager(256, BS, hash_mode="sha256", enable_events=True)
    mgr.add_request("a", P[0])
    sub._on_message("r", 0, encode_batch(mgr.take_events(), block_size=BS))
    assert router.cached_tokens(P[0])["r"] == 12
    yield sub, router, mgr, scorer
    sub.close()


def future_batch():
    """A batch of an event type this router does not know (a newer publisher's)."""
    return msgpack.packb([0.0, [{"type": "BlocksMoved", "block_hashes": [1]}], None])


@pytest.mark.parametrize("payload", [b"\xc1", future_batch()], ids=["corrupt", "future"])
def test_a_lost_batch_marks_the_replica_lossy_and_keeps_its_index(following, payload):
    # found by audit: without a replay endpoint the frame advanced ``last`` and was
    # counted in bad_batches only; nothing told the scorer or health() that the index
    # may still hold blocks the lost batch removed
    sub, router, mgr, scorer = following
    sub._on_message("r", 1, payload)
    assert sub.last_seq["r"] == 1 and sub.bad_batches == 1
    assert sub.lossy_batches == 1 and router.lossy == {"r": 1, "s": 0}
    health = sub.health()
    assert health["counters"]["lossy_batches"] == 1 and health["replicas"]["r"]["lossy"] == 1
    assert router.cached_tokens(P[0])["r"] == 12  # kept: a newer event type would empty it
    router.route(P[0])
    assert {v.replica: v.lossy for v in scorer.seen} == {"r": 1, "s": 0}
    sub._on_message("r", 2, payload)  # every batch of a future type: still kept
    assert router.lossy["r"] == 2 and router.cached_tokens(P[0])["r"] == 12


def test_an_emptied_index_is_whole_again(following):
    sub, router, mgr, scorer = following
    sub._on_message("r", 1, b"\xc1")
    mgr.free("a")
    assert mgr.reset_prefix_cache()  # AllBlocksCleared: nothing left to be stale
    mgr.add_request("b", P[1])
    sub._on_message("r", 2, encode_batch(mgr.take_events(), block_size=BS))
    assert router.lossy["r"] == 0 and router.cached_tokens(P[1])["r"] == 12
    sub._on_message("r", 3, b"\xc1")
    router.forget("r")
    assert router.lossy["r"] == 0 and sub.health()["counters"]["lossy_batches"] == 2


def test_a_frame_that_is_no_message_marks_nothing(following):
    sub, router, _, _ = following
    (sock,) = sub._sockets.subs
    sub._on_frames(sock, [b"kv-events", b"\x00"])  # not (topic, 8-byte seq, payload)
    assert sub.bad_batches == 1 and sub.lossy_batches == 0 and router.lossy["r"] == 0


def test_a_block_a_lost_batch_removed_is_routed_to_as_a_hit_until_the_index_is_emptied(following):
    """(fleet-r10's open risk, answered) Without a replay endpoint a cut frame is applied
    as lossy: the blocks its removals ended stay indexed and are routed to as hits,
    flagged (``Choice.lossy``) and credited at ``lossy_weight``; nothing in time bounds
    it: later batches that do not name those blocks leave them; a sound replica's real
    run of over ``lossy_weight`` of it wins; a forget or an ``AllBlocksCleared`` ends it."""
    from prefixkv.events import BlockRemoved
    from prefixkv.hashing import block_hashes

    sub, router, mgr, _ = following
    evicted = BlockRemoved(block_hashes(P[0], BS, hash_mode="sha256"), [0, 1, 2])
    sub._on_message("r", 1, encode_batch([evicted], block_size=BS)[:-2])  # cut on the way
    assert router.lossy["r"] == 1 and router.cached_tokens(P[0])["r"] == 12
    for seq in range(2, 6):  # the replica goes on: its own batches, none names P[0]
        mgr.add_request(str(seq), [seq] * 4)
        sub._on_message("r", seq, encode_batch(mgr.take_events(), block_size=BS))
    choice = router.route(P[0])
    assert (choice.replica, choice.cached_tokens, choice.lossy) == ("r", 12, True)
    router.finish("r")
    router.apply("s", [Stored(tuple(router.prompt_hashes(P[0])[:2]), None, "GPU")])
    assert router.route(P[0]).replica == "s"  # 2 real blocks > 3 * lossy_weight (0.5)
    router.finish("s")
    router.forget("r")
    assert router.cached_tokens(P[0])["r"] == 0 and router.lossy["r"] == 0
