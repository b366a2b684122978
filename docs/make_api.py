"""Generate docs/api.md from the docstrings of prefixkv's public surface.

    python docs/make_api.py > docs/api.md

Documents every name in the ``__all__`` of each package in ``PACKAGES``: classes (signature,
bases, docstring, dataclass fields, public methods and properties: those defined in the
class and those it inherits from prefixkv base classes, each marked with where it is
defined, so that a class's whole surface is under its own heading; a method a class body
assigns from a module function is marked with the module that holds it),
functions (signature, docstring) and constants (value, and the string literal written right
after their assignment, which serves as their docstring). Standard library only; the
kernels and the engine need torch to be imported. ``tests/test_api_doc.py`` checks that
docs/api.md is current and that nothing public is undocumented.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import pathlib
import re
import sys
from itertools import pairwise

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import api_sources  # noqa: E402 (docs/ is not a package: found beside this script)

# Imported and documented from their objects. The fleet's modules need the extras
# prefixkv[events] and prefixkv[metrics] (the test extra has both). The engine entry
# points (prefixkv.integrations) import vLLM or SGLang, so they are read from their source
# instead (docs/api_sources.py), after the packages, and so is the command line.
PACKAGES = ("prefixkv", "prefixkv.index", "prefixkv.kernels", "prefixkv.engine", "prefixkv.engine.hybrid",
            "prefixkv.router", "prefixkv.router.subscriber", "prefixkv.router.redis_index",
            "prefixkv.store", "prefixkv.store.torch_io", "prefixkv.groups", "prefixkv.tiers",
            "prefixkv.fleet.publisher", "prefixkv.fleet.wire", "prefixkv.fleet.metrics")
# Modules without an ``__all__`` whose calls the docs and examples import: the names they
# are documented by (the rest of such a module is its own helpers).
NAMES = {"prefixkv.engine.hybrid": ("HybridModelRunner",),
         "prefixkv.router.subscriber": ("Subscriber",),
         "prefixkv.router.redis_index": ("RedisIndex",),
         "prefixkv.store.torch_io": ("kv_block_bytes", "host_slot_views", "run_store_ops"),
         "prefixkv.fleet.wire": ("encode_batch", "WireError")}
INTEGRATIONS = "prefixkv.integrations"
CLI = "the command line"
COMMAND = "python docs/make_api.py > docs/api.md"

# Protocol members implemented by the baselines keep KVCacheManager's contract; an index's
# members keep the Index protocol's (it states them). (protocol module, protocol, module
# and class whose docstrings state the contract.)
CONTRACT_SOURCES = (("prefixkv.allocator", "Allocator", "prefixkv.core.manager", "KVCacheManager"),
                    ("prefixkv.index.protocol", "Index", "prefixkv.index.protocol", "Index"))

_QUALIFIED = re.compile(r"\bprefixkv(?:\.[a-z_]\w*)*\.(?=[A-Z])")  # prefixkv.events.BlockStored
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _clean(text: str) -> str:
    """Shorten prefixkv's qualified class names; drop memory addresses (stable output)."""
    return _ADDRESS.sub("", _QUALIFIED.sub("", text))


def public_names(package: str) -> list[str]:
    """The names a package exports (its ``__all__``), those ``NAMES`` gives it, or its
    public classes."""
    mod = importlib.import_module(package)
    names = getattr(mod, "__all__", None) or NAMES.get(package)
    if names is None:
        names = [n for n, v in vars(mod).items()
                 if not n.startswith("_") and inspect.isclass(v) and v.__module__.startswith(package)]
    return list(names)


@functools.cache
def _module_body(mod_name: str) -> list[ast.stmt]:
    """The statements of an imported module's source, parsed once ([] without a source)."""
    try:
        return ast.parse(inspect.getsource(sys.modules[mod_name])).body
    except (OSError, TypeError):
        return []


def attribute_docstring(package: str, name: str) -> str | None:
    """The string literal right after ``name = ...`` in the package's module, else in the
    first prefixkv module (by name) that assigns it."""
    root = package.split(".")[0]
    others = sorted(m for m in sys.modules if m.startswith(root + ".") and m != package)
    for mod_name in [package, *others]:
        body = _module_body(mod_name)
        for stmt, nxt in pairwise(body):
            targets = (stmt.targets if isinstance(stmt, ast.Assign)
                       else [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
            if (any(isinstance(t, ast.Name) and t.id == name for t in targets)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                return inspect.cleandoc(nxt.value.value)
    return None


def _contract_doc(cls: type, name: str) -> str | None:
    """For a member of a protocol in CONTRACT_SOURCES that ``cls`` implements whole, the
    pointer to the docstring that states its contract."""
    for proto_mod, proto, ref_mod, ref in CONTRACT_SOURCES:
        protocol = getattr(importlib.import_module(proto_mod), proto)
        reference = getattr(importlib.import_module(ref_mod), ref)
        members = {n for n in vars(protocol) if not n.startswith("_")}
        if cls is reference or name not in members or not members <= set(dir(cls)):
            continue
        if inspect.getdoc(getattr(reference, name, None)):
            return f"Same contract as ``{ref}.{name}``."
    return None


def member_doc(cls: type, name: str, obj: object) -> str | None:
    """The docstring of a class member: its own, else the protocol contract it implements."""
    target = obj.fget if isinstance(obj, property) else getattr(obj, "__func__", obj)
    doc = target.__doc__
    return inspect.cleandoc(doc) if doc and doc.strip() else _contract_doc(cls, name)


def public_members(cls: type) -> list[tuple[str, object, type]]:
    """Public methods and properties of ``cls``: ``(name, member, the class defining it)``,
    its own first, then those it inherits from prefixkv base classes (as the class finds
    them: the first definition along the MRO), each class's in definition order."""
    out: list[tuple[str, object, type]] = []
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass is not cls and not klass.__module__.startswith("prefixkv"):
            continue  # object, Protocol, torch's Module, ...: not prefixkv's surface
        for name, obj in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if name.startswith("_"):
                continue
            if isinstance(obj, (property, staticmethod, classmethod)) or inspect.isfunction(obj):
                out.append((name, obj, klass))
    return out


class _Written(str):
    """An annotation kept as written in the source (repr without quotes)."""

    def __repr__(self) -> str:
        return str(self)


def _signature(obj: object) -> str | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None

    def written(a: object) -> object:
        return _Written(a) if isinstance(a, str) else a

    params = [p.replace(annotation=inspect.Parameter.empty if p.name == "self" else written(p.annotation))
              for p in sig.parameters.values()]  # (a method written as a module function
    # annotates ``self`` with its class: the class is the heading already)
    sig = sig.replace(parameters=params, return_annotation=written(sig.return_annotation))
    return _clean(str(sig))


def _is_protocol(cls: type) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


def render_doc(doc: str | None) -> list[str]:
    """Docstring text as Markdown: prose as is, indented runs (argument lists, diagrams)
    fenced as text so their layout survives."""
    if not doc:
        return ["*(no docstring)*", ""]
    out: list[str] = []
    run: list[str] = []

    def flush() -> None:
        while run and not run[-1].strip():
            run.pop()
        if run:
            indent = min(len(s) - len(s.lstrip()) for s in run if s.strip())
            if out and out[-1]:
                out.append("")
            out.extend(["```text", *(s[indent:] for s in run), "```", ""])
        run.clear()

    for line in doc.splitlines():
        if line.startswith((" ", "\t")) or (run and not line.strip()):
            run.append(line.rstrip())
            continue
        flush()
        out.append(line[:-2] + ":" if line.endswith("::") else line)
    flush()
    return [*out, ""]


def render_class(qual: str, cls: type) -> list[str]:
    bases = [b.__name__ for b in cls.__bases__ if b not in (object,) and b.__name__ not in ("Generic",)]
    head = f"### class `{qual}`" + (f" ({', '.join(bases)})" if bases else "")
    lines = [head, ""]
    sig = None if _is_protocol(cls) or issubclass(cls, BaseException) else _signature(cls)
    if sig is not None:
        sig = sig.removesuffix(" -> None")
        lines += ["```", f"{cls.__name__}{sig}", "```", ""]
    lines += render_doc(inspect.getdoc(cls) if cls.__doc__ else None)
    if dataclasses.is_dataclass(cls):
        fields = [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]  # (private)
        if fields:
            lines += ["Fields:", ""]
            for f in fields:
                default = ""
                if f.default is not dataclasses.MISSING:
                    default = f" = {_clean(repr(f.default))}"
                elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                    default = " = (factory)"
                ftype = f.type if isinstance(f.type, str) else _clean(inspect.formatannotation(f.type))
                lines.append(f"- `{f.name}: {ftype}{default}`")
            lines.append("")
    for name, obj, owner in public_members(cls):
        if isinstance(obj, property):
            lines += [f"#### property `{cls.__name__}.{name}`", ""]
            ret = inspect.signature(obj.fget).return_annotation if obj.fget else None
            if ret not in (None, inspect.Signature.empty):
                lines += [f"Type: `{_clean(str(ret))}`", ""]
        else:
            func = getattr(obj, "__func__", obj)
            lines += [f"#### `{cls.__name__}.{name}`", "", "```",
                      f"{name}{_signature(func)}", "```", ""]
        if owner is not cls:
            lines += [f"*Defined in the base class `{owner.__name__}`.*", ""]
        elif getattr(obj, "__module__", cls.__module__) != cls.__module__:  # (a class body's
            lines += [f"*Written in `{obj.__module__}`.*", ""]  # ``name = module.function``)
        lines += render_doc(member_doc(cls, name, obj))
    return lines


def render_function(qual: str, func: object) -> list[str]:
    name = qual.rsplit(".", 1)[-1]
    return [f"### function `{qual}`", "", "```", f"{name}{_signature(func)}", "```", "",
            *render_doc(inspect.getdoc(func) if getattr(func, "__doc__", None) else None)]


def render_constant(package: str, qual: str, value: object) -> list[str]:
    name = qual.rsplit(".", 1)[-1]
    return [f"### `{qual}`", "", "```", f"{name} = {_clean(repr(value))}", "```", "",
            *render_doc(attribute_docstring(package, name))]


def documentation(package: str, name: str, value: object) -> str | None:
    """The docstring that documents ``package.name`` (None or empty: undocumented)."""
    if inspect.isclass(value) or inspect.isfunction(value):
        return value.__doc__
    return attribute_docstring(package, name)


def undocumented() -> list[str]:
    """Public names, and public methods and properties of public classes, without a
    docstring (or the protocol contract they implement)."""
    missing = []
    for package in PACKAGES:
        mod = importlib.import_module(package)
        for name in public_names(package):
            value = getattr(mod, name)
            doc = documentation(package, name, value)
            if not doc or not doc.strip():
                missing.append(f"{package}.{name}")
            if inspect.isclass(value):
                for member, obj, _ in public_members(value):
                    if not member_doc(value, member, obj):
                        missing.append(f"{package}.{name}.{member}")
    for qual, module in api_sources.ENTRY_POINTS:
        if not api_sources.entry_point(qual, module).doc:
            missing.append(qual)
    missing += [qual for qual, module in api_sources.CONSTANTS if not api_sources.constant(qual, module)[1]]
    return missing


def render_entry_point(qual: str, module: str) -> list[str]:
    """An engine entry point, read from its source: constructor, docstring, and its
    public methods as a list (the engine calls them; where a method states no contract of
    its own, its base class's, the engine's, applies)."""
    entry = api_sources.entry_point(qual, module)
    bases = ", ".join(entry.bases)
    lines = [f"### class `{qual}`" + (f" ({bases})" if bases else ""), ""]
    if entry.init is not None:
        lines += ["```", f"{qual.rsplit('.', 1)[-1]}{entry.init}", "```", ""]
    lines += render_doc(entry.doc)
    # where a method states no contract, the engine's base class's applies (not prefixkv's)
    ours = {name for name, _, _ in entry.inherited}
    engine = ", ".join(b for b in entry.bases if b not in ours)
    groups = [(f"Defined here ({module}):", entry.methods)]
    groups += [(f"Defined in the base class `{name}` ({where}):", methods)
               for name, where, methods in entry.inherited]
    for title, methods in groups:
        if not methods:
            continue
        lines += [title, ""]
        for name, sig, doc in methods:
            head = f"- `{name}{sig}`" if sig is not None else f"- property `{name}`"
            if doc:
                lines.append(f"{head}: " + doc.split("\n\n")[0].replace("\n", " "))
            else:  # an engine's interface method that adds nothing to its contract
                lines.append(f"{head}: the contract of the engine's base class ({engine})"
                             if engine else head)
        lines.append("")
    return lines


def render_integrations() -> list[str]:
    lines = [f"## {INTEGRATIONS}", "", *render_doc(api_sources.module_docstring(INTEGRATIONS + ".__init__"))]
    for qual, module in api_sources.ENTRY_POINTS:
        lines += render_entry_point(qual, module)
    for qual, module in api_sources.CONSTANTS:
        value, doc = api_sources.constant(qual, module)
        lines += [f"### `{qual}`", "", "```", f"{qual.rsplit('.', 1)[-1]} = {value}", "```", "",
                  *render_doc(doc)]
    return lines


def render_cli() -> list[str]:
    lines = [f"## {CLI}", "", "`prefixkv` (also `python -m prefixkv`); each command's `--help`, "
             f"at {api_sources.HELP_COLUMNS} columns:", ""]
    for command, text in api_sources.cli_help():
        lines += [f"### `{command}`", "", "```text", *text.rstrip().splitlines(), "```", ""]
    return lines


def generate() -> str:
    """The whole of docs/api.md."""
    lines = ["# API reference", "",
             f"Generated from the docstrings by `{COMMAND}`; do not edit by hand. "
             "How the calls fit together: [integration.md](integration.md).", ""]
    for package in (*PACKAGES, INTEGRATIONS):
        lines.append(f"- [`{package}`](#{package.replace('.', '')})")
    lines += [f"- [{CLI}](#{CLI.replace(' ', '-')})", ""]
    for package in PACKAGES:
        mod = importlib.import_module(package)
        lines += [f"## {package}", ""]
        lines += render_doc(inspect.getdoc(mod) if mod.__doc__ else None)
        for name in public_names(package):
            value = getattr(mod, name)
            qual = f"{package}.{name}"
            if inspect.isclass(value):
                lines += render_class(qual, value)
            elif inspect.isfunction(value):
                lines += render_function(qual, value)
            else:
                lines += render_constant(package, qual, value)
    lines += [*render_integrations(), *render_cli()]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(generate())
