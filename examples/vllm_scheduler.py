"""vLLM 0.33's own scheduler on prefixkv's KV cache manager, picked by the flag a server
takes (``--scheduler-cls prefixkv.integrations.vllm.Scheduler``), driven step by step
beside vLLM's unmodified scheduler: both make the same decisions.

    python examples/vllm_scheduler.py

Needs vllm==0.33.0 (its Python sources: ``make install-vllm``). Nothing of vLLM is
patched. What stands in for what a CPU machine without a model hub lacks: the model
config is read from a local ``config.json`` (a 2-layer Llama shape; the scheduler reads
only the config, no weights, no tokenizer), ``VLLM_TARGET_DEVICE=cpu`` selects vLLM's CPU
platform (this wheel is vLLM's CUDA build), and the forward pass is skipped: each step
hands the scheduler a ``ModelRunnerOutput`` that samples token 7 for every request.

Two requests share a 32-token system prompt (two blocks of 16). ``a`` runs to the end,
then ``b`` arrives and is scheduled with the shared blocks already computed.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM resolves its platform

BLOCK = 16
PREFIXKV = "prefixkv.integrations.vllm.Scheduler"


def model_dir() -> str:
    """A local model folder holding only the ``config.json`` vLLM's ModelConfig reads."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="prefixkv-model-"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16", "head_dim": 16}))
    return str(path)


def build(model: str, scheduler_cls: str | None, num_blocks: int = 64) -> Any:
    """The scheduler vLLM's ``EngineCore`` builds: the class from
    ``SchedulerConfig.scheduler_cls`` (None: vLLM's default), the same arguments."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=2048,
                            enable_chunked_prefill=True, is_encoder_decoder=False, watermark=0.0)
    if scheduler_cls is not None:
        sched.scheduler_cls = scheduler_cls  # what --scheduler-cls sets
    config = VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16", seed=42,
                                 max_model_len=2048),
        scheduler_config=sched, device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9,
                                 enable_prefix_caching=True))
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cls = config.scheduler_config.get_scheduler_cls()  # as vllm/v1/engine/core.py does
    return cls(vllm_config=config, kv_cache_config=kv, log_stats=True, block_size=BLOCK,
               structured_output_manager=StructuredOutputManager(config))


def request(rid: str, tokens: list[int], max_tokens: int) -> Any:
    """A vLLM ``Request`` as its input thread builds one (the block hasher included)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, tokens, params, None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def step(scheduler: Any) -> dict[str, tuple[int, int]]:
    """One engine step without a model: schedule, then every scheduled request samples
    token 7. Returns, per request scheduled, (tokens computed before, tokens scheduled)."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    before = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    ids = list(out.num_scheduled_tokens)
    scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids]))
    return {r: (before[r], n) for r, n in out.num_scheduled_tokens.items()}


def serve(scheduler: Any) -> list[dict[str, tuple[int, int]]]:
    """``a`` to its end, then ``b``: the steps' schedules."""
    system = list(range(100, 132))  # 32 tokens: two full blocks
    steps = []
    scheduler.add_request(request("a", [*system, 1, 2, 3], max_tokens=3))
    while scheduler.has_unfinished_requests():
        steps.append(step(scheduler))
    scheduler.add_request(request("b", [*system, 4, 5, 6, 8, 9], max_tokens=2))
    while scheduler.has_unfinished_requests():
        steps.append(step(scheduler))
    return steps


def main() -> None:
    model = model_dir()
    ours, theirs = build(model, PREFIXKV), build(model, None)
    manager = type(ours.kv_cache_manager)
    assert manager.__module__ == "prefixkv.integrations.vllm.manager", manager
    ours_steps, theirs_steps = serve(ours), serve(theirs)
    for i, s in enumerate(ours_steps, start=1):
        print(f"step {i}: " + ", ".join(f"{r} computed {done}, scheduled {n}" for r, (done, n) in s.items()))
    assert ours_steps == theirs_steps, (ours_steps, theirs_steps)
    b_first = next(s["b"] for s in ours_steps if "b" in s)
    assert b_first == (32, 5), b_first  # the shared system prompt came from the cache
    print(f"{manager.__module__}.{manager.__name__} under {type(ours).__module__}.{type(ours).__name__}: "
          f"b found {b_first[0]} tokens cached; every step equals vLLM's own scheduler's")


if __name__ == "__main__":
    main()
