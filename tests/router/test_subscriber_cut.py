"""After a resync on a cut frame (a vLLM publisher's buffer gave no answer for it), the
subscriber follows from that frame's number without having applied it. A later check
of the publisher compared the buffer's copy of that batch with the cut bytes, found them
different, and took the live publisher for a new life: a restart that was not one."""

from prefixkv import KVCacheManager
from prefixkv.fleet.wire import encode_batch
from prefixkv.router import Router
from prefixkv.router.subscriber import Subscriber

BS = 4
P = [list(range(100 * i + 1, 100 * i + 13)) for i in range(6)]  # 3 blocks each


class Buffer:
    """A vLLM publisher's replay buffer as its client reads it (``ReplayClient``'s
    ``ask``, ``replayed``, ``stream``): no map form; ``mute``: no answer at all."""

    def __init__(self):
        self.held, self.mute = [], False

    def ask(self, epoch, start, *, force_snapshot=False):
        return None  # (its end mark: a vLLM publisher)

    def replayed(self, start):
        return None if self.mute else [(s, p) for s, p in self.held if s >= start]

    def stream(self, start, until=None):
        got = self.replayed(start)
        whole = got is not None and all(s == k for k, (s, _) in enumerate(got, start))
        return got if whole else None

    def renew(self):
        pass

    def close(self):
        pass


def test_a_resync_on_a_cut_frame_is_not_taken_for_a_restart_later():
    mgr = KVCacheManager(256, BS, hash_mode="sha256", enable_events=True)
    batches = []
    for i, prompt in enumerate(P):
        mgr.add_request(str(i), prompt)
        batches.append(encode_batch(mgr.take_events(), block_size=BS))
    router = Router(["r"], block_size=BS)
    sub = Subscriber(router, {"r": ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")}, ping=None)
    buffer = sub._replay["r"] = Buffer()
    try:
        buffer.held = list(enumerate(batches[:2]))
        for seq in (0, 1):
            sub._on_message("r", seq, batches[seq])
        buffer.mute = True                       # batch 2 cut on the way, no answer for it
        sub._on_message("r", 2, batches[2][:-3])
        assert sub.resyncs == 1 and router.index.num_blocks("r") == 0
        buffer.mute = False
        buffer.held = list(enumerate(batches))[2:]  # its buffer has moved past 0
        sub._on_message("r", 4, batches[4])     # batch 3 lost: the gap is filled from it
        assert (sub.restarts, sub.resyncs, sub.unsent_frames) == (0, 1, 0)
        assert [router.cached_tokens(p)["r"] for p in P] == [0, 0, 0, 12, 12, 0]
        sub._on_message("r", 5, batches[5])
        assert [router.cached_tokens(p)["r"] for p in P] == [0, 0, 0, 12, 12, 12]
    finally:
        sub.close()
