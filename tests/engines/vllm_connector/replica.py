"""The replica the connector tests drive: examples/vllm_connector.py's (see there)."""

import pathlib
import runpy

_EXAMPLE = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[3] / "examples"
                              / "vllm_connector.py"))
BLOCK, LAYERS = _EXAMPLE["BLOCK"], _EXAMPLE["LAYERS"]
Replica, model_dir, kv_value = _EXAMPLE["Replica"], _EXAMPLE["model_dir"], _EXAMPLE["kv_value"]
vllm_config, kv_cache_config = _EXAMPLE["vllm_config"], _EXAMPLE["kv_cache_config"]


def looked_up(replica, seconds: float = 30.0) -> None:
    """One step, in which vLLM asks the connector about its waiting requests and is told
    "not yet" (their lookups go to the connector's lookup thread), then wait until the
    thread answered them all: the next step plans with the answers."""
    import time

    replica.step()
    lookups = replica.scheduler.connector.scheduler._lookups
    deadline = time.monotonic() + seconds
    while lookups.in_flight():
        assert time.monotonic() < deadline, "the lookups never came back"
        time.sleep(0.002)
