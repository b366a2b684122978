"""Every ```python block in README.md and docs/*.md runs, in order, one namespace per file."""

import os
import pathlib
import re
import subprocess
import sys

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


def test_kernels_example_runs_the_triton_kernels_in_the_interpreter():
    """examples/kernels_on_cpu.py as a reader runs it: a fresh interpreter whose
    environment has no TRITON_INTERPRET (the script sets it before triton is imported) and
    only src/ on its path (none of the suite's interpreter shortcuts). It exits non-zero
    when the interpreted Triton kernels differ from the torch reference or read a NaN
    slot; both steps report."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "kernels_on_cpu.py")], env=env,
                         capture_output=True, text=True, timeout=600)  # a hang's bound on a busy CPU
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert re.findall(r"^step (\d): .* max \|diff\| \S+$", run.stdout, flags=re.M) == ["1", "2"], run.stdout
