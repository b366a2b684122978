"""Replay your own traffic: a JSONL trace, one request per line, in arrival order.

Each non-blank line is a JSON object with these fields::

    id          str or int, unique                                   required
    prompt      [token ids]            \\ exactly one of these two:   the prompt's tokens
    segments    [{"len": n, "share": "name"}, {"len": n}, ...]  /     or their lengths
    output      [token ids]            \\ exactly one of these two:   the decoded tokens
    output_len  n >= 1                 /                              or their count
    continues   id of an earlier line: this prompt starts with that request's prompt and
                output (a chat turn re-sending its history) and waits for it to finish
    lora, cache_salt   non-empty strings (extra keys: separate cache namespaces)

Token ids are ints in [0, 2**32). A segment is ``len`` synthetic tokens (seeded): unique
to its line, or, with ``"share": "name"``, the first ``len`` tokens of one stream per
name, so equal names with equal lengths give equal tokens. Example::

    {"id": "a", "segments": [{"share": "sys", "len": 2048}, {"len": 80}], "output_len": 40}
    {"id": "b", "continues": "a", "segments": [{"len": 50}], "output_len": 60}
    {"id": "c", "prompt": [1, 2, 3, 4], "output": [5, 6]}

Malformed input raises TraceError naming the line number and the field.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from ..extra_keys import ExtraKeys
from .workloads import VOCAB, BenchRequest, Workload

FIELDS = ("id", "prompt", "segments", "output", "output_len", "continues", "lora", "cache_salt")
POOL_TOKENS = 65536


class TraceError(ValueError):
    """A malformed trace. ``line`` is the 1-based line number (None for the whole file),
    ``field`` the offending field (None when the line itself is wrong)."""

    def __init__(self, message: str, line: int | None = None, field: str | None = None,
                 source: str = "trace") -> None:
        where = source + (f" line {line}" if line is not None else "")
        where += f", field {field!r}" if field is not None else ""
        super().__init__(f"{where}: {message}")
        self.line = line
        self.field = field


def load_trace(path: str | Path, seed: int = 0) -> Workload:
    """Parse the JSONL file at ``path``. Raises TraceError (also for an unreadable file)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read the trace: {exc}", source=str(path)) from None
    return parse_trace(text.splitlines(), seed=seed, source=str(path))


def parse_trace(lines: Iterable[str], *, seed: int = 0, source: str = "trace") -> Workload:
    """Build the workload of a trace's lines (see the module docstring). Raises TraceError
    for the first malformed line, or for a trace with no request."""
    rng = random.Random(f"trace/{seed}")
    shared: dict[str, list[int]] = {}
    done: dict[str, BenchRequest] = {}
    reqs: list[BenchRequest] = []
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue

        def fail(message: str, field: str | None = None) -> TraceError:
            return TraceError(message, lineno, field, source)

        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise fail(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise fail(f"expected a JSON object, got {type(obj).__name__}")
        for key in obj:
            if key not in FIELDS:
                raise fail(f"unknown field; known fields: {', '.join(FIELDS)}", key)
        rid = _rid(obj, "id", fail)
        if rid in done:
            raise fail(f"duplicate id {rid!r}", "id")
        history: tuple[int, ...] = ()
        after = None
        if "continues" in obj:
            after = _rid(obj, "continues", fail)
            if after not in done:
                raise fail(f"{after!r} is not the id of an earlier line", "continues")
            history = done[after].prompt + done[after].output
        own = _one_of(obj, "prompt", "segments", fail)
        if own == "prompt":
            tokens = _token_list(obj, "prompt", fail, allow_empty=after is not None)
        else:
            tokens = _segments(obj["segments"], rng, shared, fail)
        if _one_of(obj, "output", "output_len", fail) == "output":
            output = _token_list(obj, "output", fail, allow_empty=False)
        else:
            output = tuple(rng.choices(range(VOCAB), k=_positive(obj["output_len"], "output_len", fail)))
        req = BenchRequest(rid, history + tokens, output, _extra(obj, fail), after)
        done[rid] = req
        reqs.append(req)
    if not reqs:
        raise TraceError("the trace has no request (every line is blank)", source=source)
    return Workload(Path(source).stem or "trace", f"trace {source}: {len(reqs)} requests",
                    tuple(reqs), POOL_TOKENS)


def _rid(obj: dict, field: str, fail) -> str:
    value = obj.get(field)
    if field not in obj:
        raise fail("missing; every line needs an id", field)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise fail(f"must be a non-empty string or an int, got {value!r}", field)
    return str(value)


def _one_of(obj: dict, a: str, b: str, fail) -> str:
    if (a in obj) == (b in obj):
        raise fail(f"give exactly one of {a!r} and {b!r}", a)
    return a if a in obj else b


def _positive(value: object, field: str, fail) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(f"must be an int >= 1, got {value!r}", field)
    return value


def _token_list(obj: dict, field: str, fail, *, allow_empty: bool) -> tuple[int, ...]:
    value = obj[field]
    if not isinstance(value, list):
        raise fail(f"must be a list of token ids, got {type(value).__name__}", field)
    if not value and not allow_empty:
        raise fail("must not be empty", field)
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32:
            raise fail(f"item {i} is {t!r}; token ids are ints in [0, 2**32)", field)
    return tuple(value)


def _segments(value: object, rng: random.Random, shared: dict[str, list[int]], fail) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise fail("must be a non-empty list of {\"len\": n, \"share\": name} objects", "segments")
    out: list[int] = []
    for i, seg in enumerate(value):
        if not isinstance(seg, dict) or "len" not in seg or set(seg) - {"len", "share"}:
            raise fail(f"item {i} is {seg!r}; expected {{\"len\": n}} with an optional "
                       f"\"share\": name", "segments")
        n = _positive(seg["len"], f"segments[{i}].len", fail)
        name = seg.get("share")
        if name is None:
            out += rng.choices(range(VOCAB), k=n)
            continue
        if not isinstance(name, str) or not name:
            raise fail(f"must be a non-empty string, got {name!r}", f"segments[{i}].share")
        stream = shared.setdefault(name, [])
        if len(stream) < n:
            stream += rng.choices(range(VOCAB), k=n - len(stream))
        out += stream[:n]
    return tuple(out)


def _extra(obj: dict, fail) -> ExtraKeys | None:
    keys = {}
    for field in ("lora", "cache_salt"):
        if field in obj:
            value = obj[field]
            if not isinstance(value, str) or not value:
                raise fail(f"must be a non-empty string, got {value!r}", field)
            keys[field] = value
    return ExtraKeys(**keys) if keys else None
