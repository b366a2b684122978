"""Where prefixkv meets real engines; the only part of prefixkv that imports one.

Each entry point is a class the engine loads by the name given to it on its command line:

- vLLM 0.33.0 (pinned), the scheduler plug-in: ``--scheduler-cls
  prefixkv.integrations.vllm.AsyncScheduler`` (vLLM schedules asynchronously by default;
  ``Scheduler`` with ``--no-async-scheduling``), vLLM's own scheduler whose KV cache
  manager is prefixkv's (docs/integration.md, "With vLLM").
- vLLM 0.33.0, the KV connector: ``--kv-transfer-config`` with ``kv_connector_module_path``
  ``prefixkv.integrations.vllm.connector`` (``PrefixKVConnector``): vLLM's own manager,
  blocks shared through prefixkv's store (docs/vllm_connector.md).
- SGLang 0.5.23, the HiCache storage backend: ``--hicache-storage-backend dynamic`` naming
  ``prefixkv.integrations.sglang.storage`` (``PrefixKVStorage``; docs/sglang.md).

Importing this package imports no engine: each engine's module imports its engine when
it is imported itself (``prefixkv.integrations.vllm`` loads its names lazily).
"""
