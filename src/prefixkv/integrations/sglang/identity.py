"""What changes the KV a host page holds besides the host pool's shape: the weights
(model path and revision, quantization, a draft model whose layers share the page),
Hugging Face config overrides, the KV cache dtype with the model's dtype beside it,
and the KV scales file, as ``StoreLayout`` text.

SGLang 0.5.23 hands a storage backend its served model name only
(``HiCacheStorageConfig.model_name``: ``--served-model-name``, else the model path),
nothing of the weights. The rest is read from the launch flags SGLang publishes in
each scheduler process (``sglang.srt.runtime_context``: the ``model`` and ``spec``
namespaces, the ones its own KV-pool and weight-loading code reads). Where SGLang
published none (a program that builds SGLang's cache controller itself), nothing tells
the weights: ``published`` answers None and the backend refuses to start unless
``extra_config['model']`` names them.

Each fact enters the text only where it differs from a model run as it comes (default
dtype and KV dtype, no quantization, overrides, scales file or draft layers, the model
path as the served name), so such a deployment keeps the keys it had.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Flags:
    """The launch flags that change the KV of one served model name (SGLang's names)."""

    model_path: str
    revision: str | None = None
    quantization: str | None = None
    modelopt_quant: object = None
    json_model_override_args: str = "{}"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization_param_path: str | None = None
    load_format: str = "auto"
    draft_model_path: str | None = None
    draft_model_revision: str | None = None
    draft_model_quantization: str | None = None


def published() -> Flags | None:
    """The flags SGLang published in this process, or None where it published none
    (or its runtime context does not import: a SGLang other than 0.5.23's layout)."""
    try:
        from sglang.srt.runtime_context import get_context
    except ImportError:
        return None
    context = get_context()
    if not context.is_config_namespace_published("model"):
        return None
    m = context.config_bag("model")
    s = (context.config_bag("spec") if context.is_config_namespace_published("spec")
         else None)
    return Flags(
        model_path=str(m.model_path), revision=m.revision, quantization=m.quantization,
        modelopt_quant=m.modelopt_quant, json_model_override_args=m.json_model_override_args,
        dtype=str(m.dtype), kv_cache_dtype=str(m.kv_cache_dtype),
        quantization_param_path=m.quantization_param_path, load_format=str(m.load_format),
        draft_model_path=getattr(s, "speculative_draft_model_path", None),
        draft_model_revision=getattr(s, "speculative_draft_model_revision", None),
        draft_model_quantization=getattr(s, "speculative_draft_model_quantization", None))


def layout_text(name: str, flags: Flags, *, named: bool, draft_layers: bool) -> str:
    """The text ``flags`` add to a layout named ``name`` (empty for a model run as it
    comes, served under its model path). ``named``: ``name`` is the operator's name of
    the weights (``extra_config['model']``), which then stands for the model path and
    revision (replicas may load one checkpoint from other paths). ``draft_layers``:
    whether the host pool's pages hold a draft model's layers too (SGLang packs an
    EAGLE draft's KV beside the target's), whose weights then change the page as well."""
    out = ""
    weights = _at(flags.model_path, flags.revision)
    if not named and weights != name:
        out += f"|w={weights}"
    if flags.quantization is not None:
        out += f"|q={flags.quantization}"
    if flags.modelopt_quant is not None:
        out += f"|mq={_digest(json.dumps(flags.modelopt_quant, sort_keys=True, default=repr))}"
    overrides = _overrides(flags.json_model_override_args)
    if overrides:
        out += f"|hf={_digest(overrides)}"
    if flags.kv_cache_dtype != "auto":  # the host pool's dtype no longer tells the model's
        out += f"|kv={flags.kv_cache_dtype}|compute={flags.dtype}"
    if flags.quantization_param_path is not None:
        out += f"|scales={_file_digest(flags.quantization_param_path)}"
    if flags.load_format != "auto":
        out += f"|load={flags.load_format}"
    if draft_layers:
        out += f"|draft={_at(str(flags.draft_model_path), flags.draft_model_revision)}"
        if flags.draft_model_quantization is not None:
            out += f"|dq={flags.draft_model_quantization}"
    return out


def _at(path: str, revision: str | None) -> str:
    return path if revision is None else f"{path}@{revision}"


def _digest(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()[:16]


def _overrides(text: str | None) -> str:
    """``--json-model-override-args`` as canonical JSON ('' when it overrides nothing);
    text that is not JSON as given (SGLang would refuse it at launch)."""
    if not text:
        return ""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return json.dumps(value, sort_keys=True) if value else ""


def _file_digest(path: str) -> str:
    """The KV scales file by its bytes (a file edited in place is other scales), or by
    its path where it cannot be read here."""
    try:
        with open(path, "rb") as f:
            return _digest(f.read())
    except OSError:
        return f"path:{path}"
