"""The store's failure modes under SGLang 0.5.23's own HiCacheController (controller.py):
a value of another Redis type mid-prefix, a full Redis (noeviction), a server paused
past the call bound. SGLang sees misses and dropped backups, never an exception from
the backend, and never a page other than the one written."""

from __future__ import annotations

import os
import signal
import time

import torch

from prefixkv.store.server import LocalRedis

from .controller import Engine, closing  # noqa: F401
from .test_controller import no_errors_in_sglang_threads, redis, s, same, tokens  # noqa: F401
from .test_storage import PAGE, fill, indices, page_hashes, replica, sgl  # noqa: F401


def test_a_key_of_another_redis_type_mid_prefix_is_a_miss(s, redis, caplog):  # noqa: F811
    a, b = Engine(s, redis.url), Engine(s, redis.url)
    toks = tokens(6 * 4, 8000)
    done, written = a.backup(toks, seed=20)
    key = a.backend.pages.key(a.hashes(toks)[2])
    client = a.backend.backend.client
    client.delete(key)
    client.rpush(key, b"not a page")                       # WRONGTYPE for GET
    got, loaded = b.prefetch(toks)
    assert got == 2 * 4 and same(written, loaded)
    assert b.backend.pages.failed_reads == 1 and b.backend.pages.failed_calls == 0
    no_errors_in_sglang_threads(caplog)


def test_a_full_redis_drops_backups_and_serves_what_it_holds(s, caplog):  # noqa: F811
    # 8 KiB pages (8 layers), 2 MiB of Redis under noeviction: the backups that no
    # longer fit are refused page by page; SGLang counts the batch as not backed up.
    with LocalRedis(maxmemory=2 << 20, policy="noeviction") as server:
        a = Engine(s, server.url, layers=8, page=16, tokens=512)
        b = Engine(s, server.url, layers=8, page=16, tokens=512)
        runs = []
        for i in range(30):
            toks = tokens(256, 10000 + 1000 * i)
            done, written = a.backup(toks, seed=30 + i)
            runs.append((toks, done, written))
        assert runs[0][1] == 256 and runs[-1][1] == 0
        assert a.backend.pages.failed_writes > 0 and a.backend.pages.failed_calls == 0
        for toks, done, written in runs:
            got, loaded = b.prefetch(toks)
            assert got >= done and same(written, loaded)
        no_errors_in_sglang_threads(caplog)


def test_a_paused_server_costs_misses_within_the_bound_then_serves_again(s, caplog):  # noqa: F811
    with LocalRedis() as server:
        a = Engine(s, server.url, timeout=0.3)
        b = Engine(s, server.url, timeout=0.3)
        toks = tokens(16, 20000)
        done, written = a.backup(toks, seed=40)
        os.kill(server._proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            assert b.prefetch(toks) == (0, [])             # the hit query gave up
            assert a.backup(tokens(16, 20100), seed=41)[0] == 0
            assert time.monotonic() - start < 10            # (two calls of 0.3 s, slack)
        finally:
            os.kill(server._proc.pid, signal.SIGCONT)
        got, loaded = b.prefetch(toks)
        assert done == got == 16 and same(written, loaded)
        no_errors_in_sglang_threads(caplog)


def test_a_partly_refused_backup_reports_exactly_the_pages_not_stored(sgl):  # noqa: F811
    from .engine import HostPool

    with LocalRedis(maxmemory=2 << 20, policy="noeviction") as server:
        backend, pool = replica(sgl, server.url,   # 16 KiB pages
                                pool=HostPool(64, PAGE, layers=4, heads=4, head_dim=64))
        fill(pool, 50)
        # (the store's own connection, which its writes and existence checks use, opened
        # before the server fills: its buffers count against maxmemory, and its query
        # buffer, grown by the writes, keeps some of the room made below: that room is
        # made a page at a time, until part of a batch fits)
        backend.batch_exists(page_hashes(sgl, tokens(PAGE, 29000), PAGE))
        stored = []
        for i in range(400):
            keys = page_hashes(sgl, tokens(8 * PAGE, 30000 + 100 * i), PAGE)
            if not all(backend.batch_set_v1(keys, indices(0, 8))):
                break
            stored += keys
        client = backend.backend.client
        for n in range(1, 9):
            client.delete(backend.pages.key(stored[n - 1]))
            keys = page_hashes(sgl, tokens(8 * PAGE, 90000 + 1000 * n), PAGE)
            results = backend.batch_set_v1(keys, indices(0, 8))
            held = backend.batch_exists(keys)
            if held:
                break
        if not 0 < held < 8 or backend.pages.failed_writes == 0:
            raise RuntimeError(f"no partly refused batch to check (held {held})")
        assert results == [True] * held + [False] * (8 - held)


def test_a_partly_failed_read_reports_exactly_the_pages_not_loaded(sgl, redis):  # noqa: F811
    """Pages 1 (absent), 3 (another type) and 5 (another page's value) fail; 0, 2 and 4
    are read into their own host pages and nowhere else."""
    writer, wpool = replica(sgl, redis.url)
    reader, rpool = replica(sgl, redis.url)
    fill(wpool, 80)
    keys = page_hashes(sgl, tokens(6 * PAGE, 40000), PAGE)
    assert writer.batch_set_v1(keys, indices(0, 6)) == [True] * 6
    client, pages = writer.backend.client, writer.pages
    client.delete(pages.key(keys[1]))
    client.delete(pages.key(keys[3]))
    client.rpush(pages.key(keys[3]), b"x")
    client.set(pages.key(keys[5]), client.get(pages.key(keys[4])))
    rpool.kv_buffer.fill_(-1.0)
    expected = rpool.kv_buffer.clone()
    assert reader.batch_get_v1(keys, indices(8, 6)) == [True, False, True, False, True, False]
    for i in (0, 2, 4):
        expected[:, :, 8 + i * PAGE:8 + (i + 1) * PAGE] = wpool.kv_buffer[:, :, i * PAGE:(i + 1) * PAGE]
    assert torch.equal(rpool.kv_buffer, expected)
    p = reader.pages
    assert (p.hits, p.misses, p.failed_reads, p.rejected) == (3, 1, 1, 1)
