"""The vLLM plug-in's step with KV events on, two trees of prefixkv against each other and
vLLM 0.33's own manager, paired in one process: a peer workload replayed request by
request (``Request()`` built untimed, as vLLM's input thread builds it), each step
``get_computed_blocks``, ``allocate_slots``, ``take_events()`` and a ``KVEventBatch``
published to the side's own ``ZmqEventPublisher``; a 2 ms sleep after each step, the
free untimed:

    python benchmarks/plugin_events_pair.py pressure,chat 8 A=/tmp/main/src B=src [--deployed]

The plug-in's manager is built alone, not by its ``Scheduler``, so its events are built
on this thread (``Telemetry.built_events``: what a deployment pays with a metrics
collector or a publisher other than vLLM's own; with vLLM's ``ZmqEventPublisher`` the
``Scheduler`` hands the build to the publisher's thread). ``--deployed``: each prefixkv
side as prefixkv's ``Scheduler`` sets it up with vLLM's ``ZmqEventPublisher``: the
``Request`` built with the manager's preparing hasher (``PreparedPrompts.hasher`` around
vLLM's, untimed: vLLM's input thread runs it), so admission takes the prepared
``Prompt``, and the events handed off (``hand_off``: built on the publisher's thread).
Each ``NAME=DIR`` imports prefixkv from ``DIR``. Printed per workload: vLLM's µs a step
(thread CPU, the median over rounds), each tree's and its ratio (the median of the
rounds' own), and each later tree's µs over the first's.
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tree_import import import_tree  # noqa: E402
from vllm_side import BS, HASHER, SAMPLING, vllm_manager  # noqa: E402

CLOCK = time.thread_time_ns


def replay(cls: Any, pub: Any, requests: Any, pool: int, deployed: bool) -> float:
    """µs a step of ``requests`` on a fresh manager of class ``cls`` (None: vLLM's);
    ``deployed``: prompts prepared and events handed off (module doc)."""
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.v1.request import Request

    m = vllm_manager(True, pool, cls)
    hasher = HASHER
    if deployed and cls is not None:
        hasher = m.prepared_prompts.hasher(HASHER)
        m.hands_off_events = True  # (its publisher's queue swapped once: ``main``)
    gc.collect()
    gc.freeze()
    total = 0
    for q in requests:
        req = Request(q.rid, list(q.prompt), SAMPLING, None, block_hasher=hasher)
        t0 = CLOCK()
        blocks, hit, *_ = m.get_computed_blocks(req)
        assert m.allocate_slots(req, len(q.prompt) - hit, num_new_computed_tokens=hit,
                                new_computed_blocks=blocks) is not None
        events = m.take_events()
        if events:
            pub.publish(KVEventBatch(ts=time.time(), events=events))
        total += CLOCK() - t0
        m.free(req)
        time.sleep(0.002)
    gc.unfreeze()
    # (each admission took its prepared Prompt: the ids path would measure the other set-up)
    # (each lookup and each admission took the prepared Prompt: the ids path is the other set-up)
    assert not deployed or cls is None or m.prepared_prompts.taken == 2 * len(requests)
    return total / len(requests) / 1e3


def main() -> None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    args = [a for a in sys.argv[1:] if a != "--deployed"]
    deployed = len(args) < len(sys.argv) - 1
    names, rounds = args[0].split(","), int(args[1])
    trees = dict(a.split("=", 1) for a in args[2:])
    loaded = {k: import_tree(v, "prefixkv.integrations.vllm.manager", "prefixkv.bench.workloads",
                             "prefixkv.integrations.vllm.handoff")
              for k, v in trees.items()}
    classes: dict[str, Any] = {"vLLM": None, **{k: mods[0].KVCacheManager for k, mods in loaded.items()}}
    folder = tempfile.mkdtemp()
    pubs = {k: ZmqEventPublisher(0, endpoint=f"ipc://{folder}/{i}", topic="kv")
            for i, k in enumerate(classes)}
    kinds = list(classes)
    if deployed:  # (before anything is published: ``hand_off``)
        for k, mods in loaded.items():
            assert mods[2].hand_off(pubs[k]), "vLLM's own ZmqEventPublisher"
    for name in names:
        wl = next(iter(loaded.values()))[1].builtin(name, 1.0)
        got: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(rounds):
            for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                got[k].append(replay(classes[k], pubs[k], wl.requests, wl.pool_tokens // BS,
                                     deployed))
        v, first = got["vLLM"], got[kinds[1]]
        cells = [f"{k} {statistics.median(got[k]):6.1f} us, "
                 f"{statistics.median(x / y for x, y in zip(v, got[k], strict=True)):4.1f}x"
                 for k in kinds[1:]]
        cells += [f"{k}/{kinds[1]} {statistics.median(x / y for x, y in zip(got[k], first, strict=True)):.3f}"
                  for k in kinds[2:]]
        label = name + (" deployed" if deployed else "")
        print(f"{label:14s} vLLM {statistics.median(v):7.1f} us | " + " | ".join(cells),
              time.strftime("%T"), "load", Path("/proc/loadavg").read_text().split()[0], flush=True)
    for p in pubs.values():
        p.shutdown()


if __name__ == "__main__":
    main()
