"""The distribution's metadata: an SPDX license expression with its license file (the
full Apache-2.0 text, shipped in the wheel through ``license-files``), authors,
classifiers, and no license classifier beside the expression (PEP 639 forbids both)."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parents[1]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_license_is_an_spdx_expression_with_its_file():
    meta = project()
    assert meta["license"] == "Apache-2.0"
    assert meta["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text


def test_authors_and_classifiers():
    meta = project()
    assert meta["authors"] and all(a.get("name") for a in meta["authors"])
    classifiers = meta["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]
    pythons = {c.rsplit(" ", 1)[-1] for c in classifiers
               if c.startswith("Programming Language :: Python :: 3.")}
    assert min(pythons, key=lambda v: tuple(map(int, v.split(".")))) == meta["requires-python"].lstrip(">=")
