"""A finished request whose last blocks are still to be saved, inside vLLM 0.33's own
Scheduler: its blocks stay allocated (``request_finished`` returned True) until the
worker reports the final save sent, so no other request is given them while the save
reads them; ``has_pending_block_frees`` stays False (see the connector)."""

from __future__ import annotations

import torch

from .. import skip_module_without_vllm
from .replica import BLOCK, Replica
from .test_connector import expected_kv

skip_module_without_vllm()

# SYNC: these tests place each request's admission in a given step (r2 must wait for r1's
# held blocks, not for its lookup): the lookup is made on the scheduler's thread
# (``lookup_thread=False``), answered in the step that asks.


def prompt(n: int) -> list[int]:
    return [(i * 11) % 997 + 1 for i in range(n)]


def test_a_final_save_holds_the_blocks_until_the_worker_reports_it_sent(model, redis):
    a = Replica(model, redis.url, num_blocks=8, lookup_thread=False)  # SYNC
    connector = a.scheduler.connector
    pool = a.scheduler.kv_cache_manager.block_pool
    a.add("r1", prompt(2 * BLOCK), max_tokens=2)
    a.step()  # the prefill: both full blocks computed, and saved with this step

    def save_pending() -> None:
        # what async scheduling or a rejected draft leaves: the last block's tokens
        # were not known when its step was planned, so it goes out at finish
        connector.scheduler._chains["r1"].saved = 1

    a.step(after_schedule=save_pending)  # r1 decodes its 2nd token and finishes
    held = a.tables["r1"]
    assert "r1" in a.scheduler.requests  # not forgotten: its free waits for the save
    assert a.block_ids("r1") == held
    assert all(pool.blocks[b].ref_cnt == 1 for b in held)
    assert connector.has_pending_block_frees() is False

    free = pool.get_num_free_blocks()
    a.add("r2", prompt(free * BLOCK + 1)[::-1], max_tokens=1)  # fits only with r1's blocks
    seen: dict[str, list[int]] = {}

    def during_the_final_save() -> None:
        seen["r2"] = a.block_ids("r2")
        seen["r1"] = a.block_ids("r1")

    out = a.step(after_schedule=during_the_final_save)
    assert "r1" in out.finished_req_ids
    assert seen["r1"] == held and seen["r2"] == []  # r2 waits: r1's blocks are read
    assert "r1" not in a.scheduler.requests  # reported sent in that step: freed then
    assert all(pool.blocks[b].ref_cnt == 0 for b in held)
    a.step()
    assert set(a.tables["r2"]) & set(held)  # r2 runs in the blocks the save read
    a.worker.worker.flush()
    assert a.worker.worker.stats.saved == 2 + 1 + free  # the prefill, the final, r2


def test_the_final_save_holds_the_kv_of_its_request_not_of_the_next_one(model, redis):
    """The hazard itself: were r1's blocks freed at finish, r2's forward would write
    them before the final save's gather (same step), and the store would hold r2's
    KV under r1's names, checksummed as read: a later hit, wrong KV."""
    a = Replica(model, redis.url, num_blocks=8, lookup_thread=False)  # SYNC
    connector = a.scheduler.connector
    a.add("r1", prompt(2 * BLOCK - 1), max_tokens=2)
    a.step()  # the prefill: block 0 saved with it

    build = connector.build_connector_meta

    def save_at_finish(out):
        # block 1 left to the final save alone (as when its last token, sampled in
        # the step before, was not known when this step was planned)
        meta = build(out)
        meta.saves.clear()
        connector.scheduler._chains["r1"].saved = 1
        return meta

    connector.build_connector_meta = save_at_finish
    a.step()  # decodes token 31 and finishes
    del connector.build_connector_meta
    assert a.worker.worker.stats.saved == 1 and "r1" in a.scheduler.requests
    tokens = prompt(2 * BLOCK - 1) + [7]  # (the stand-in model samples 7)
    usable = a.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1  # (block 0: null)
    a.add("r2", prompt(usable * BLOCK)[::-1], max_tokens=1)  # every block, r1's too
    a.run()
    a.worker.worker.flush()

    b = Replica(model, redis.url)
    b.add("r3", tokens + [5])
    b.run()
    assert b.worker.worker.stats.loaded == 2
    expect = expected_kv(tokens, 1)
    got = b.block_kv(b.tables["r3"][1])
    assert all(torch.equal(g, e) for g, e in zip(got, expect, strict=True))
