"""vLLM 0.33.0's own ``vllm/distributed/kv_events.py`` (its event structs and its
``ZmqEventPublisher``) and its extra-key functions, run from the release wheel that
``python tests/engines/fetch.py vllm`` puts in ``.cache/engines/`` (``make test`` runs
it). A missing wheel fails the tests that need it, loudly: never a skip.

The file is read from the wheel and executed as it is. Besides msgspec and pyzmq it
imports four things of vLLM, whose modules pull in torch, pydantic and vLLM's whole
configuration; only these are stood in for:

- ``vllm.config.kv_events.KVEventsConfig``: vLLM's own file is executed, with its
  decorator ``vllm.config.utils.config`` (a pydantic dataclass with extra fields
  forbidden) stood in for by ``dataclasses.dataclass``;
- ``vllm.logger.init_logger``: ``logging.getLogger``;
- ``vllm.utils.network_utils`` (``get_ip``, ``get_tcp_uri``, ``is_valid_ipv6_address``,
  ``split_zmq_path``): used only to bind ``tcp://*:0``, which these tests do not; the
  stand-ins raise;
- ``vllm.v1.core.kv_cache_utils``: ``ExternalBlockHash`` and the extra-key functions
  (``generate_block_hash_extra_keys`` with the ``_gen_*`` helpers it calls, and
  ``to_event_extra_keys``) are executed from vLLM's own source of that file, one
  definition at a time (``ast``); its imports are not (``Request``, an annotation
  there, is ``object``).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import logging
import pathlib
import sys
import types
import zipfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
VERSION = "0.33.0"
WHEEL = ROOT / ".cache" / "engines" / f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
_EXTRA_KEY_DEFS = ("ExternalBlockHash", "_gen_mm_extra_hash_keys", "_gen_lora_extra_hash_keys",
                   "_gen_prompt_embeds_extra_hash_keys", "generate_block_hash_extra_keys",
                   "to_event_extra_keys", "generate_lookahead_block_hash_extra_keys")
_loaded: dict[str, types.ModuleType] = {}


def _source(name: str) -> str:
    if not WHEEL.exists():
        pytest.fail(f"{WHEEL.relative_to(ROOT)} is missing: run `python tests/engines/fetch.py "
                    f"vllm` (make test does)", pytrace=False)
    with zipfile.ZipFile(WHEEL) as whl:
        return whl.read(name).decode()


def _module(name: str, **attrs: object) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _not_loaded(*_: object) -> Any:
    raise RuntimeError("a stand-in: this part of vLLM is not loaded (see the module doc)")


def _exec_file(modname: str, path: str, namespace: dict[str, Any] | None = None) -> types.ModuleType:
    mod = _module(modname)
    mod.__dict__.update(namespace or {})
    mod.__file__ = f"{WHEEL.name}/{path}"
    sys.modules[modname] = mod  # msgspec and dataclasses look their module up
    exec(compile(_source(path), mod.__file__, "exec"), mod.__dict__)
    return mod


def kv_cache_utils() -> types.ModuleType:
    """The extra-key definitions of vLLM's ``vllm/v1/core/kv_cache_utils.py``."""
    if "utils" not in _loaded:
        path = "vllm/v1/core/kv_cache_utils.py"
        tree = ast.parse(_source(path))
        keep = [node for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name in _EXTRA_KEY_DEFS
                or isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id in _EXTRA_KEY_DEFS]
        assert {getattr(n, "name", None) or n.target.id for n in keep} == set(_EXTRA_KEY_DEFS)
        mod = _module("_vllm033_kv_cache_utils", Any=Any, TypeAlias=TypeAlias, Iterable=Iterable,
                      Sequence=Sequence, Callable=Callable, hashlib=hashlib, Request=object,
                      tensor_data=_not_loaded)
        exec(compile(ast.Module(body=keep, type_ignores=[]), f"{WHEEL.name}/{path}", "exec"),
             mod.__dict__)
        _loaded["utils"] = mod
    return _loaded["utils"]


def kv_events() -> types.ModuleType:
    """vLLM's ``vllm/distributed/kv_events.py``, executed from the wheel (see above)."""
    if "events" in _loaded:
        return _loaded["events"]
    utils = kv_cache_utils()
    config_utils = _module("vllm.config.utils", config=dataclasses.dataclass)
    stand_ins = {
        "vllm": _module("vllm", __path__=[]), "vllm.config": _module("vllm.config", __path__=[]),
        "vllm.config.utils": config_utils,
        "vllm.logger": _module("vllm.logger", init_logger=logging.getLogger),
        "vllm.utils": _module("vllm.utils", __path__=[]),
        "vllm.utils.network_utils": _module(
            "vllm.utils.network_utils", get_ip=_not_loaded, get_tcp_uri=_not_loaded,
            is_valid_ipv6_address=_not_loaded, split_zmq_path=_not_loaded),
        "vllm.v1": _module("vllm.v1", __path__=[]), "vllm.v1.core": _module("vllm.v1.core", __path__=[]),
        "vllm.v1.core.kv_cache_utils": utils,
    }
    saved = {name: sys.modules.get(name) for name in [*stand_ins, "vllm.config.kv_events"]}
    sys.modules.update(stand_ins)
    try:
        config = _exec_file("vllm.config.kv_events", "vllm/config/kv_events.py")
        sys.modules["vllm.config.kv_events"] = config
        events = _exec_file("_vllm033_kv_events", "vllm/distributed/kv_events.py")
    finally:  # a real vLLM in this process (another test's) is left as it was
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    sys.modules["_vllm033_kv_events"] = events
    _loaded["events"] = events
    return events
