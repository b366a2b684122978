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
