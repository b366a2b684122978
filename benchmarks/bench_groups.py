"""Layer groups: KV memory per request, requests resident and hit rates of a hybrid model's
manager, against giving every layer a full-length table.

    python benchmarks/bench_groups.py [--seed 0] [--out benchmarks/results]

The mixes, workloads and accounting are ``prefixkv.bench.layer_groups`` (the same section
that ``prefixkv bench`` reports); this script runs both mixes and writes
groups-cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prefixkv.bench.layer_groups import GROUP_COLUMNS, MIXES, group_note, group_rows, run_groups
from prefixkv.bench.report import table

NOTES = """What it shows: a sliding-window group holds about W / 16 + 1 blocks of a request
once its prefill has moved past the window, so KV memory per request falls to the full
group's share plus the windows (gemma3-like 4k: 582 blocks against 1542), and 2-5x as
many requests stay resident. Residency is bounded by the last admission's peak: a prefill
chunk holds every group's blocks for the chunk's span until the next step releases them.
gemma3-like's hit rate is all full's: a step's released window blocks join the free
queue as vLLM's remove_skipped_blocks frees them (group by group, each group's last block
first, most recently used at release time), but a block no hit can use any more moves
ahead (groups/release_order.py): beside five windows, the first window's block j placed
kills the hits that read it, and the other windows' block j follows it before the first
window's block j - 1. In vLLM's plain order (171c400, before release_order.py) it was
26.3%: the windows' early blocks, which a hit on the whole document does not need,
outlived older documents' full-attention blocks. A finished request's blocks go in that
order too (groups/free_order.py): in vLLM's plain order the all-full rows fall to 20.7%
and 86.4% (run with that order patched in).
gpt-oss-like's rate rises (90.9% -> 96.5%) because its in-flight request holds less of the
pool.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic token ids")
    parser.add_argument("--out", type=Path, default=None, help="write groups-cpu.{json,md} here")
    args = parser.parse_args()
    data = run_groups(tuple(MIXES), args.seed, lambda label: print(label, flush=True))
    md = table(GROUP_COLUMNS, group_rows(data), markdown=True)
    print(md + "\n\n" + group_note(data))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "groups-cpu.json").write_text(json.dumps(data, indent=1) + "\n")
        (args.out / "groups-cpu.md").write_text(
            f"# Layer groups: memory, residency, hit rate\n\n`python benchmarks/bench_groups.py "
            f"--seed {args.seed} --out benchmarks/results`; also the layer-groups section of "
            f"`prefixkv bench` (`--groups`).\n\n{md}\n\n{group_note(data)}.\n\n{NOTES}")


if __name__ == "__main__":
    main()
