"""The interpreter shortcuts of ``tests/triton_interpreter.py`` in the Python subprocesses
the suite starts (the benchmark scripts' smoke runs, the examples): ``tests/conftest.py``
puts this folder on ``PYTHONPATH``, and Python imports ``sitecustomize`` at start-up from
the first folder on its path that has one. It does nothing until triton's interpreter
module is imported, and then installs the shortcuts right after that module has run."""

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

INTERPRETER = "triton.runtime.interpreter"


def _shortcuts():
    spec = importlib.util.spec_from_file_location(
        "triton_interpreter_shortcuts", Path(__file__).resolve().parents[1] / "triton_interpreter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _AfterInterpreterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of triton's interpreter module."""

    def find_spec(self, name, path, target=None):
        if name != INTERPRETER:
            return None
        sys.meta_path.remove(self)  # once, and out of the way of the real finders
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _shortcuts().apply_shortcuts()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and INTERPRETER not in sys.modules:
    sys.meta_path.insert(0, _AfterInterpreterImport())
