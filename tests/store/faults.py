"""What every fault of the shared store must leave as it found it, for the fault
injection tests (test_fault_injection.py, test_fault_cluster.py): a manager whose device
blocks and host slots hold known KV (``test_server_faults.Engine``: a block's KV is a
digest of its tokens, checked after every landing), the counts a fault must give back,
and a proxy that trickles a real server's replies (``bench.latency_proxy``'s, slowed)."""

import socket
import threading
import time

from prefixkv import StoreWait
from prefixkv.bench.latency_proxy import LatencyProxy
from waiting import PATIENCE

from .test_server_faults import BS, Engine

P = list(range(100, 133))    # eight full blocks + 1: the request a fault hits
Q = list(range(500, 533))    # another chain, for the requests that must go on


def ledger(m):
    """What a fault must give back once its request left: blocks no request holds,
    host slots free, none landing, reserved or pinned, no fetch in flight, holding
    device blocks or waiting, no device block filled by a fetcher."""
    h, w = m._host, m._waits
    return {"free blocks": m.num_free_blocks, "free slots": h.num_free, "landing": h.num_landing,
            "pinned": len(h._pinned), "in flight": w.in_flight, "reserved": w.reserved,
            "holders": len(w.held.holders), "waiting": len(w.waiting),
            "filling": len(m._index.landing), "requests": len(m._requests)}


def counts(m):
    s = m.stats
    return {"errors": s.store_errors, "rejected": s.store_rejected, "hits": s.store_hits}


def landed(e, rid, prompt, expect_wait=True):
    """Poll until ``rid``'s wait is over, then admit it: every cached block's KV is
    checked, the rest computed (``Engine.admit``); returns (cached tokens, new tokens).
    ``expect_wait``: the request is waiting now."""
    m = e.m
    if expect_wait:
        assert isinstance(m._waits.take(rid), StoreWait) or rid in m._waits.waiting
    deadline = time.monotonic() + PATIENCE
    while rid in m._waits.waiting and not m._waits.waiting[rid].ended \
            and not m._waits.waiting[rid].expired:
        assert time.monotonic() < deadline, "a fetch that never ended"
        e.call(m.poll_store)
        time.sleep(0.001)
    cached = e.admit(rid, prompt)
    return cached, m.num_tokens(rid) - cached


def leave(e, *rids):
    """Free ``rids`` and run the plan: what the fault's requests held goes back."""
    for rid in rids:
        e.m.free(rid)
    e.run_plan()
    e.m.check_invariants()


def served(e, prompt):
    """Tokens of ``prompt`` the store serves ``e`` now, every block checked (the device
    and host forgotten first)."""
    return e.probe(prompt)


def warmed(shared, **kw):
    """A reader with its connections open (one fetch of ``Q`` made) and nothing held:
    the ledger the faults must give back is taken from it."""
    e = Engine(shared, **{"num_blocks": 24, "host_blocks": 20, **kw})
    assert e.probe(Q) == len(Q) - 1
    assert e.m.reset_prefix_cache(keep_store=True)
    return e


class Trickle(LatencyProxy):
    """A Unix-socket proxy in front of a real server (``target``: its socket path;
    ``LatencyProxy``, no delay): what clients send goes through at once; what the server
    answers goes back at once, or, while ``slow`` is set, ``size`` bytes every ``gap``
    seconds. ``url``: the proxy's."""

    def __init__(self, target, size=64, gap=0.01):
        self.size, self.gap, self.slow = size, gap, threading.Event()
        super().__init__(target, 0.0)

    def _pipe(self, src, dst, delay):
        reply = src.getpeername() == self.target  # (the server's side: its answers)
        try:
            while data := src.recv(65536):
                while reply and self.slow.is_set() and data:
                    dst.sendall(data[:self.size])
                    data = data[self.size:]
                    time.sleep(self.gap)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


__all__ = ["BS", "P", "Q", "Trickle", "counts", "landed", "leave", "ledger", "served", "warmed"]
