"""docs/api.md is generated from the docstrings: it must be current, and nothing public may
lack a docstring."""

import importlib
import importlib.util
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the kernels and the engine, documented in api.md, need torch")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "make_api.py"


def _make_api():
    spec = importlib.util.spec_from_file_location("make_api", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_api_md_is_current():
    make_api = _make_api()
    current = (ROOT / "docs" / "api.md").read_text()
    assert current == make_api.generate(), (
        f"docs/api.md is out of date with the docstrings; regenerate it with "
        f"`{make_api.COMMAND}` (from the repository root) and commit it")


def test_every_public_name_has_a_docstring():
    missing = _make_api().undocumented()
    assert not missing, (
        "public names without a docstring (write a short contract for each, then run "
        "`python docs/make_api.py > docs/api.md`):\n  " + "\n  ".join(missing))


def _sections(markdown: str) -> dict[str, str]:
    """The reference's entries: heading text (``class `prefixkv.X```, ``function `...```,
    ``X.name``) -> the entry's text up to the next heading."""
    out: dict[str, str] = {}
    for part in re.split(r"^#{3,4} ", markdown, flags=re.M)[1:]:
        head, _, body = part.partition("\n")
        out[head.replace("property ", "").replace("`", "").split(" (")[0]] = body
    return out


def _signature_text(body: str) -> str:
    """The first fenced block of an entry: its signature."""
    match = re.search(r"^```\n(.*?)^```", body, flags=re.M | re.S)
    return match.group(1) if match else ""


def _params(obj: object) -> list[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p not in ("self", "cls")]


def _surface(cls: type) -> dict[str, object]:
    """Every public method and property a user reaches on ``cls`` (``dir``), with what it
    is, except those defined outside prefixkv (object's, a Protocol's, torch's Module's)."""
    out = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or (owner is not cls and not owner.__module__.startswith("prefixkv")):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, (property, staticmethod, classmethod)) or inspect.isfunction(raw):
            out[name] = raw
    return out


def test_every_public_callable_and_parameter_is_in_the_reference():
    """Read from the objects themselves, not from the generator: every public function,
    every public method and property of every public class (inherited ones included),
    and every parameter of each, has its entry in docs/api.md."""
    make_api = _make_api()
    sections = _sections((ROOT / "docs" / "api.md").read_text())
    missing = []
    for package in make_api.PACKAGES:
        mod = importlib.import_module(package)
        for name in make_api.public_names(package):
            value = getattr(mod, name)
            if inspect.isfunction(value):
                body = sections.get(f"function {package}.{name}")
                if body is None:
                    missing.append(f"function {package}.{name}")
                    continue
                text = _signature_text(body)
                missing += [f"{package}.{name}({p})" for p in _params(value)
                            if not re.search(rf"\b{p}\b", text)]
            elif inspect.isclass(value):
                if f"class {package}.{name}" not in sections:
                    missing.append(f"class {package}.{name}")
                for member, raw in _surface(value).items():
                    body = sections.get(f"{name}.{member}")
                    if body is None:
                        missing.append(f"{package}.{name}.{member}")
                        continue
                    if isinstance(raw, property):
                        continue
                    text = _signature_text(body)
                    missing += [f"{package}.{name}.{member}({p})"
                                for p in _params(getattr(raw, "__func__", raw))
                                if not re.search(rf"\b{p}\b", text)]
    assert not missing, ("missing from docs/api.md (regenerate it with "
                         "`python docs/make_api.py > docs/api.md`):\n  " + "\n  ".join(missing))


def test_entry_points_are_the_names_engines_are_given():
    """Each engine entry point api.md documents from source is importable under the name
    it is listed by (prefixkv.integrations.vllm's lazy names included), without importing
    the engine here: the name resolves to the module the source was read from."""
    make_api = _make_api()
    for qual, module in make_api.api_sources.ENTRY_POINTS:
        parent, name = qual.rsplit(".", 1)
        if parent != module:
            where = importlib.import_module(parent)._WHERE  # the lazy table: name -> module
            assert f"{parent}.{where[name]}" == module, (qual, module)
        assert make_api.api_sources.entry_point(qual, module).doc, qual


def test_every_exported_name_of_every_subpackage_is_in_the_reference():
    """Walk prefixkv's packages (not the generator's list): each name in a package's
    ``__all__`` has its entry in docs/api.md, under that package, or, for the engine
    integrations (read from source), under the name an engine is given."""
    import pkgutil

    import prefixkv

    sections = _sections((ROOT / "docs" / "api.md").read_text())
    heads = {h.split(" ", 1)[-1].split("(")[0] for h in sections}
    packages = ["prefixkv", *(m.name for m in pkgutil.walk_packages(prefixkv.__path__, "prefixkv.")
                              if m.ispkg)]
    missing = []
    for package in packages:
        mod = importlib.import_module(package)
        for name in getattr(mod, "__all__", ()):
            if f"{package}.{name}" not in heads:
                missing.append(f"{package}.{name}")
    assert not missing, ("exported but missing from docs/api.md (add the package to "
                         "PACKAGES in docs/make_api.py, or the entry point to "
                         "docs/api_sources.py):\n  " + "\n  ".join(missing))


_IMPORT = re.compile(r"^\s*from (prefixkv(?:\.\w+)*) import \(?([\w, \n]+?)\)?\s*(?:#.*)?$", re.M)


def test_every_name_the_docs_and_examples_import_is_in_the_reference():
    """What README.md, docs/*.md and examples/ tell a reader to import (``from prefixkv.X
    import name``) has its entry in docs/api.md: under that module, or the same object under
    another name (``prefixkv.store.server.LocalRedis`` is ``prefixkv.store.LocalRedis``). The
    bench's own helpers (``prefixkv.bench``), which the examples borrow to measure, are
    ``prefixkv bench``'s, not the library's. Subscriber, encode_batch and the store's torch
    ops, which the docs' own code imports, were missing."""
    sections = _sections((ROOT / "docs" / "api.md").read_text())
    documented = set()
    for head in sections:
        qual = head.split(" ", 1)[-1]
        parent, _, name = qual.rpartition(".")
        if parent.startswith("prefixkv") and "(" not in qual:
            try:
                documented.add(id(getattr(importlib.import_module(parent), name)))
            except (ImportError, AttributeError):
                pass
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "examples").glob("*.py"))]
    missing = set()
    for path in texts:
        for module, names in _IMPORT.findall(path.read_text()):
            if module.startswith(("prefixkv.bench", "prefixkv.integrations")):
                continue  # the bench's helpers; the integrations are listed from source
            for name in filter(None, re.split(r"[\s,]+", names)):
                value = getattr(importlib.import_module(module), name)
                if not inspect.ismodule(value) and id(value) not in documented:
                    missing.add(f"{module}.{name} ({path.name})")
    assert not missing, ("imported by the docs or examples but missing from docs/api.md (add the "
                         "module to PACKAGES in docs/make_api.py):\n  " + "\n  ".join(sorted(missing)))


DOWNSTREAM = '''
from prefixkv import ExtraKeys, KVCacheManager, PrefixKVError
from prefixkv.groups import HybridKVCacheManager, full_attention

m = KVCacheManager(16, 4)
reveal_type(m.add_request("a", [1, 2, 3], extra=ExtraKeys(cache_salt="t")))
h = HybridKVCacheManager([full_attention()], 16, 4)
reveal_type(h.get_block_ids("a"))
wrong: str = m.lookup([1, 2])
try:
    m.free("a")
except PrefixKVError as e:
    reveal_type(e)
'''


def test_a_downstream_mypy_sees_prefixkv_s_types(tmp_path):
    """An engine author's ``mypy --strict`` over their own file, against the installed
    prefixkv (not this checkout's source: no path to it is given): prefixkv ships
    ``py.typed``, so mypy reads its annotations (a missing marker is an error: "installed,
    but missing library stubs or py.typed marker") and finds the one mistake the file
    makes, a ``lookup`` count assigned to a str."""
    pytest.importorskip("mypy.api")
    (tmp_path / "engine.py").write_text(DOWNSTREAM)
    (tmp_path / "mypy.ini").write_text("[mypy]\n")  # not the repository's settings
    # (in a process of its own: tests in this worker may have put stand-ins in
    # sys.modules, e.g. the SGLang harness's orjson, which mypy then imports)
    done = subprocess.run([sys.executable, "-m", "mypy", str(tmp_path / "engine.py"), "--strict",
                           "--no-incremental", "--config-file", str(tmp_path / "mypy.ini")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    out, err, status = done.stdout, done.stderr, done.returncode
    assert "prefixkv.results.Admission | prefixkv.results.StoreWait | None" in out, out + err
    assert 'Revealed type is "tuple[tuple[builtins.int, ...], ...]"' in out or \
        'Revealed type is "tuple[tuple[int, ...], ...]"' in out, out
    assert 'Revealed type is "prefixkv.errors.PrefixKVError"' in out, out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "engine.py:9:" in errors[0] and '"int"' in errors[0], out
    assert status == 1


def _render_fake_entry_point(tmp_path, monkeypatch, files):
    """docs/api.md's text for the entry point ``prefixkv.fake.Manager`` of
    ``prefixkv.fake.entry``, the package's modules written from ``files`` (file name ->
    source) under ``tmp_path``."""
    make_api = _make_api()
    pkg = tmp_path / "prefixkv" / "fake"
    pkg.mkdir(parents=True)
    for name, source in files.items():
        (pkg / name).write_text(source)
    monkeypatch.setattr(make_api.api_sources, "SRC", tmp_path)
    return "\n".join(make_api.render_entry_point("prefixkv.fake.Manager", "prefixkv.fake.entry"))

def test_an_entry_point_lists_the_methods_it_inherits_from_prefixkv_bases(tmp_path, monkeypatch):
    """An entry point's public methods defined in a prefixkv base class (imported
    relatively, then a base of that base) are listed under the base that defines them;
    an override is listed once, where it is defined; an engine's base adds nothing."""
    text = _render_fake_entry_point(tmp_path, monkeypatch, {
        "root.py":
        "class Root:\n"
        "    def deep(self) -> int:\n        \"\"\"From the root.\"\"\"\n        return 0\n\n"
        "    def stats(self) -> None:\n        \"\"\"Overridden.\"\"\"\n",
        "steps.py":
        "from prefixkv.fake.root import Root\n\n\n"
        "class Steps(Root):\n"
        "    def take_events(self) -> list[int]:\n        \"\"\"Events since the last call.\"\"\"\n"
        "        return []\n\n"
        "    @property\n    def stats(self) -> None:\n        \"\"\"The stats.\"\"\"\n\n"
        "    def _private(self) -> None:\n        pass\n",
        "entry.py":
        "from engine import EngineManager\n\nfrom .steps import Steps\n\n\n"
        "class Manager(Steps, EngineManager):\n    \"\"\"The manager.\"\"\"\n\n"
        "    def allocate(self) -> None:\n        pass\n\n"
        "    def take_events(self) -> list[int]:\n        \"\"\"Overridden here.\"\"\"\n"
        "        return [1]\n"})
    here, _, rest = text.partition("Defined in the base class `Steps` (prefixkv.fake.steps):")
    steps, _, root = rest.partition("Defined in the base class `Root` (prefixkv.fake.root):")
    assert "- `take_events() -> list[int]`: Overridden here." in here
    assert "- `allocate() -> None`: the contract of the engine's base class (EngineManager)" in here
    assert steps.strip() == "- property `stats`: The stats."
    assert root.strip() == "- `deep() -> int`: From the root."


def test_the_package_docstring_names_every_module_the_reference_documents():
    """``prefixkv``'s docstring, where a reader learns what is public, names each module
    docs/api.md has a section for. Before, it called ``index`` implementation and left
    out the five modules the docs import from by path."""
    import prefixkv

    make_api = _make_api()
    missing = [p for p in make_api.PACKAGES[1:] if f"``{p}``" not in prefixkv.__doc__]
    assert not missing, missing
    assert "``core``, ``index``" not in prefixkv.__doc__


def test_an_entry_point_lists_the_module_functions_its_class_body_names(tmp_path, monkeypatch):
    """An entry point's ``name = mod.function`` and ``name = property(mod.function)``
    (``from . import mod``) are its methods in docs/api.md, with the function's
    signature less its ``self`` (annotated with the class) and its docstring; private
    names and assignments of anything else are left out."""
    text = _render_fake_entry_point(tmp_path, monkeypatch, {
        "calls.py":
        "def key_of(self: 'Manager', request_id: str) -> int | None:\n"
        "    \"\"\"The request's key.\"\"\"\n\n\n"
        "def usage(self: 'Manager') -> float:\n    \"\"\"Blocks in use.\"\"\"\n\n\n"
        "def _ids(self: 'Manager') -> None:\n    pass\n",
        "entry.py":
        "from . import calls\n\n\n"
        "class Manager:\n    \"\"\"The manager.\"\"\"\n\n"
        "    usage = property(calls.usage)\n    key_of = calls.key_of\n    _ids = calls._ids\n"
        "    LIMIT = 3\n"})
    assert "- property `usage`: Blocks in use." in text
    assert "- `key_of(request_id: str) -> int | None`: The request's key." in text
    assert "_ids" not in text and "LIMIT" not in text
