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

Lines are separated by ``\n`` only (``\r\n`` works too): U+2028 and its kin are legal
inside JSON strings. A UTF-8 byte-order mark may open the file. The caps of ``limits``
(tokens per request, tokens per trace with every continued prompt counted whole,
characters per line) are checked line by line before that line's tokens are drawn.

Malformed input raises TraceError naming the line number and the field.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TextIO

from ..errors import ExtraKeysError
from ..extra_keys import ExtraKeys
from . import limits
from .errors import BenchError, shorten
from .workloads import TOKEN_IDS, BenchRequest, Workload

FIELDS = ("id", "prompt", "segments", "output", "output_len", "continues", "lora", "cache_salt")
POOL_TOKENS = 65536

_Fail = Callable[..., "TraceError"]  # a line's error: (message, field=None) -> TraceError


class TraceError(BenchError):
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
    """Parse the JSONL file at ``path``, streamed line by line. Raises TraceError (also
    for an unreadable file, one that is not UTF-8, or a line over ``MAX_LINE_CHARS``)."""
    source = str(path)
    try:
        with open(path, encoding="utf-8-sig") as f:
            return parse_trace(_read_lines(f, source), seed=seed, source=source)
    except OSError as exc:
        raise TraceError(f"cannot read the trace: {exc.strerror or exc}", source=source) from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"cannot read the trace: not UTF-8 ({exc.reason})", source=source) from None


def _read_lines(f: TextIO, source: str) -> Iterator[str]:
    """The file's lines (universal newlines: split on \\n, \\r\\n, \\r only), each read
    with a bound so that one endless line cannot fill the memory."""
    cap = limits.MAX_LINE_CHARS
    for lineno in itertools.count(1):
        line = f.readline(cap + 1)
        if not line:
            return
        if len(line.rstrip("\n")) > cap:
            raise TraceError(f"longer than {cap:,} characters (limits.MAX_LINE_CHARS)", lineno,
                             source=source)
        yield line


def parse_trace(lines: Iterable[str], *, seed: int = 0, source: str = "trace") -> Workload:
    """Build the workload of a trace's lines (see the module docstring). Raises TraceError
    for the first malformed line or the first over a cap, or for a trace with no request."""
    rng = random.Random(f"trace/{seed}")
    shared: dict[str, list[int]] = {}
    done: dict[str, BenchRequest] = {}
    reqs: list[BenchRequest] = []
    total = 0
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue

        def fail(message: str, field: str | None = None, lineno: int = lineno) -> TraceError:
            return TraceError(message, lineno, field, source)

        obj = _json_object(raw, fail)
        rid = _rid(obj, "id", fail)
        if rid in done:
            raise fail(f"duplicate id {shorten(rid)}", "id")
        history: tuple[int, ...] = ()
        after = None
        if "continues" in obj:
            after = _rid(obj, "continues", fail)
            if after not in done:
                raise fail(f"{shorten(after)} is not the id of an earlier line", "continues")
            history = done[after].prompt + done[after].output
        own = _one_of(obj, "prompt", "segments", fail)
        prompt = _token_list(obj, "prompt", fail, allow_empty=after is not None) if own == "prompt" else None
        segments = _segments(obj["segments"], fail) if own == "segments" else []
        given = _one_of(obj, "output", "output_len", fail) == "output"
        output = _token_list(obj, "output", fail, allow_empty=False) if given else None
        size = len(history) + (len(prompt) if prompt is not None else sum(n for n, _ in segments))
        output_len = (len(output) if output is not None
                      else _positive(obj["output_len"], "output_len", fail))
        size += output_len
        total += size
        _check_caps(size, total, fail)
        tokens = prompt if prompt is not None else _draw(segments, rng, shared)
        if output is None:
            output = tuple(rng.choices(TOKEN_IDS, k=output_len))
        req = BenchRequest(rid, history + tokens, output, _extra(obj, fail), after)
        done[rid] = req
        reqs.append(req)
    if not reqs:
        raise TraceError("the trace has no request (every line is blank)", source=source)
    return Workload(Path(source).stem or "trace", f"trace {source}: {len(reqs)} requests",
                    tuple(reqs), POOL_TOKENS)


def _json_object(raw: str, fail: _Fail) -> dict[str, object]:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise fail(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise fail("nested too deeply to parse") from None
    except ValueError as exc:  # e.g. an int of more digits than Python converts
        raise fail(f"not valid JSON ({str(exc).split(';')[0]})") from None
    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    for key in obj:
        if key not in FIELDS:
            raise fail(f"unknown field; known fields: {', '.join(FIELDS)}",
                       key if len(key) <= 40 else key[:40] + "...")
    return obj


def _check_caps(size: int, total: int, fail: _Fail) -> None:
    if size > limits.MAX_REQUEST_TOKENS:
        raise fail(f"{size:,} tokens (prompt with its history, and output), over the cap of "
                   f"{limits.MAX_REQUEST_TOKENS:,} tokens per request")
    if total > limits.MAX_TRACE_TOKENS:
        raise fail(f"the trace reaches {total:,} tokens (prompts with their history, and "
                   f"outputs), over the cap of {limits.MAX_TRACE_TOKENS:,} tokens for the whole "
                   f"trace: replay fewer lines or shorter chains of 'continues'")


def _rid(obj: dict[str, object], field: str, fail: _Fail) -> str:
    value = obj.get(field)
    if field not in obj:
        raise fail("missing; every line needs an id", field)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise fail(f"must be a non-empty string or an int, got {shorten(value)}", field)
    return str(value)


def _one_of(obj: dict[str, object], a: str, b: str, fail: _Fail) -> str:
    if (a in obj) == (b in obj):
        raise fail(f"give exactly one of {a!r} and {b!r}", a)
    return a if a in obj else b


def _positive(value: object, field: str, fail: _Fail) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(f"must be an int >= 1, got {shorten(value)}", field)
    return value


def _token_list(obj: dict[str, object], field: str, fail: _Fail, *, allow_empty: bool) -> tuple[int, ...]:
    value = obj[field]
    if not isinstance(value, list):
        raise fail(f"must be a list of token ids, got {type(value).__name__}", field)
    if not value and not allow_empty:
        raise fail("must not be empty", field)
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32:
            raise fail(f"item {i} is {shorten(t)}; token ids are ints in [0, 2**32)", field)
    return tuple(value)


def _segments(value: object, fail: _Fail) -> list[tuple[int, str | None]]:
    """The segments' (length, shared stream name or None), checked, nothing drawn yet."""
    if not isinstance(value, list) or not value:
        raise fail("must be a non-empty list of {\"len\": n, \"share\": name} objects", "segments")
    out: list[tuple[int, str | None]] = []
    for i, seg in enumerate(value):
        if not isinstance(seg, dict) or "len" not in seg or set(seg) - {"len", "share"}:
            raise fail(f"item {i} is {shorten(seg)}; expected {{\"len\": n}} with an optional "
                       f"\"share\": name", "segments")
        n = _positive(seg["len"], f"segments[{i}].len", fail)
        name = seg.get("share")
        if name is not None and (not isinstance(name, str) or not name):
            raise fail(f"must be a non-empty string, got {shorten(name)}", f"segments[{i}].share")
        out.append((n, name))
    return out


def _draw(segments: list[tuple[int, str | None]], rng: random.Random,
          shared: dict[str, list[int]]) -> tuple[int, ...]:
    """The segments' tokens: unique draws, or the first n of the named shared stream."""
    out: list[int] = []
    for n, name in segments:
        if name is None:
            out += rng.choices(TOKEN_IDS, k=n)
            continue
        stream = shared.setdefault(name, [])
        if len(stream) < n:
            stream += rng.choices(TOKEN_IDS, k=n - len(stream))
        out += stream[:n]
    return tuple(out)


def _extra(obj: dict[str, object], fail: _Fail) -> ExtraKeys | None:
    keys: dict[str, str] = {}
    for field in ("lora", "cache_salt"):
        if field in obj:
            value = obj[field]
            if not isinstance(value, str) or not value:
                raise fail(f"must be a non-empty string, got {shorten(value)}", field)
            try:  # ExtraKeys' own checks, field by field (a lone surrogate is no UTF-8)
                ExtraKeys(lora=value) if field == "lora" else ExtraKeys(cache_salt=value)
            except ExtraKeysError as exc:
                raise fail(str(exc), field) from None
            keys[field] = value
    if not keys:
        return None
    return ExtraKeys(lora=keys.get("lora"), cache_salt=keys.get("cache_salt"))
