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
        raise LookupError(f"{module} defines no class {name} (docs/api_sources.py)")
    return found[0]


def _signature(func: ast.FunctionDef) -> str:
    """``(args) -> return`` as written, without ``self`` (annotated or not: a module
    function a class lists annotates it with the class)."""
    spec = func.args
    if spec.args and spec.args[0].arg == "self":
        spec = ast.arguments(posonlyargs=spec.posonlyargs, args=spec.args[1:], vararg=spec.vararg,
                             kwonlyargs=spec.kwonlyargs, kw_defaults=spec.kw_defaults,
                             kwarg=spec.kwarg, defaults=spec.defaults)
    args = ast.unparse(spec)
    returns = f" -> {ast.unparse(func.returns)}" if func.returns is not None else ""
    return f"({args}){returns}"


Method = tuple[str, str | None, str | None]
"""``(name, signature or None for a property, docstring or None)``."""


class EntryPoint(NamedTuple):
    """What docs/api.md shows of an entry point: its bases as written (private ones left
    out), the constructor's signature, its docstring, each public method or property
    defined in the class, and those it inherits from prefixkv base classes and does not
    override: ``(base class, its module, its methods)``, nearest base first."""

    bases: list[str]
    init: str | None
    doc: str | None
    methods: list[Method]
    inherited: list[tuple[str, str, list[Method]]]


def _listed(node: ast.stmt, module: str) -> tuple[str, ast.FunctionDef, bool] | None:
    """A class body's ``name = mod.function`` (or ``name = property(mod.function)``),
    where ``module`` imports ``mod`` from its own package (``from . import mod``): the
    name, the module function it lists, and whether it is a property; None otherwise."""
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)):
        return None
    value, is_property = node.value, False
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id == "property" and len(value.args) == 1):
        value, is_property = value.args[0], True
    if not (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)):
        return None
    for imp in _module(module).body:
        if (isinstance(imp, ast.ImportFrom) and imp.level == 1 and imp.module is None
                and any((a.asname or a.name) == value.value.id for a in imp.names)):
            source = f"{module.rsplit('.', 1)[0]}.{value.value.id}"
            for func in _module(source).body:
                if isinstance(func, ast.FunctionDef) and func.name == value.attr:
                    return node.targets[0].id, func, is_property
    return None


def _own(cls: ast.ClassDef, module: str) -> tuple[str | None, list[Method]]:
    """The constructor's signature and the public methods ``cls`` (defined in
    ``module``) defines, or lists from a module function (``_listed``)."""
    init = None
    methods: list[Method] = []
    for node in cls.body:
        listed = _listed(node, module)
        if listed is not None and not listed[0].startswith("_"):
            name, func, is_property = listed
            methods.append((name, None if is_property else _signature(func), ast.get_docstring(func)))
        if not isinstance(node, ast.FunctionDef):
            continue
        if node.name == "__init__":
            init = _signature(node).removesuffix(" -> None")
        elif not node.name.startswith("_"):
            is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
            methods.append((node.name, None if is_property else _signature(node), ast.get_docstring(node)))
    return init, methods


def _prefixkv_base(base: ast.expr, module: str) -> str | None:
    """The prefixkv module defining the base class named ``base`` in ``module`` (defined
    there or imported by name), or None: an engine's class, or a name not plainly bound."""
    if not isinstance(base, ast.Name):
        return None
    tree = _module(module)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == base.id:
            return module
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == base.id for a in node.names):
            if node.level:  # relative to ``module``'s package
                package = module.rsplit(".", node.level)[0]
                source = f"{package}.{node.module}" if node.module else package
            else:
                source = node.module or ""
            return source if source.split(".")[0] == "prefixkv" else None
    return None


def _inherited(cls: ast.ClassDef, module: str, seen: set[str]) -> list[tuple[str, str, list[Method]]]:
    """The public methods ``cls``'s prefixkv bases define that no class nearer (named in
    ``seen``) defines, base by base, depth first in the order the bases are written."""
    out: list[tuple[str, str, list[Method]]] = []
    for base in cls.bases:
        where = _prefixkv_base(base, module)
        if where is None or not isinstance(base, ast.Name):
            continue
        node = _class(base.id, where)
        methods = [m for m in _own(node, where)[1] if m[0] not in seen]
        seen |= {m[0] for m in methods}
        if methods:
            out.append((base.id, where, methods))
        out += _inherited(node, where, seen)
    return out


def entry_point(qual: str, module: str) -> EntryPoint:
    """The class ``qual`` (defined in ``module``), read from its source, and the public
    methods it inherits from prefixkv base classes."""
    cls = _class(qual, module)
    init, methods = _own(cls, module)
    bases = [ast.unparse(b) for b in cls.bases]
    inherited = _inherited(cls, module, {m[0] for m in methods})
    return EntryPoint([b for b in bases if not b.startswith("_")], init, ast.get_docstring(cls),
                      methods, inherited)


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
