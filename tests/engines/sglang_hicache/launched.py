"""SGLang's launch flags published in this process, as its scheduler process has them.

A server's scheduler process calls ``sglang.srt.runtime_context.publish(server_args,
role="scheduler")``: that resolves the flags (``ServerArgs.resolve_once``, which reads
the model's config from its folder or hub: none here) and then projects them into the
config namespaces (``RuntimeContext.set_server_args``) that SGLang's KV-pool and
weight-loading code read (``get_model()``, ``get_spec()``). ``launched`` runs that
second step on SGLang's own ``ServerArgs`` (stand-in: the resolution, so flags stay as
given; "auto" stays "auto") and restores the process's context after. SGLang's
modules are loaded as ``controller.load`` loads them (its stand-ins).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def launched(model_path: str = "test/model", **flags: Any) -> Iterator[Any]:
    """Within: SGLang's flags of ``--model-path model_path`` and ``flags`` (ServerArgs
    field names) published in this process; the ServerArgs is yielded. Skips where
    SGLang's server arguments do not import (``controller.load``'s stand-ins)."""
    from .controller import load

    load()
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    context = get_context()
    saved = (context._server_args, context._config_bags, context.parallel._config,
             context.flags.capture.enable_torch_compile)
    args = ServerArgs(model_path=model_path, **flags)
    context.set_server_args(args)
    try:
        yield args
    finally:
        (context._server_args, context._config_bags, context.parallel._config,
         context.flags.capture.enable_torch_compile) = saved
