"""Every ```python block in README.md and docs/*.md runs, in order, one namespace per file."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_code_blocks_run(path):
    blocks = BLOCK.findall(path.read_text())
    if "torch" in "".join(blocks):
        pytest.importorskip("torch")
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{path.name}[block {i}]", "exec"), namespace)


def test_readme_has_code_to_run():
    assert BLOCK.findall((ROOT / "README.md").read_text())


def test_benchmarks_readme_names_only_what_the_repository_has():
    """Every script benchmarks/README.md lists exists; it cites no document the
    repository lacks (the SPEC is not shipped: its shapes are stated where used)."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = set(re.findall(r"^\| `([\w.]+\.(?:py|sh))`", text, flags=re.M))
    assert scripts and not [s for s in scripts if not (ROOT / "benchmarks" / s).exists()]
    assert "SPEC section" not in text
