"""The parts of docs/api.md read without importing what they document (docs/make_api.py
renders them): the engine entry points, whose modules import vLLM or SGLang, read from
their source with ``ast``; and the command line, from its argument parser.

Standard library only. An entry point is a class an engine loads by name (a flag or a
config value names it); its public methods are the engine's interface, whose contract
is the engine's where the method states none of its own.
"""

from __future__ import annotations

import ast
import os
import pathlib
from itertools import pairwise
from typing import NamedTuple

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# (the name an engine is given, the module that defines the class): the name first; and
# what the scheduler raises when vLLM asks for what prefixkv does not offer.
ENTRY_POINTS = (
    ("prefixkv.integrations.vllm.Scheduler", "prefixkv.integrations.vllm.scheduler"),
    ("prefixkv.integrations.vllm.AsyncScheduler", "prefixkv.integrations.vllm.scheduler"),
    ("prefixkv.integrations.vllm.KVCacheManager", "prefixkv.integrations.vllm.manager"),
    ("prefixkv.integrations.vllm.connector.PrefixKVConnector", "prefixkv.integrations.vllm.connector"),
    ("prefixkv.integrations.sglang.storage.PrefixKVStorage", "prefixkv.integrations.sglang.storage"),
    ("prefixkv.integrations.vllm.UnsupportedByPrefixKV", "prefixkv.integrations.vllm.layout"),
)
# The other names the integration packages export (their ``__all__``): constants, read
# from their source as (the exported name, the module that assigns it).
CONSTANTS = (
    ("prefixkv.integrations.vllm.VLLM_VERSION", "prefixkv.integrations.vllm.layout"),
)
HELP_COLUMNS = "100"
"""The width argparse wraps the command line's help to (it reads ``COLUMNS``)."""


def _module(module: str) -> ast.Module:
    path = SRC.joinpath(*module.split(".")).with_suffix(".py")
    return ast.parse(path.read_text(), filename=str(path))


def module_docstring(module: str) -> str | None:
    """The docstring of a prefixkv module, read from its source."""
    return ast.get_docstring(_module(module))


def _class(qual: str, module: str) -> ast.ClassDef:
    name = qual.rsplit(".", 1)[-1]
    found = [n for n in _module(module).body if isinstance(n, ast.ClassDef) and n.name == name]
    if not found:
        raise LookupError(f"{module} defines no class {name} (docs/api_sources.py, ENTRY_POINTS)")
    return found[0]


def _signature(func: ast.FunctionDef) -> str:
    """``(args) -> return`` as written, without ``self``."""
    args = ast.unparse(func.args)
    args = "" if args == "self" else args.removeprefix("self, ")
    returns = f" -> {ast.unparse(func.returns)}" if func.returns is not None else ""
    return f"({args}){returns}"


class EntryPoint(NamedTuple):
    """What docs/api.md shows of an entry point: its bases as written (private ones left
    out), the constructor's signature, its docstring, and each public method or property
    defined in the class: ``(name, signature or None for a property, docstring or None)``."""

    bases: list[str]
    init: str | None
    doc: str | None
    methods: list[tuple[str, str | None, str | None]]


def entry_point(qual: str, module: str) -> EntryPoint:
    """The class ``qual`` (defined in ``module``), read from its source."""
    cls = _class(qual, module)
    init = None
    methods: list[tuple[str, str | None, str | None]] = []
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        if node.name == "__init__":
            init = _signature(node).removesuffix(" -> None")
        elif not node.name.startswith("_"):
            is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
            methods.append((node.name, None if is_property else _signature(node), ast.get_docstring(node)))
    bases = [ast.unparse(b) for b in cls.bases]
    return EntryPoint([b for b in bases if not b.startswith("_")], init, ast.get_docstring(cls), methods)


def constant(qual: str, module: str) -> tuple[str, str | None]:
    """``(value as written, docstring or None)`` of the module-level assignment of
    ``qual``'s name in ``module``: the string literal right after it is its docstring."""
    name = qual.rsplit(".", 1)[-1]
    body = _module(module).body
    for stmt, nxt in pairwise(body):
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                for t in stmt.targets):
            doc = (nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                   and isinstance(nxt.value.value, str) else None)
            return ast.unparse(stmt.value), doc
    raise LookupError(f"{module} assigns no {name} (docs/api_sources.py, CONSTANTS)")


def cli_help() -> list[tuple[str, str]]:
    """``(command, help text)`` of ``prefixkv`` and each subcommand, at HELP_COLUMNS. The
    layout is argparse's, which changes between Python versions (3.10 says "optional
    arguments:"): docs/api.md is generated on 3.11, the version the tests run on."""
    import argparse

    from prefixkv.cli import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        parser = build_parser()
        out = [("prefixkv", parser.format_help())]
        for action in parser._actions:  # argparse lists subcommands only through its actions
            if isinstance(action, argparse._SubParsersAction):
                out += [(f"prefixkv {name}", sub.format_help()) for name, sub in action.choices.items()]
        return out
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
