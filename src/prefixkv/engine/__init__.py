"""A minimal continuous-batching engine built only on prefixkv's public API.

It runs a tiny Llama-style model with random weights over a paged KV cache: on the CPU
through the torch reference attention, on a GPU through the Triton kernels. It exists
to show (and test) how an engine drives ``KVCacheManager`` (admission with prefix lookup,
preemption on shortage, forks, free, stats and events) and to give ``prefixkv bench`` an
end-to-end workload. Needs torch (``prefixkv[kernels]``); ``import prefixkv`` never
imports this package.

Typical use::

    from prefixkv.engine import LlamaConfig, SamplingParams, build_engine
    engine = build_engine(LlamaConfig(num_layers=2), num_blocks=128, block_size=16)
    result = engine.generate([[1, 2, 3], [1, 2, 4]], SamplingParams(max_tokens=8))
    result.outputs[0].token_ids, result.num_prefill_tokens, result.stats.hit_rate
"""

from .chat import ChatResult, run_chat, synthetic_conversations
from .engine import Engine, build_engine
from .model import LlamaConfig, TinyLlama, dense_causal_attention
from .outputs import GenerateResult, RequestMetrics, RequestOutput, SampleOutput, StepRecord
from .runner import ModelRunner, SeqBatchEntry
from .sequence import SamplingParams

__all__ = [
    "ChatResult", "Engine", "GenerateResult", "LlamaConfig", "ModelRunner", "RequestMetrics",
    "RequestOutput", "SampleOutput", "SamplingParams", "SeqBatchEntry", "StepRecord",
    "TinyLlama", "build_engine", "dense_causal_attention", "run_chat", "synthetic_conversations",
]
