"""PageStore's counters under SGLang's three storage threads (prefetch, its I/O pool,
backup), on the real code path with an in-memory store."""

import sys
import threading

from prefixkv.integrations.sglang.pages import PageCounts, PageStore
from prefixkv.store import StoreLayout


class Memory:
    """A StoreBackend of a dict (held, read_into, put as the protocol states)."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}

    def held(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.values:
            n += 1
        return n

    def read_into(self, keys, buffers, deadline):
        out = []
        for key, views in zip(keys, buffers, strict=True):
            value = self.values.get(key)
            if value is None or len(value) != sum(map(len, views)):
                out.append(None if value is None else len(value))
                continue
            at = 0
            for view in views:
                view[:] = value[at:at + len(view)]
                at += len(view)
            out.append(True)
        return out

    def put(self, items):
        self.values.update(items)
        return 0


def test_counts_is_never_a_call_in_part_and_no_count_is_lost():
    """Before: each page of a read was counted as it was checked, one attribute at a
    time, and nothing read them together: a reader beside two prefetch threads, each
    asking one held and one absent page a call, saw hits != misses in 22689 of its
    reads (switch interval 1 us). Now a call adds its counts in one locked step and
    ``counts()`` reads them under the same lock."""
    store = PageStore(Memory(), StoreLayout("threads", "bfloat16", 8), 4)
    assert store.put([("held", b"12345678")])
    calls, seen, torn = 3000, [], []
    done = threading.Event()

    def prefetch() -> None:
        for _ in range(calls):
            assert store.get(["held", "absent"])[1] is None

    def backup() -> None:
        for i in range(calls):
            assert store.put_pages([(f"w{i % 7}", b"abcdefgh")]) == [True]

    def reader() -> None:
        while not done.is_set():
            c = store.counts()
            seen.append(c)
            if c.hits != c.misses:
                torn.append(c)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=prefetch) for _ in range(2)]
        workers.append(threading.Thread(target=backup))
        watch = threading.Thread(target=reader)
        watch.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        done.set()
        watch.join()
    finally:
        sys.setswitchinterval(old)
    assert seen and not torn, torn[:3]
    assert store.counts() == PageCounts(hits=2 * calls, misses=2 * calls, rejected=0,
                                        failed_reads=0, written=calls + 1, failed_writes=0,
                                        failed_calls=0)
