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


# A file name the README cites: `results/x.{json,md}` stands for both; `<device>` and
# `OLD.json` are placeholders a reader fills in, not files (a name next to `<...>` is skipped).
CITED = re.compile(r"(?<![\w./<>-])\w[\w./-]*(?:\.\{[\w,]+\}|\.(?:py|sh|json|md|log|png|txt|csv)\b)")


def test_benchmarks_readme_cites_only_files_that_exist():
    """Every script, result and report benchmarks/README.md names is in the repository
    (under benchmarks/, benchmarks/results/ or the root), not only the table's scripts."""
    bench = ROOT / "benchmarks"
    cited = set()
    for name in CITED.findall((bench / "README.md").read_text()):
        stem, _, exts = name.partition(".{")
        cited |= {f"{stem}.{e}" for e in exts.rstrip("}").split(",")} if exts else {name}
    cited -= {"OLD.json"}
    assert len(cited) > 30, sorted(cited)  # the pattern still finds the README's names
    where = (bench, bench / "results", ROOT)
    missing = [n for n in sorted(cited) if not any((d / n).exists() for d in where)]
    assert not missing, f"benchmarks/README.md cites files the repository lacks: {missing}"
