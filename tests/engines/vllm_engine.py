"""vLLM 0.33.0's own ``EngineCore``, built on a CPU machine with no model: what builds a
``Request`` the way a served request is built (tests/engines/test_vllm_prepare.py and
benchmarks/bench_vllm_prepare.py use it).

``EngineCore.__init__`` runs unchanged: it loads the plugins, builds its scheduler from
``SchedulerConfig.scheduler_cls`` (prefixkv's, when named), then the block hasher it
gives every request; ``preprocess_add_request`` builds a ``Request`` from an
``EngineCoreRequest`` as its input thread does. Its stand-ins, the only ones:

==========================  =================================================================
stand-in                    why, and what it replaces
==========================  =================================================================
``StandInExecutor``         vLLM's executor starts workers that load the model on a GPU. This
                            one (a subclass of vLLM's ``Executor``) answers the engine's
                            start-up calls as one worker would: one full-attention layer's KV
                            spec, the layouts it supports, the memory for ``num_blocks``
                            blocks; everything else returns nothing. It never runs a step
                            (``EngineCore.step`` is not called: schedulers are driven by hand).
the model's ``config.json``  ``ModelConfig`` reads it; it is vllm_cpu.py's copy of the public
                            config of Llama-3.2-1B (no weights, no tokenizer), read from its
                            local folder.
==========================  =================================================================
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

try:  # (configures the process for vLLM on a CPU at import, as for vLLM's suite)
    from . import vllm_cpu
except ImportError:  # imported as a top-level module: the benchmark puts this folder on sys.path
    import vllm_cpu  # type: ignore[no-redef]

BS = 16
MODEL = "meta-llama/Llama-3.2-1B-Instruct"
PREFIXKV = "prefixkv.integrations.vllm.Scheduler"


def _spec() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _executor_class(num_blocks: int) -> type:
    from vllm.v1.executor.abstract import Executor

    spec = _spec()
    answers = {"get_kv_cache_spec": [{"layer": spec}], "get_supported_kv_cache_layouts": [["NHD"]],
               "determine_available_memory": [num_blocks * spec.page_size_bytes],
               "compile_or_warm_up_model": []}

    class StandInExecutor(Executor):
        """One stand-in worker's answers to the engine's start-up calls (module doc)."""

        def _init_executor(self) -> None:
            pass

        def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None, non_block: bool = False) -> Any:
            return answers.get(method, [None])

        def check_health(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

    return StandInExecutor


def engine_core(scheduler_cls: str | None = PREFIXKV, *, num_blocks: int = 1000, max_model_len: int = 8192,
                enable_prefix_caching: bool = True) -> Any:
    """vLLM's ``EngineCore`` over ``StandInExecutor``, its scheduler ``scheduler_cls``
    (None: vLLM's own), every prompt admitted in one step."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.engine.core import EngineCore

    repo = vllm_cpu.HF_HOME / "hub" / ("models--" + MODEL.replace("/", "--"))
    folder = repo / "snapshots" / vllm_cpu.REVISION
    model = ModelConfig(model=str(folder), dtype="float16", seed=42, skip_tokenizer_init=True,
                        max_model_len=max_model_len)
    scheduler = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=max_model_len,
                                max_model_len=max_model_len, enable_chunked_prefill=True,
                                is_encoder_decoder=False, watermark=0.0)
    if scheduler_cls is not None:
        scheduler.scheduler_cls = scheduler_cls
    cache = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=enable_prefix_caching)
    config = VllmConfig(scheduler_config=scheduler, model_config=model, cache_config=cache)
    return EngineCore(config, _executor_class(num_blocks), log_stats=False)


def engine_request(rid: str, tokens: list[int] | None, *, max_tokens: int = 4, **fields: Any) -> Any:
    """The ``EngineCoreRequest`` vLLM's front end sends for a prompt (``fields``: vLLM's
    ``cache_salt``, ``lora_request``, ``mm_features``, ``prompt_embeds``, ...)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    base = {"mm_features": None, "lora_request": None, "cache_salt": None, "data_parallel_rank": None}
    return EngineCoreRequest(request_id=rid, prompt_token_ids=tokens, pooling_params=None,
                             sampling_params=SamplingParams(max_tokens=max_tokens), arrival_time=time.time(),
                             **{**base, **fields})


def build_on_input_thread(engine: Any, requests: Iterable[Any]) -> tuple[list[Any], int]:
    """``engine.preprocess_add_request`` on each, on a thread of its own (as vLLM's input
    thread builds them): the ``Request`` objects and that thread's id."""
    built: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            built.extend(engine.preprocess_add_request(r)[0] for r in requests)
        except BaseException as e:  # handed to the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="input")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    assert thread.ident is not None
    return built, thread.ident
