"""Fleet side of an engine: KV events on the wire in vLLM's format (``wire``,
``publisher``; extra ``prefixkv[events]``) and Prometheus metrics (``metrics``; extra
``prefixkv[metrics]``). The optional packages are imported only inside these modules."""
