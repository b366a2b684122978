"""(helper) A peer workload's step with KV events on, as ``events_account.py``,
``events_functions.py`` and ``cold_parts.py`` replay it: per side (prefixkv, vLLM 0.33), the calls of one
request's step in order (admit, take the step's events, publish them, free), and the
labels of the parts. Imports prefixkv and vLLM from the path its importer set up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefixkv.fleet.publisher import EventPublisher
from vllm_side import vllm_request

SKIP = 3  # the first requests of a replay (an empty cache) are not counted


def prefixkv_step(m: Any, pub: EventPublisher, q: Any) -> list[Callable[[], object]]:
    p = m.prepare(q.prompt)  # (untimed: an engine's input thread prepares it)
    pending: list[Any] = []
    return [lambda: m.add_request(q.rid, p), lambda: pending.append(m.take_pending_events()),
            lambda: pub.publish(pending[0]), lambda: m.free(q.rid)]


def vllm_step(m: Any, pub: Any, q: Any) -> list[Callable[[], object]]:
    from vllm.distributed.kv_events import KVEventBatch

    req = vllm_request(q.rid, list(q.prompt))  # (its input thread's: module doc)
    got: list[Any] = []

    def allocate() -> None:
        blocks, hit = got[0][:2]
        assert m.allocate_slots(req, len(q.prompt) - hit, num_new_computed_tokens=hit,
                                new_computed_blocks=blocks) is not None

    def publish() -> None:
        if got[1]:
            pub.publish(KVEventBatch(ts=time.time(), events=got[1]))

    return [lambda: got.append(m.get_computed_blocks(req)), allocate,
            lambda: got.append(m.take_events()), publish, lambda: m.free(req)]


SIDES = {"prefixkv": (prefixkv_step, ("add_request", "take_pending_events", "publish")),
         "vLLM": (vllm_step, ("get_computed_blocks", "allocate_slots", "take_events",
                              "KVEventBatch + publish"))}
