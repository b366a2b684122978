"""Drive any ``Allocator`` through a workload with a simple scheduler, and count.

One scheduler step::

    admit   : eligible waiting requests in arrival order, while the pool and the batch
              limit allow; the first one that does not fit waits (no overtaking) and is
              tried again only after some request has released its blocks
    decode  : every running request appends its next output token (append_tokens); on
              shortage the most recently admitted request is preempted (freed, re-queued
              at the head with its tokens so far as the prompt: a recompute)
    plan    : the allocator's per-step plan (``take_kv_ops``), counted: blocks offloaded
              to its host tier and loaded back (what an engine runs before the forward pass)
    sample  : blocks held, and reserved-but-unused slots
    finish  : requests that appended their last output token are freed

Accounting: a prompt token is *saved* when the admission found it cached
(``num_cached_tokens``) and *computed* otherwise, recomputes after preemption included.
The hit rate is that of first admissions: a preempted request's re-admission (its
prompt and the tokens decoded so far, nearly all still cached) is counted apart
(``readmitted_saved``/``readmitted_computed``), else preemption, which a larger pool
avoids, would raise the hit rate of a smaller pool above it.
For the attention its prefill would have cost, ``prefill_saved_pairs`` counts the causal
(query, key) pairs of the saved tokens: c(c+1)/2 for c tokens cached from position 0;
``prefill_computed_pairs`` those of the computed ones, n(n+1)/2 - c(c+1)/2 for a prompt
of n. ``loaded_blocks`` x block_size of the saved tokens came from the host tier.
Fragmentation is the time average of reserved-but-unused slots / reserved slots, where a
request reserves ``reserved_tokens(rid)`` slots when the allocator has that method (the
contiguous baseline), else one block_size per block it holds. Only the allocator calls
are timed (``time.perf_counter_ns``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from time import perf_counter_ns
from typing import Any

from ..allocator import Allocator
from ..errors import PromptTooLongError
from ..results import BlockLoads, BlockOffloads, StoreWait
from .errors import BenchError, shorten
from .workloads import BenchRequest, Workload

__all__ = ["MAX_RUNNING", "BenchError", "ReplayResult", "replay"]

MAX_RUNNING = 64


@dataclass(slots=True)
class ReplayResult:
    """Counts of one replay; every field is a plain number (see the module docstring)."""

    workload: str
    allocator: str
    pool_blocks: int
    block_size: int
    requests: int = 0
    admissions: int = 0
    preemptions: int = 0
    prefill_computed: int = 0
    prefill_saved: int = 0
    readmitted_saved: int = 0  # (of prefill_saved and prefill_computed: re-admissions')
    readmitted_computed: int = 0
    prefill_saved_pairs: int = 0
    prefill_computed_pairs: int = 0
    offloaded_blocks: int = 0
    loaded_blocks: int = 0
    decoded_tokens: int = 0
    peak_blocks: int = 0
    max_running: int = 0
    steps: int = 0
    unused_slot_steps: int = 0
    reserved_slot_steps: int = 0
    admit_ns: int = 0
    decode_ns: int = 0

    @property
    def hit_rate(self) -> float:
        """Saved / (saved + computed) prompt tokens of first admissions (re-admissions
        after preemption apart); 0.0 when nothing was admitted."""
        saved = self.prefill_saved - self.readmitted_saved
        total = saved + self.prefill_computed - self.readmitted_computed
        return saved / total if total else 0.0

    @property
    def readmitted_tokens(self) -> int:
        """Prompt tokens of re-admissions after preemption (saved and computed)."""
        return self.readmitted_saved + self.readmitted_computed

    @property
    def readmitted_hit_rate(self) -> float:
        """Saved / prompt tokens of re-admissions; 0.0 when there were none."""
        total = self.readmitted_tokens
        return self.readmitted_saved / total if total else 0.0

    @property
    def fragmentation(self) -> float:
        return self.unused_slot_steps / self.reserved_slot_steps if self.reserved_slot_steps else 0.0

    @property
    def us_per_admission(self) -> float:
        return self.admit_ns / self.admissions / 1e3 if self.admissions else 0.0

    @property
    def us_per_decoded_token(self) -> float:
        return self.decode_ns / self.decoded_tokens / 1e3 if self.decoded_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The counts and the derived rates (JSON values)."""
        out: dict[str, Any] = asdict(self)
        for name in ("hit_rate", "readmitted_tokens", "readmitted_hit_rate", "fragmentation",
                     "us_per_admission", "us_per_decoded_token"):
            out[name] = getattr(self, name)
        return out


class _Running:
    __slots__ = ("req", "tokens", "pos", "reserved")

    def __init__(self, req: BenchRequest, tokens: int, reserved: int) -> None:
        self.req = req
        self.tokens = tokens    # slots holding KV: prompt + output appended so far
        self.pos = 0            # next output token to append
        self.reserved = reserved


def replay(alloc: Allocator, workload: Workload, name: str, *,
           max_running: int = MAX_RUNNING) -> ReplayResult:
    """Run ``workload`` through ``alloc`` (fresh, empty) to the end and return the counts.

    Raises BenchError when a request cannot run even alone in the pool (the allocator's
    PromptTooLongError, or a None with nothing running). Does not check
    the allocator's invariants and does not free anything it did not admit. Raises
    BenchError, before anything is admitted, for a ``max_running`` that is not an int >= 1.
    """
    if type(max_running) is not int or max_running < 1:
        raise BenchError(f"max_running must be an int >= 1, got {shorten(max_running)}")
    bs = alloc.block_size
    res = ReplayResult(workload.name, name, alloc.num_blocks, bs, requests=len(workload.requests))
    reserved_of = getattr(alloc, "reserved_tokens", None)
    waiting: deque[BenchRequest] = deque(workload.requests)
    running: dict[str, _Running] = {}   # in admission order
    finished: set[str] = set()
    admitted: set[str] = set()          # ids admitted once: a later admission is a re-admission
    unused = 0                          # reserved-but-unused slots of running requests
    blocked = False                     # an admission failed and nothing was freed since

    def admit(req: BenchRequest) -> bool:
        nonlocal unused
        t0 = perf_counter_ns()
        try:
            adm = alloc.add_request(req.rid, req.prompt, extra=req.extra)
        except PromptTooLongError as exc:
            raise BenchError(f"request {req.rid!r} ({len(req.prompt)} prompt tokens) does not "
                             f"fit in an empty pool of {alloc.num_blocks} blocks of {bs} tokens "
                             f"(it needs {exc.needed})") from None
        res.admit_ns += perf_counter_ns() - t0
        if adm is None:
            return False
        assert not isinstance(adm, StoreWait), "the replay's allocators have no shared store"
        reserved = reserved_of(req.rid) if reserved_of else len(adm.block_ids) * bs
        running[req.rid] = _Running(req, len(req.prompt), reserved)
        unused += reserved - len(req.prompt)
        res.admissions += 1
        res.prefill_saved += adm.num_cached_tokens
        res.prefill_saved_pairs += adm.num_cached_tokens * (adm.num_cached_tokens + 1) // 2
        res.prefill_computed += adm.num_new_tokens
        if req.rid in admitted:
            res.readmitted_saved += adm.num_cached_tokens
            res.readmitted_computed += adm.num_new_tokens
        admitted.add(req.rid)
        n = adm.num_cached_tokens + adm.num_new_tokens
        cached = adm.num_cached_tokens
        res.prefill_computed_pairs += n * (n + 1) // 2 - cached * (cached + 1) // 2
        return True

    def release(rid: str) -> _Running:
        nonlocal unused, blocked
        blocked = False
        st = running.pop(rid)
        alloc.free(rid)
        unused -= st.reserved - st.tokens
        return st

    while waiting or running:
        res.steps += 1
        for req in list(waiting) if not blocked else ():
            if req.after is not None and req.after not in finished:
                continue
            if len(running) >= max_running:
                break
            if not admit(req):
                blocked = True
                break
            waiting.remove(req)
        if not running:
            _stuck(waiting, finished, alloc)
        res.max_running = max(res.max_running, len(running))
        for rid in list(running):
            st = running.get(rid)
            while st is not None:
                t0 = perf_counter_ns()
                added = alloc.append_tokens(rid, st.req.output[st.pos:st.pos + 1])
                res.decode_ns += perf_counter_ns() - t0
                if added is not None:
                    st.pos += 1
                    st.tokens += 1
                    res.decoded_tokens += 1
                    if added and not reserved_of:
                        st.reserved += len(added) * bs
                        unused += len(added) * bs
                    unused -= 1
                    break
                victim = next(reversed(running))
                if len(running) == 1:
                    raise BenchError(f"request {rid!r} needs more than the whole pool of "
                                     f"{alloc.num_blocks} blocks of {bs} tokens")
                _requeue(waiting, release(victim))
                res.preemptions += 1
                if victim == rid:
                    st = None
        for op in alloc.take_kv_ops():
            res.offloaded_blocks += len(op.src) if type(op) is BlockOffloads else 0
            res.loaded_blocks += len(op.src) if type(op) is BlockLoads else 0
        held = alloc.num_blocks - alloc.num_free_blocks
        res.peak_blocks = max(res.peak_blocks, held)
        res.reserved_slot_steps += held * bs
        res.unused_slot_steps += unused
        for rid in [r for r, st in running.items() if st.pos == len(st.req.output)]:
            release(rid)
            finished.add(rid)
    return res


def _requeue(waiting: deque[BenchRequest], st: _Running) -> None:
    """Put a preempted request back at the head: what it decoded joins its prompt."""
    r = st.req
    waiting.appendleft(BenchRequest(r.rid, r.prompt + r.output[:st.pos], r.output[st.pos:],
                                    r.extra, r.after))


def _stuck(waiting: deque[BenchRequest], finished: set[str], alloc: Allocator) -> None:
    """Nothing runs: the first eligible request does not fit even in an empty pool."""
    for req in waiting:
        if req.after is None or req.after in finished:
            raise BenchError(
                f"request {req.rid!r} ({len(req.prompt)} prompt tokens) does not fit in an "
                f"empty pool of {alloc.num_blocks} blocks of {alloc.block_size} tokens")
    raise BenchError(f"{len(waiting)} requests wait for requests that never finish "
                     f"(first: {waiting[0].rid!r} after {waiting[0].after!r})")
