"""The Python examples of docs/kv_layout.md run as written (CPU, torch reference)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "kv_layout.md"


def test_kv_layout_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/kv_layout.md lost its example"
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), {})
