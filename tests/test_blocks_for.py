"""``blocks_for``: the package's one ceiling division (blocks for tokens, chunks for a
window edge); no module writes the division out again."""

import re
from pathlib import Path

import pytest

from prefixkv.core.block import blocks_for

SRC = Path(__file__).resolve().parents[1] / "src" / "prefixkv"


@pytest.mark.parametrize(("tokens", "size", "want"),
                         [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (97, 5, 20), (100, 5, 20)])
def test_blocks_for_rounds_up(tokens, size, want):
    assert blocks_for(tokens, size) == want


def test_the_ceiling_division_is_written_once():
    written = [str(p.relative_to(SRC)) for p in sorted(SRC.rglob("*.py"))
               for line in p.read_text().splitlines() if re.search(r"-\(-", line)]
    # (the store layer sits below core/ and cannot import it: its one division stays)
    assert written == ["core/block.py", "store/fetch.py"], written
