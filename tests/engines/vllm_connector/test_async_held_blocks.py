"""vLLM 0.33's own ``AsyncScheduler`` with the prefixkv connector, steps pipelined as
vLLM's engine core runs them (the next step scheduled before the previous one's output
is processed), nothing of the connector's state set by the test: a request finishing
with its last block's save still to make (its last token unknown when its step was
planned) keeps its blocks until the worker reports that save sent."""

from __future__ import annotations

import time
from typing import Any

from .. import skip_module_without_vllm
from .replica import BLOCK, Replica

skip_module_without_vllm()


def _async(model: str, redis_url: str, num_blocks: int) -> Any:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    a = Replica(model, redis_url, num_blocks=num_blocks)
    a.config.scheduler_config.async_scheduling = True
    a.scheduler = AsyncScheduler(vllm_config=a.config, kv_cache_config=a.kv_config,
                                 structured_output_manager=StructuredOutputManager(a.config),
                                 block_size=BLOCK, log_stats=True)
    return a


def _work(a: Any, out: Any) -> Any:
    """The worker's part of a step (Replica.step's, without the scheduler's)."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    with (a._as_worker(), set_forward_context(None, a.config),
          KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_out):
        a.forward(out)
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids], kv_connector_output=kv_out)


def test_async_scheduling_holds_a_finished_requests_blocks_until_its_final_save_is_sent(model, redis):
    a = _async(model, redis.url, num_blocks=8)
    sched, pool = a.scheduler, a.scheduler.kv_cache_manager.block_pool
    a.add("r1", [(i * 11) % 997 + 1 for i in range(2 * BLOCK - 1)], max_tokens=2)
    seen: list[tuple[str, list[int], int, bool]] = []
    pending = None
    for _ in range(400):  # schedule N+1, then process N's output (vLLM's batch queue)
        time.sleep(0.005)  # (r1 is skipped until its lookup, on another thread, is back)
        out = sched.schedule()
        ran = _work(a, out) if out.total_num_scheduled_tokens or out.kv_connector_metadata else None
        if pending is not None:
            sched.update_from_output(*pending)
        pending = (out, ran) if ran is not None else None
        held = "r1" in sched.requests and sched.requests["r1"].is_finished()
        ids = a.block_ids("r1") if "r1" in sched.requests else []
        seen.append((str(out.finished_req_ids), ids, pool.get_num_free_blocks(), held))
        if "r1" not in sched.requests:
            break
    # r1 finished (its 2nd token) while its last block's save was still to make: it was
    # held (finished, blocks allocated) for at least one step, then freed
    assert any(h and ids and free == 5 for _, ids, free, h in seen), seen  # 2 blocks held
    assert "r1" not in sched.requests, seen
    assert pool.get_num_free_blocks() == 7
    a.worker.worker.flush()
    assert a.worker.worker.stats.saved == 2, a.worker.worker.stats
