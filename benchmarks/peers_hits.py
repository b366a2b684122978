"""What each allocator serves under pressure: prefixkv's manager, vLLM 0.33's own
``KVCacheManager`` and SGLang 0.5.23's own ``RadixCache`` replay the same workloads
(``prefixkv.bench.replay``: one scheduler for all three) in pools of the same size, and
the prefill tokens each saves are printed side by side. Counts, not times.

vLLM's side is its manager as ``vllm_side.py`` builds it, with one block more (its null
block, which holds nothing). SGLang's side is its radix tree driven as its scheduler
drives it (``tests/engines/sglang_radix.py``, which lists the stand-ins SGLang's modules
need here), with a page of ``block_size`` tokens per block. A preempted request is freed
with what it computed cached in all three (SGLang: ``release_kv_cache`` with a checkpoint).

    PYTHONPATH=src python benchmarks/peers_hits.py [--scale 0.25] [--seeds 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
TREE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TREE))

from prefixkv import Admission, ExtraKeys, KVCacheManager  # noqa: E402
from prefixkv.bench.replay import replay  # noqa: E402
from prefixkv.bench.workloads import Workload, builtin  # noqa: E402

BS = 16


class VllmSide:
    """vLLM's manager behind the calls ``replay`` makes (``num_blocks`` usable blocks)."""

    def __init__(self, num_blocks: int) -> None:
        import vllm_side

        self.v = vllm_side
        self.m = vllm_side.vllm_manager(False, num_blocks + 1)
        self.num_blocks, self.block_size = num_blocks, BS
        self.reqs: dict[Hashable, Any] = {}

    def add_request(self, rid: Hashable, prompt: Sequence[int], *, extra: ExtraKeys | None = None,
                    **_: Any) -> Admission | None:
        from vllm.v1.request import RequestStatus

        r = self.v.vllm_request(str(rid), list(prompt))
        if extra is not None:
            r.cache_salt = extra.cache_salt  # (the workloads' only extra key)
            r.block_hashes.clear()
            r.update_block_hashes()
        blocks, hit, _ = self.m.get_computed_blocks(r)
        new = self.m.allocate_slots(r, len(prompt) - hit, hit, blocks)
        if new is None:
            return None
        r.status, r.num_computed_tokens = RequestStatus.RUNNING, len(prompt)
        self.reqs[rid] = r
        return Admission(rid, self.m.get_block_ids(str(rid))[0], hit, len(prompt) - hit)

    def append_tokens(self, rid: Hashable, token_ids: Sequence[int]) -> tuple[int, ...] | None:
        r = self.reqs[rid]
        before = len(self.m.get_block_ids(str(rid))[0])
        r.append_output_token_ids(list(token_ids))
        if self.m.allocate_slots(r, len(token_ids)) is None:
            del r._output_token_ids[-len(token_ids):], r._all_token_ids[-len(token_ids):]
            del r.block_hashes[r.num_tokens // BS:]
            return None
        r.num_computed_tokens += len(token_ids)
        return tuple(self.m.get_block_ids(str(rid))[0][before:])

    def free(self, rid: Hashable, **_: Any) -> None:
        self.m.free(self.reqs.pop(rid))

    @property
    def num_free_blocks(self) -> int:
        return self.m.block_pool.get_num_free_blocks()

    def take_kv_ops(self) -> list[Any]:
        return []


class RadixSide:
    """SGLang's radix tree behind the calls ``replay`` makes (``num_blocks`` pages)."""

    def __init__(self, num_blocks: int) -> None:
        from tests.engines.sglang_radix import Radix

        self.r = Radix(num_blocks, BS)
        self.num_blocks, self.block_size = num_blocks, BS

    def add_request(self, rid: Hashable, prompt: Sequence[int], *, extra: ExtraKeys | None = None,
                    **_: Any) -> Admission | None:
        lora, salt = (extra.lora, extra.cache_salt) if extra is not None else (None, None)
        hit = self.r.admit(str(rid), list(prompt), lora, salt)
        if hit is None:
            return None
        return Admission(rid, range(len(self.r.reqs[str(rid)].row) // BS), hit, len(prompt) - hit)

    def append_tokens(self, rid: Hashable, token_ids: Sequence[int]) -> tuple[int, ...] | None:
        pages = len(self.r.reqs[str(rid)].row)
        for t in token_ids:
            if not self.r.decode(str(rid), t):
                return None
        return tuple(range((len(self.r.reqs[str(rid)].row) - pages) // BS))

    def free(self, rid: Hashable, **_: Any) -> None:
        self.r.finish(str(rid))

    @property
    def num_free_blocks(self) -> int:
        return self.r.free_pages()

    def take_kv_ops(self) -> list[Any]:
        return []


SIDES = {"prefixkv": lambda n: KVCacheManager(n, BS), "vllm": VllmSide, "sglang": RadixSide}


def rows(workloads: Sequence[tuple[int, Workload]], fractions: Sequence[float]) -> list[dict[str, Any]]:
    """Each (seed, workload) in pools of ``fraction`` x its designed room (at least what
    its longest request needs), on every side."""
    out = []
    for seed, w in workloads:
        for f in fractions:
            pool = max(w.max_tokens() // BS + 2, int(w.pool_tokens // BS * f))
            row: dict[str, Any] = dict(workload=f"{w.name} (seed {seed})", pool_blocks=pool,
                                       prompt_tokens=w.total_prompt_tokens())
            for name, make in SIDES.items():
                res = replay(make(pool), w, name)
                row[name] = (res.prefill_saved - res.readmitted_saved, res.preemptions)
            out.append(row)
    return out


def table(got: list[dict[str, Any]]) -> str:
    """Markdown: prompt tokens first admissions found cached (re-admissions after a
    preemption apart), and preemptions."""
    head = ("| workload | pool blocks | prompt tokens | " + " | ".join(
        f"{s} hit tokens (preemptions)" for s in SIDES) + " | prefixkv - vllm | prefixkv - sglang |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in got:
        cells = [f"{r[s][0]} ({r[s][1]})" for s in SIDES]
        lines.append(f"| {r['workload']} | {r['pool_blocks']} | {r['prompt_tokens']} | "
                     + " | ".join(cells)
                     + f" | {r['prefixkv'][0] - r['vllm'][0]} | {r['prefixkv'][0] - r['sglang'][0]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--fractions", default="0.25,0.5,1.0")
    p.add_argument("--workloads", default="system-prompt,chat,document,pressure")
    args = p.parse_args(argv)
    workloads = [(seed, builtin(name, args.scale, seed)) for name in args.workloads.split(",")
                 for seed in range(args.seeds)]
    print(table(rows(workloads, [float(f) for f in args.fractions.split(",")])))


if __name__ == "__main__":
    main()
