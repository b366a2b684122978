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

A hybrid model (sliding-window or chunked local layers beside full attention) runs in
the same ``Engine``: ``build_engine(config, groups=[full_attention(), sliding_window(32)],
layer_groups=[1, 1, 0, ...])`` pairs a ``HybridKVCacheManager`` with a
``HybridModelRunner`` (``prefixkv.engine.hybrid``).
"""

try:  # the kernels extra: say which install is missing, not a bare ModuleNotFoundError
    import torch  # noqa: F401
except ImportError as exc:
    from ..errors import ExtraNotInstalledError

    raise ExtraNotInstalledError("prefixkv.engine", "kernels", "torch") from exc


from .build import UncachedHybridManager, build_engine
from .chat import ChatResult, run_chat, synthetic_conversations
from .engine import Engine
from .model import LlamaConfig, TinyLlama, dense_causal_attention
from .outputs import GenerateResult, RequestMetrics, RequestOutput, SampleOutput, StepRecord
from .runner import ModelRunner, Runner, SeqBatchEntry
from .sequence import SamplingParams

__all__ = [
    "ChatResult", "Engine", "GenerateResult", "LlamaConfig", "ModelRunner", "RequestMetrics",
    "RequestOutput", "Runner", "SampleOutput", "SamplingParams", "SeqBatchEntry", "StepRecord",
    "TinyLlama", "UncachedHybridManager", "build_engine", "dense_causal_attention", "run_chat",
    "synthetic_conversations",
]
