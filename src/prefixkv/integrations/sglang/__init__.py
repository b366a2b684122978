"""SGLang 0.5.23 HiCache storage backend on prefixkv's shared store: ``storage``
(``PrefixKVStorage``, imports SGLang and torch) over ``pages`` (``PageStore``, neither).
See docs/sglang.md."""
