"""The JSONL trace format: what parses, and every error naming its line and field."""

from __future__ import annotations

import json

import pytest

from prefixkv import ExtraKeys
from prefixkv.bench import limits
from prefixkv.bench.trace import TraceError, load_trace, parse_trace


def _lines(*objs) -> list[str]:
    return [o if isinstance(o, str) else json.dumps(o) for o in objs]


def test_token_ids_and_lengths_with_sharing():
    wl = parse_trace(_lines(
        {"id": "a", "segments": [{"share": "sys", "len": 32}, {"len": 5}], "output_len": 3},
        "",
        {"id": 7, "segments": [{"share": "sys", "len": 32}, {"len": 4}], "output": [1, 2]},
        {"id": "c", "continues": "a", "prompt": [9, 9], "output_len": 1, "lora": "x",
         "cache_salt": "t1"},
        {"id": "d", "segments": [{"share": "sys", "len": 16}], "output_len": 1},
    ), seed=1)
    a, b, c, d = wl.requests
    assert [r.rid for r in wl.requests] == ["a", "7", "c", "d"]
    assert len(a.prompt) == 37 and len(a.output) == 3
    assert a.prompt[:32] == b.prompt[:32] and a.prompt[32:] != b.prompt[32:36]
    assert d.prompt == a.prompt[:16]
    assert b.output == (1, 2)
    assert c.prompt == a.prompt + a.output + (9, 9) and c.after == "a"
    assert c.extra == ExtraKeys(lora="x", cache_salt="t1") and a.extra is None
    assert wl.requests == parse_trace(_lines(
        {"id": "a", "segments": [{"share": "sys", "len": 32}, {"len": 5}], "output_len": 3},
        {"id": 7, "segments": [{"share": "sys", "len": 32}, {"len": 4}], "output": [1, 2]},
        {"id": "c", "continues": "a", "prompt": [9, 9], "output_len": 1, "lora": "x",
         "cache_salt": "t1"},
        {"id": "d", "segments": [{"share": "sys", "len": 16}], "output_len": 1},
    ), seed=1).requests  # seeded: the same trace and seed give the same tokens


def test_continues_with_empty_prompt_is_the_history():
    wl = parse_trace(_lines({"id": 1, "prompt": [1], "output": [2]},
                            {"id": 2, "continues": 1, "prompt": [], "output": [3]}))
    assert wl.requests[1].prompt == (1, 2)


OK = {"id": "x", "prompt": [1, 2], "output_len": 2}
ERRORS = [
    ("{not json", None, "not valid JSON"),
    ("[1, 2]", None, "expected a JSON object, got list"),
    ({**OK, "colour": 1}, "colour", "unknown field"),
    ({"prompt": [1], "output_len": 1}, "id", "missing"),
    ({**OK, "id": True}, "id", "non-empty string or an int"),
    ({**OK, "id": ""}, "id", "non-empty string or an int"),
    ({**OK, "id": 1.5}, "id", "non-empty string or an int"),
    ({**OK, "id": "first"}, "id", "duplicate id 'first'"),
    ({**OK, "continues": "nobody"}, "continues", "not the id of an earlier line"),
    ({**OK, "segments": [{"len": 1}]}, "prompt", "exactly one of 'prompt' and 'segments'"),
    ({"id": "x", "output_len": 1}, "prompt", "exactly one of 'prompt' and 'segments'"),
    ({**OK, "prompt": "1 2"}, "prompt", "must be a list of token ids, got str"),
    ({**OK, "prompt": []}, "prompt", "must not be empty"),
    ({**OK, "prompt": [1, -1]}, "prompt", "item 1 is -1"),
    ({**OK, "prompt": [1.5]}, "prompt", "item 0 is 1.5"),
    ({**OK, "prompt": [True]}, "prompt", "item 0 is True"),
    ({**OK, "prompt": [2**32]}, "prompt", "token ids are ints in"),
    ({"id": "x", "segments": [], "output_len": 1}, "segments", "non-empty list"),
    ({"id": "x", "segments": {"len": 1}, "output_len": 1}, "segments", "non-empty list"),
    ({"id": "x", "segments": [3], "output_len": 1}, "segments", "item 0 is 3"),
    ({"id": "x", "segments": [{"share": "s"}], "output_len": 1}, "segments", "item 0"),
    ({"id": "x", "segments": [{"len": 1, "n": 2}], "output_len": 1}, "segments", "item 0"),
    ({"id": "x", "segments": [{"len": 0}], "output_len": 1}, "segments[0].len", "int >= 1"),
    ({"id": "x", "segments": [{"len": 1}, {"len": 1, "share": 5}], "output_len": 1},
     "segments[1].share", "non-empty string"),
    ({"id": "x", "prompt": [1]}, "output", "exactly one of 'output' and 'output_len'"),
    ({**OK, "output": [1]}, "output", "exactly one of 'output' and 'output_len'"),
    ({"id": "x", "prompt": [1], "output": []}, "output", "must not be empty"),
    ({**OK, "output_len": 0}, "output_len", "must be an int >= 1, got 0"),
    ({**OK, "output_len": "3"}, "output_len", "must be an int >= 1, got '3'"),
    ({**OK, "lora": ""}, "lora", "non-empty string"),
    ({**OK, "cache_salt": 3}, "cache_salt", "non-empty string"),
]


@pytest.mark.parametrize("bad,field,message", ERRORS)
def test_every_error_names_line_and_field(bad, field, message):
    lines = _lines({"id": "first", "prompt": [5], "output_len": 1}, "   ", bad)
    with pytest.raises(TraceError) as info:
        parse_trace(lines, source="t.jsonl")
    err = info.value
    assert (err.line, err.field) == (3, field)
    assert message in str(err)
    assert str(err).startswith("t.jsonl line 3" + (f", field {field!r}" if field else ""))
    assert isinstance(err, ValueError)


def test_empty_trace():
    with pytest.raises(TraceError, match="no request") as info:
        parse_trace(["", "  "])
    assert info.value.line is None


def test_load_trace_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(OK) + "\n")
    wl = load_trace(path)
    assert wl.name == "mine" and len(wl.requests) == 1
    with pytest.raises(TraceError, match="cannot read the trace"):
        load_trace(tmp_path / "missing.jsonl")


def test_line_separators_inside_strings_and_a_bom(tmp_path):
    # JSONL splits on "\n" only: U+2028/U+2029/U+0085 are legal raw characters in a JSON
    # string, and a UTF-8 byte-order mark may open the file.
    path = tmp_path / "t.jsonl"
    salt = "a\u2028b\u2029c\x85d\x0ce"
    line = json.dumps({**OK, "cache_salt": salt}, ensure_ascii=False)
    path.write_bytes(b"\xef\xbb\xbf" + (line + "\r\n" + json.dumps({**OK, "id": "y"})).encode())
    wl = load_trace(path)
    assert [r.rid for r in wl.requests] == ["x", "y"]
    assert wl.requests[0].extra == ExtraKeys(cache_salt=salt)


def test_unreadable_traces(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(OK).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match="cannot read the trace: not UTF-8"):
        load_trace(path)
    monkeypatch.setattr(limits, "MAX_LINE_CHARS", 50)
    path.write_text(json.dumps(OK) + "\n" + json.dumps({**OK, "id": "y" * 6}) + "\n")
    with pytest.raises(TraceError, match="line 2: longer than 50 characters") as info:
        load_trace(path)  # 51 characters
    assert info.value.line == 2
    path.write_text(json.dumps({**OK, "id": "y" * 5}) + "\r\n")  # 50 characters + "\r\n"
    assert load_trace(path).requests[0].rid == "y" * 5


def test_token_caps_count_the_history(monkeypatch):
    monkeypatch.setattr(limits, "MAX_REQUEST_TOKENS", 10)
    monkeypatch.setattr(limits, "MAX_TRACE_TOKENS", 25)
    turn = {"id": 0, "prompt": [1, 2, 3], "output_len": 2}             # 5 tokens
    nxt = {"id": 1, "continues": 0, "prompt": [4], "output_len": 2}     # 5 + 1 + 2 = 8
    wl = parse_trace(_lines(turn, nxt, {**nxt, "id": 2}))               # 5 + 8 + 8 = 21
    assert [len(r.prompt) + len(r.output) for r in wl.requests] == [5, 8, 8]
    with pytest.raises(TraceError, match=r"line 3: 11 tokens \(prompt with its history, and "
                       r"output\), over the cap of 10 tokens per request"):
        parse_trace(_lines(turn, nxt, {**nxt, "id": 2, "continues": 1}))
    with pytest.raises(TraceError, match="line 4: the trace reaches 29 tokens.*over the cap of "
                       "25 tokens for the whole trace"):
        parse_trace(_lines(turn, nxt, {**nxt, "id": 2}, {**nxt, "id": 3}))
    with pytest.raises(TraceError, match=r"line 1: 12 tokens"):
        parse_trace(_lines({"id": 0, "segments": [{"len": 5}, {"len": 5, "share": "s"}],
                            "output_len": 2}))


def test_json_that_python_refuses():
    with pytest.raises(TraceError, match="line 1: nested too deeply"):
        parse_trace(["[" * 100_000])
    with pytest.raises(TraceError, match="line 1: not valid JSON"):
        parse_trace(['{"id": 1' + "0" * 5000 + "}"])


def test_values_in_messages_are_shortened():
    with pytest.raises(TraceError) as info:
        parse_trace(_lines({**OK, "output_len": "z" * 10_000}))
    assert len(str(info.value)) < 200 and "zzz... (10,002 characters)" in str(info.value)


def test_the_trace_format_is_documented_in_docs():
    """docs/bench.md states every field a trace line may have (the reader's reference;
    the module docstring is the source's)."""
    from pathlib import Path

    from prefixkv.bench.trace import FIELDS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "bench.md").read_text()
    section = doc.split("## Replaying your own trace", 1)[1]
    assert [f for f in FIELDS if f"`{f}`" not in section] == []
