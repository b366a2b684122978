"""The stand-ins that let vLLM 0.33.0's own tests run on a CPU machine without a hub.

Imported first (with tests/engines on ``sys.path``) by the process that runs vLLM's test
files (tests/engines/vllm_fork.py, for tests/engines/vllm_suite.py), before any vLLM
module. Everything vLLM's tests use
runs from the installed vllm 0.33.0 wheel unmodified (scheduler, KV cache manager,
block pool, request, configs, KV connectors); this module is the one place that lists
what stands in for something else, and why:

==========================  =================================================================
stand-in                    why, and what it replaces
==========================  =================================================================
local Hugging Face cache    vLLM's ``ModelConfig`` reads the model's ``config.json`` from the
(``HF_HOME``, offline)      hub; there is no hub here. ``config.json`` files for the models
                            the scheduler tests name (``MODELS`` below: architecture and
                            sizes, public facts of those checkpoints) are written into a
                            hub-shaped cache under ``.cache/engines/hf/``, and
                            ``HF_HUB_OFFLINE=1`` makes vLLM and transformers read them
                            there. No weights and no tokenizer: the tests never load a
                            model, and a test that needs a tokenizer or a processor fails
                            the same way with either manager.
``VLLM_TARGET_DEVICE=cpu``   vLLM infers its platform from the GPU it finds or from a CPU
                            build; this wheel is the CUDA build on a machine without a GPU,
                            so the variable selects vLLM's own ``CpuPlatform``.
``caplog_vllm`` fixture     vLLM's fixture of that name lives in its tests/conftest.py, which
(in ``vllm_swap.py``)       the suite leaves out (``--confcutdir=tests/v1``: that conftest
                            imports vLLM's engine and GPU helpers); ``vllm_swap`` gives the
                            tests that ask for it a ``caplog`` that sees vLLM's records, with
                            vLLM's ``*_once`` messages logged again in each of a test's two runs.
==========================  =================================================================

Nothing else is replaced: vLLM's compiled extension (``vllm._C``) is not imported by
the scheduler-side code these tests exercise, so no stand-in is needed for it (a test
that reaches it fails in both runs and counts in neither).
"""

from __future__ import annotations

import json
import os
import pathlib
import threading

ROOT = pathlib.Path(__file__).resolve().parents[2]
HF_HOME = ROOT / ".cache" / "engines" / "hf"
REVISION = "0" * 40  # the one snapshot of each local repo

# config.json of each model vLLM's scheduler tests name (the fields ModelConfig reads).
MODELS: dict[str, dict[str, object]] = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
        "num_hidden_layers": 12, "num_attention_heads": 12, "ffn_dim": 3072,
        "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 768,
        "do_layer_norm_before": True, "activation_function": "relu", "torch_dtype": "float16",
        "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
    },
    "facebook/opt-350m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 1024,
        "num_hidden_layers": 24, "num_attention_heads": 16, "ffn_dim": 4096,
        "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 512,
        "do_layer_norm_before": False, "activation_function": "relu", "torch_dtype": "float16",
        "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
    },
    "meta-llama/Llama-3.2-1B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
}


def write_hub_cache(home: pathlib.Path = HF_HOME) -> None:
    """Write each model of ``MODELS`` as a hub cache repo under ``home`` (idempotent).

    Other processes may be reading these files meanwhile: worktrees link one ``.cache``,
    and every process that imports this module (vLLM's suite, tests/engines/vllm_engine.py)
    calls this. A file already holding its text is left alone; any other is replaced
    whole (``_put``), never truncated in place, where a reader saw an empty
    ``refs/main`` or ``config.json`` and vLLM's ``ModelConfig`` raised "Invalid repository
    ID 'facebook/opt-125m'" (test_vllm_suite's flake under load)."""
    for name, config in MODELS.items():
        repo = home / "hub" / ("models--" + name.replace("/", "--"))
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        _put(repo / "refs" / "main", REVISION)
        _put(snapshot / "config.json", json.dumps(config, indent=1))


def _put(path: pathlib.Path, text: str) -> None:
    """``path`` holds ``text`` afterwards; a reader at any moment sees the old whole file
    or the new one (a file of this process's own beside it, renamed over it)."""
    try:
        if path.read_text() == text:
            return
    except FileNotFoundError:
        pass
    part = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    part.write_text(text)
    os.replace(part, path)


def configure() -> None:
    """Before vLLM is imported: point the hub at the local cache, offline, and select
    vLLM's CPU platform."""
    write_hub_cache()
    os.environ["HF_HOME"] = str(HF_HOME)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"


# At import: everything here must happen before vLLM is imported. vLLM's
# tests/v1/kv_connector/unit/conftest.py imports ``current_platform``, which vLLM
# resolves once per process; set later, the variable came too late for that group
# (vLLM's ``UnspecifiedPlatform``: no device type, no hybrid KV cache), and 7 of its tests
# failed on both managers.
configure()
