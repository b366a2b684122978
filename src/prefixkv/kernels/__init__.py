"""The model-runner half of prefixkv: paged KV-cache writes, prefix-prefill attention, and
block transfers between device and host caches (the manager's per-step plan).

Needs the ``kernels`` extra (torch; triton for the GPU path). Importing this package
imports torch but neither Triton nor any device: the backend is chosen per call (Triton
for CUDA tensors, the pure-torch reference elsewhere). Layout: ``docs/kv_layout.md``.
"""

try:  # the kernels extra: say which install is missing, not a bare ModuleNotFoundError
    import torch  # noqa: F401
except ImportError as exc:
    from ..errors import ExtraNotInstalledError

    raise ExtraNotInstalledError("prefixkv.kernels", "kernels", "torch") from exc


from .backend import BACKENDS, resolve_backend, use_backend
from .batch import (
    PagedBatch,
    build_block_table,
    build_cu_seqlens_q,
    build_paged_batch,
    build_seqused_k,
    build_slot_mapping,
)
from .cascade import CascadeBatch, build_cascade_batch, cascade_attention, merge_attention
from .cascade_cost import CascadeKeys, cascade_keys
from .dispatch import paged_prefill_attention, write_kv_cache
from .errors import (
    ArgumentTypeError,
    BackendError,
    BatchError,
    BlockIdError,
    DeviceError,
    DtypeError,
    KernelInputError,
    MetadataError,
    ShapeError,
    TensorValueError,
    UnsupportedError,
)
from .fp8 import FP8_DTYPES
from .reference import paged_prefill_attention_reference, write_kv_cache_reference
from .transfer import alloc_host_cache, copy_blocks, load_blocks, offload_blocks, run_kv_ops, transfer_stream
from .variants import AttentionSpec, attention_variants, warmup
from .workspace import SplitWorkspace, alloc_split_workspace

__all__ = [
    "ArgumentTypeError",
    "AttentionSpec",
    "BACKENDS",
    "BackendError",
    "BatchError",
    "BlockIdError",
    "CascadeBatch",
    "CascadeKeys",
    "DeviceError",
    "DtypeError",
    "FP8_DTYPES",
    "KernelInputError",
    "MetadataError",
    "PagedBatch",
    "ShapeError",
    "SplitWorkspace",
    "TensorValueError",
    "UnsupportedError",
    "alloc_host_cache",
    "alloc_split_workspace",
    "attention_variants",
    "build_block_table",
    "build_cascade_batch",
    "build_cu_seqlens_q",
    "build_paged_batch",
    "build_seqused_k",
    "build_slot_mapping",
    "cascade_attention",
    "cascade_keys",
    "copy_blocks",
    "load_blocks",
    "merge_attention",
    "offload_blocks",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "resolve_backend",
    "run_kv_ops",
    "transfer_stream",
    "use_backend",
    "warmup",
    "write_kv_cache",
    "write_kv_cache_reference",
]
