"""Each example's docstring shows how to run it (``python examples/x.py [--flag N]``):
every flag such a line names is one its argument parser takes, so the command a reader
copies runs. Read from the source (no example is imported: several need torch or vLLM)."""

import ast
import pathlib
import re

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[1] / "examples").glob("*.py"))
USAGE = re.compile(r"^\s*python examples/(\w+)\.py(.*(?:\n\s{8,}\[.*)*)", re.M)


def parser_flags(tree: ast.Module) -> set[str]:
    """The ``--flags`` of every ``add_argument`` call in the module."""
    return {arg.value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_usage_line_names_only_flags_the_example_takes(path):
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree) or ""
    lines = USAGE.findall(doc)
    assert lines and all(name == path.stem for name, _ in lines), lines
    named = {flag for _, rest in lines for flag in re.findall(r"\[(--[\w-]+)", rest)}
    assert named <= parser_flags(tree), (named - parser_flags(tree), path.name)
