"""How prefixkv's preparing hasher reaches vLLM's input thread, with no vLLM file changed.

vLLM 0.33's ``EngineCore.__init__`` builds its scheduler (``Scheduler(...)``, so
prefixkv's manager when ``--scheduler-cls`` names prefixkv's), then, with prefix caching
on or a KV connector, ``self.request_block_hasher = get_request_block_hasher(...)``, the
hasher it gives every ``Request`` it builds (``preprocess_add_request``, on the input
thread of ``EngineCoreProc``). The scheduler comes first, so the manager exists before
the hasher, and before any request (tests/engines/test_vllm_prepare.py builds vLLM's own
``EngineCore`` and finds its hasher bound to its scheduler's manager).

``install()`` (prefixkv's ``Scheduler`` calls it when ``vllm.v1.engine.core`` is loaded)
puts ``block_hasher_for_engine`` under that name in ``vllm.v1.engine.core``, once per
process. It builds vLLM's hasher as before and looks at its caller, the engine being
built: when that engine's scheduler's ``kv_cache_manager`` is prefixkv's, the answer is
that manager's ``PreparingHasher`` around vLLM's; for any other engine (vLLM's own
scheduler, another plug-in) it is vLLM's hasher itself. It keeps no state: the engine is
found from the calling frame, so an engine built later, on any thread, is judged anew.
Without prefix caching and without a connector vLLM builds no hasher, and prefixkv
encodes the prompt on the scheduler's thread, as before.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from .prepared import PreparedPrompts

__all__ = ["block_hasher_for_engine", "install"]

_ENGINE_CORE = "vllm.v1.engine.core"
_NAME = "get_request_block_hasher"
_INSTALLING = threading.Lock()


def prepared_prompts_of(engine: object) -> PreparedPrompts | None:
    """The ``PreparedPrompts`` of ``engine.scheduler.kv_cache_manager`` when that is
    prefixkv's manager, else None."""
    manager = getattr(getattr(engine, "scheduler", None), "kv_cache_manager", None)
    prompts = getattr(manager, "prepared_prompts", None)
    return prompts if isinstance(prompts, PreparedPrompts) else None


def block_hasher_for_engine(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``get_request_block_hasher`` (``original``), answering for the engine that
    calls it (``self`` in the caller's frame: ``EngineCore.__init__``) as the module
    docstring says."""

    def get_request_block_hasher(*args: Any, **kwargs: Any) -> Any:
        hasher = original(*args, **kwargs)
        prompts = prepared_prompts_of(sys._getframe(1).f_locals.get("self"))  # noqa: SLF001
        return hasher if prompts is None else prompts.hasher(hasher)

    get_request_block_hasher.prefixkv_wraps = original  # type: ignore[attr-defined]
    return get_request_block_hasher


def install() -> bool:
    """Put ``block_hasher_for_engine`` in ``vllm.v1.engine.core`` if that module is
    loaded and it is not there yet; whether it is there now."""
    module = sys.modules.get(_ENGINE_CORE)
    if module is None:
        return False
    with _INSTALLING:
        current = getattr(module, _NAME)
        if getattr(current, "prefixkv_wraps", None) is None:
            setattr(module, _NAME, block_hasher_for_engine(current))
    return True
