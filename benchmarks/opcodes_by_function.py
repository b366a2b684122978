"""Bytecodes per function of a benchmark that counts with ``count_opcodes``: runs the
script as a program with ``prefixkv.bench.opcodes.count_opcodes`` also summing each
function's own bytecodes (its code object's, not its callees') and calls, and
prints, after the script's own output, the totals of the functions whose qualified name
or file contains ``--match``, summed over every counted call of the run. Deterministic
(``sys.settrace``), so a before/after of a refactor compares its hot functions exactly.

    PYTHONPATH=src python benchmarks/opcodes_by_function.py --match kids \\
        benchmarks/orphans_cost.py --host 10000
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections import Counter
from functools import partial

import prefixkv.bench.opcodes
from prefixkv.bench.opcodes import count_opcodes

OWN: Counter[str] = Counter()  # "path:qualname" -> bytecodes of that code object
CALLS: Counter[str] = Counter()  # "path:qualname" -> calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--match", action="append", required=True,
                    help="a piece of the file or qualified name (repeatable)")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    # (before the script imports it; a partial, in C: a profiler counting calls sees none)
    prefixkv.bench.opcodes.count_opcodes = partial(count_opcodes, own=OWN, calls=CALLS)
    sys.argv = [a.script, *a.args]
    runpy.run_path(a.script, run_name="__main__")
    print("\n| function | calls | bytecodes |\n|---|---:|---:|")
    for name in sorted(OWN):
        if any(m in name for m in a.match):
            print(f"| {name} | {CALLS[name]:,} | {OWN[name]:,} |")


if __name__ == "__main__":
    main()
