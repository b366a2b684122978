"""A store hit's start alone under callgrind: ``bench_store.py --only ops``'s steady state
(prepared prompts, 4 KiB blocks, sha256, the fetch and its landing run inline between),
the counted starts called through ``itertools.starmap`` (no other code of the run calls
it) so that callgrind collects inside them alone; its cache simulation then counts the
misses of a start that follows a fetch of ``blocks`` blocks (results/store25a-r21.md):

    PYTHONPATH=src valgrind --tool=callgrind --cache-sim=yes --collect-atstart=no \\
        --toggle-collect=starmap_next python benchmarks/store_start_cachesim.py 2048 4

With a third argument ``free``, the counted calls are instead the request's ``free`` and
the ``take_kv_ops()`` after it, the two scheduler-thread calls that follow a store-hit
admission (results/store25-r25.md); with ``land``, the landing poll after the fetch
(results/store25-r27.md).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from itertools import starmap
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefixkv import StoreWait  # noqa: E402
from prefixkv.store import FetchCost, SharedStore, StoreLayout  # noqa: E402
from store_setup import Inline, fill, local_backend, manager, prompt_of  # noqa: E402


def _free_and_step(m: Any) -> None:
    """The request's ``free`` and the step after it (counted under ``free``)."""
    m.free("r")
    m.take_kv_ops()


def main() -> None:
    blocks, counted = int(sys.argv[1]), int(sys.argv[2])
    free = sys.argv[3:] == ["free"]  # (count the free and the step, not the start)
    land = sys.argv[3:] == ["land"]  # (count the landing poll, not the start)
    with local_backend() as backend:
        layout = StoreLayout(f"cachesim-{time.time_ns()}", "x", 4096)
        ex = Inline()
        shared = SharedStore(backend, layout, max_fetch=blocks, timeout=60.0,
                             cost=FetchCost(1.0), executor=ex)
        m = manager("sha256", shared, blocks)
        memory = memoryview(bytearray(4096 * (blocks + 1)))
        m.attach_host_memory([[memory[i * 4096:(i + 1) * 4096]] for i in range(blocks + 1)])
        gc.disable()
        for r in range(8 + counted):  # the first admissions fill the pool: not counted
            ids = prompt_of(blocks, 5000 + r % 4)
            if r < 4:
                fill(layout, backend, ids)
            prompt = m.prepare(ids)
            if r >= 8 and not (free or land):
                (wait,) = list(starmap(m.add_request, [("r", prompt)]))
            else:
                wait = m.add_request("r", prompt)
            assert isinstance(wait, StoreWait), wait
            m.take_kv_ops()
            ex.run()
            if r >= 8 and land:
                (ended,) = list(starmap(m.poll_store, [()]))
            else:
                ended = m.poll_store()
            assert ended == ["r"], ended
            m.add_request("r", prompt)
            if r >= 8 and free:
                list(starmap(_free_and_step, [(m,)]))
            else:
                m.free("r")
                m.take_kv_ops()
        shared.close()


if __name__ == "__main__":
    main()
