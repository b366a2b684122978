"""KV bytes the attention kernel reads per step, with and without cascade attention, on the
shared-system-prompt and document workloads.

    python benchmarks/bench_cascade.py [--scale 1.0] [--out benchmarks/results]

A count, not a timing: ``prefixkv.bench.cascade_bytes`` (the scheduler, the count from
the kernel's tiling and the model shape are described there), which ``prefixkv bench``
reports too; this script writes its table as ``cascade-cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prefixkv.bench import cascade_bytes
from prefixkv.bench.report import table


def markdown(data: dict, scale: float) -> str:
    """The results file: the command, what is counted, the table."""
    doc = cascade_bytes.__doc__ or ""
    return "\n".join([
        "# Cascade attention: KV bytes read per step (counted, not timed)", "",
        f"`python benchmarks/bench_cascade.py --scale {scale}`: {data['model']}, blocks of "
        f"{data['block_size']}. " + " ".join(doc.split("\n\n")[1:3]).replace("\n", " "), "",
        "All steps, and the steps that decode only (no prefill in the batch).", "",
        table(cascade_bytes.CASCADE_COLUMNS, cascade_bytes.cascade_rows(data["rows"]), markdown=True,
              text_columns=1)]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="workload scale (requests)")
    parser.add_argument("--out", type=Path, default=None, help="write cascade-cpu.{json,md} here")
    args = parser.parse_args()
    data = cascade_bytes.run_cascade(args.scale)
    if "skipped" in data:
        raise SystemExit(f"bench_cascade.py: {data['skipped']}")
    md = markdown(data, args.scale)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cascade-cpu.json").write_text(json.dumps(dict(data, scale=args.scale), indent=2) + "\n")
        (args.out / "cascade-cpu.md").write_text(md)


if __name__ == "__main__":
    main()
