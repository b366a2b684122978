"""Where prefixkv meets real engines; the only part of prefixkv that imports one.

- ``prefixkv.integrations.vllm``: vLLM 0.33.0 (pinned): the scheduler plugin
  (``--scheduler-cls prefixkv.integrations.vllm.Scheduler``) whose KV cache manager is
  prefixkv; see docs/integration.md, "With vLLM".

Importing this package imports no engine: each engine's subpackage imports its engine
when it is imported itself.
"""
