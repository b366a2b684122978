"""docs/api.md is generated from the docstrings: it must be current, and nothing public may
lack a docstring."""

import importlib.util
import pathlib

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
