"""The replica the connector tests drive: examples/vllm_connector.py's (see there)."""

import pathlib
import runpy

_EXAMPLE = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[3] / "examples"
                              / "vllm_connector.py"))
BLOCK, LAYERS = _EXAMPLE["BLOCK"], _EXAMPLE["LAYERS"]
Replica, model_dir, kv_value = _EXAMPLE["Replica"], _EXAMPLE["model_dir"], _EXAMPLE["kv_value"]
vllm_config, kv_cache_config = _EXAMPLE["vllm_config"], _EXAMPLE["kv_cache_config"]
