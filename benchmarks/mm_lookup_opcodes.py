"""risks-r17's figures: Python bytecodes of one multimodal ``lookup`` (per-block extra
keys) after N pending runs (``index/pending.py``), and of a plain lookup beside it.
Results: benchmarks/results/mm_lookup_opcodes.md.

    PYTHONPATH=src python benchmarks/mm_lookup_opcodes.py [--runs 0,10,100,1000] [--blocks 8]
        [--host 0]

A ``KVCacheManager`` (block size 4, ``--host`` host slots) admits a request with an image
(``MultiModalInput`` over its blocks 1..2) and frees it, then admits N requests, each a
prompt of its own of ``--blocks`` full blocks and a token (each leaves its run pending).
Counted (``sys.settrace`` opcode events: the same whatever the machine's load), in this
order: a plain lookup of the first request's prompt (it walks its pending run whole), the
``lookup`` of the image prompt (it finds its blocks), that of an unrelated image prompt;
and the pending runs left after them.
"""

from __future__ import annotations

import argparse

from prefixkv import KVCacheManager
from prefixkv.bench.opcodes import count_opcodes
from prefixkv.extra_keys import ExtraKeys, MultiModalInput


def measure(runs: int, blocks: int, host: int) -> dict[str, int]:
    """The figures for one N (see the module's docstring)."""
    bs = 4
    m = KVCacheManager(runs * (blocks + 1) + 64, bs, seed=0, host_blocks=host)
    image = ExtraKeys(mm=(MultiModalInput("img", 4, 8),))
    prompt = list(range(1, 8 * bs + 2))
    m.add_request("img", prompt, extra=image)
    m.free("img")
    for r in range(runs):
        m.add_request(r, [100_000 + r * 64 + t for t in range(blocks * bs)] + [7])
    pending = len(m._index.run_counts.pending)  # type: ignore[attr-defined]
    out = {"runs": runs, "pending before": pending}
    first = [100_000 + t for t in range(blocks * bs)] + [7]
    out["plain lookup"] = count_opcodes(lambda: m.lookup(first)) if runs else 0
    out["mm lookup (hit)"] = count_opcodes(lambda: m.lookup(prompt, extra=image))
    other = ExtraKeys(mm=(MultiModalInput("other", 0, 4),))
    out["mm lookup (miss)"] = count_opcodes(lambda: m.lookup(list(range(500, 533)), extra=other))
    out["pending after"] = len(m._index.run_counts.pending)  # type: ignore[attr-defined]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="0,10,100,1000")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--host", type=int, default=0)
    args = parser.parse_args()
    rows = [measure(int(n), args.blocks, args.host) for n in args.runs.split(",")]
    names = list(rows[0])
    print("| " + " | ".join(names) + " |")
    print("|" + "---|" * len(names))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:,}" for k in names) + " |")


if __name__ == "__main__":
    main()
