"""Adapters that map other engines' KV-cache-manager calls onto prefixkv (pure Python).

``prefixkv.adapters.vllm``: vLLM v1 ``KVCacheManager``-shaped methods;
``prefixkv.adapters.vllm_hybrid``: the same over layer groups (hybrid models).
"""
