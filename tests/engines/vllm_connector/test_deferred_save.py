"""The worker side as vLLM 0.33's model runner drives it with a speculative config: the
connector's context is left (``get_finished`` called) before ``wait_for_save``, which
``finalize_kv_connector`` calls after the drafter (gpu_model_runner's execute_model and
sample_tokens)."""

from __future__ import annotations

from types import SimpleNamespace

from .. import skip_module_without_vllm
from .replica import BLOCK, Replica

skip_module_without_vllm()


def test_a_final_save_handed_off_after_get_finished_is_reported_sent(model, redis):
    """A finished request's final save reaches the worker in the step whose
    ``finished_req_ids`` name it. With the save deferred past ``get_finished``, the
    worker checked its handed-off finals against that step's ids only, before this
    one was handed off, and against the next steps' ids, which never name it again:
    never reported sent, vLLM never freed the request's blocks (nor forgot it)."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    from prefixkv.integrations.vllm.connector_meta import BlockRun, PrefixKVConnectorMetadata

    a = Replica(model, redis.url)
    final = BlockRun("r1", None, b"\0" * 32, (b"\1" * 32,), (bytes(4 * BLOCK),), (b"",), (3,))

    def step(meta, finished):
        out = SimpleNamespace(kv_connector_metadata=meta, has_sync_kv_loads=False,
                              finished_req_ids=finished)
        with a._as_worker(), set_forward_context(None, a.config):
            with KVConnectorModelRunnerMixin._get_kv_connector_output(
                    out, defer_finalize=True) as kv_out:
                pass                                        # the target model's forward
            KVConnectorModelRunnerMixin.finalize_kv_connector()   # after the drafter
        return kv_out.finished_sending

    sent = [step(PrefixKVConnectorMetadata(finals=[final]), {"r1"})]
    sent += [step(PrefixKVConnectorMetadata(), set()) for _ in range(2)]
    assert sent in ([{"r1"}, set(), set()], [set(), {"r1"}, set()])   # once, at once or next
    a.worker.worker.flush()
    assert a.worker.worker.stats.saved == 1
