"""vLLM 0.33's HiSparse connector (its scheduler side, ``HiSparseConnectorScheduler``) over
prefixkv's HiSparse manager and over vLLM's own, side by side, as an engine drives it:
each step the scheduler allocates for the requests it schedules, the connector builds the
step's metadata (offload command, host copies, source block ids, row mirrors, whether the
step reads only resident pages, residency updates) and later takes the workers' reports
(copies enqueued and completed, host copies run). The metadata must be vLLM's, step by
step, and so must the connector's stats (host usage, copies in flight). Needs vllm
installed."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from . import skip_module_without_vllm

skip_module_without_vllm()

from vllm.v1.hisparse.coordinator import get_hisparse_coordinator  # noqa: E402

from .hisparse_model import MAX_LEN  # noqa: E402
from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_hisparse_manager import _plugin_manager  # noqa: E402
from .test_vllm_plugin import request as make_request  # noqa: E402


class Engine:
    """One side: a manager, vLLM's connector scheduler bound to its coordinator, and the
    requests it has scheduled (their block ids known to the workers)."""

    def __init__(self, manager: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import HiSparseConnectorScheduler

        self.manager = manager
        self.connector = HiSparseConnectorScheduler(async_speculative=False)
        self.connector.bind_coordinator(get_hisparse_coordinator(manager))
        self.known: set[str] = set()

    def step_with(self, scheduled: dict[str, tuple[Any, int, Any]], counts: dict[str, int]) -> Any:
        """The metadata of a step scheduling ``counts`` tokens of each request of
        ``scheduled`` (request id -> (request, tokens computed before the step, the new
        blocks ``allocate_slots`` returned)), as vLLM's scheduler output carries them."""
        new, cached = [], SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[])
        for rid, (req, start, blocks) in scheduled.items():
            self.connector.requests[rid] = req
            if rid not in self.known:
                new.append(SimpleNamespace(req_id=rid, num_computed_tokens=start,
                                           block_ids=self.manager.get_block_ids(rid)))
                self.known.add(rid)
            else:
                cached.req_ids.append(rid)
                cached.num_computed_tokens.append(start)
                cached.new_block_ids.append(blocks.get_block_ids(allow_none=True))
        output = SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                                 num_scheduled_tokens=dict(counts), has_sync_kv_loads=False)
        return self.connector.build_connector_meta(output)

    def report(self, enqueued: dict[int, int], completed: dict[int, int]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
            HiSparseConnectorWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        self.connector.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=HiSparseConnectorWorkerMetadata(enqueued, completed)))

    def stats(self) -> Any:
        s = self.connector.get_kv_connector_stats()
        return s.data if s is not None else None


@pytest.mark.parametrize("seed", range(4))
def test_the_connector_reads_the_same_steps_from_both_managers(seed: int) -> None:
    rng = random.Random(seed)
    cfg = hisparse_config(rng.randint(14, 32), rng.randint(8, 20), hot_blocks=rng.randint(1, 2))
    kw = {"max_model_len": MAX_LEN, "max_in_flight_tokens": rng.choice([32, 64, MAX_LEN])}
    sides = [Engine(vllm_manager(cfg, **kw)), Engine(_plugin_manager(cfg, **kw))]
    reqs = [make_request(f"s{seed}-{k}", list(range(30 + 30 * k))) for k in range(3)]
    sent: list[int] = []
    seen: set[str] = set()
    for step in range(30):
        scheduled: list[dict[str, Any]] = [{}, {}]
        counts = {}
        for req in reqs:
            left = req.num_tokens - req.num_computed_tokens
            if left <= 0 or rng.random() < 0.3:
                continue
            n = min(left, rng.choice([1, 7, 16, 40]))
            got = [side.manager.allocate_slots(req, n) for side in sides]
            assert (got[1] is None) == (got[0] is None)
            if got[0] is None:
                continue
            assert got[1].get_block_ids() == got[0].get_block_ids()
            counts[req.request_id] = n
            for side, blocks in zip(scheduled, got, strict=True):
                side[req.request_id] = (req, req.num_computed_tokens, blocks)
        metas = [side.step_with(s, counts) for side, s in zip(sides, scheduled, strict=True)]
        assert metas[1] == metas[0], step
        m = metas[0]
        seen |= {k for k, v in (("copies", m.command and m.command.page_transfers),
                                ("mirrors", m.row_mirrors), ("residency", m.residency_updates),
                                ("from host", not m.all_context_pages_resident)) if v}
        for req in reqs:
            req.num_computed_tokens += counts.get(req.request_id, 0)
        if metas[0].command is not None:
            sent += [t.transfer_id for t in metas[0].command.page_transfers]
        done = [t for t in sent if rng.random() < 0.5]
        enqueued, completed = {t: 1 for t in done}, {t: 1 for t in done}
        sent = [t for t in sent if t not in done]
        for side in sides:
            side.report(enqueued, completed)
        assert sides[1].stats() == sides[0].stats()
        for k, req in enumerate(reqs):
            if req.num_computed_tokens >= req.num_tokens and rng.random() < 0.5:
                for side in sides:
                    side.manager.free(req)
                    side.known.discard(req.request_id)
                reqs[k] = make_request(f"s{seed}-{k}-{step}", list(range(30 + 30 * k)))
    assert {"copies", "mirrors", "residency"} <= seen, seen
