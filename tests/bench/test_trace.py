"""The JSONL trace format and every error it reports (line number and field)."""

import json

import pytest

from prefixkv.bench.trace import TraceError, load_trace, parse_trace


def lines(*objs):
    return [json.dumps(o) if not isinstance(o, str) else o for o in objs]


def test_tokens_segments_and_continues():
    wl = parse_trace(lines(
        {"id": "a", "segments": [{"share": "sys", "len": 20}, {"len": 5}], "output_len": 3},
        {"id": "b", "segments": [{"share": "sys", "len": 20}, {"len": 5}], "output": [7, 8]},
        "",
        {"id": "c", "continues": "a", "prompt": [1, 2], "output_len": 1, "cache_salt": "t"},
    ))
    a, b, c = wl.requests
    assert len(a.prompt) == 25 and a.prompt[:20] == b.prompt[:20] and a.prompt[20:] != b.prompt[20:]
    assert len(a.output) == 3 and b.output == (7, 8)
    assert c.prompt == a.prompt + a.output + (1, 2) and c.after == "a"
    assert c.extra.cache_salt == "t" and a.extra is None


def test_the_same_seed_gives_the_same_tokens():
    trace = lines({"id": 1, "segments": [{"len": 9}], "output_len": 2})
    assert parse_trace(trace, seed=3) == parse_trace(trace, seed=3)
    assert parse_trace(trace, seed=3) != parse_trace(trace, seed=4)


@pytest.mark.parametrize("bad, line, field", [
    ("{not json", 2, None),
    ("[1, 2]", 2, None),
    ({"id": "x", "prompt": [1], "output_len": 1, "colour": 1}, 2, "colour"),
    ({"id": "a", "prompt": [1], "output_len": 1}, 2, "id"),            # duplicate
    ({"id": "x", "continues": "zz", "prompt": [1], "output_len": 1}, 2, "continues"),
    ({"id": "x", "prompt": [1], "segments": [{"len": 1}], "output_len": 1}, 2, "prompt"),
    ({"id": "x", "output_len": 1}, 2, "prompt"),
    ({"id": "x", "prompt": [1, -1], "output_len": 1}, 2, "prompt"),
    ({"id": "x", "prompt": [], "output_len": 1}, 2, "prompt"),
    ({"id": "x", "prompt": [1], "output_len": 0}, 2, "output_len"),
    ({"id": "x", "segments": [{"len": 0}], "output_len": 1}, 2, "segments[0].len"),
    ({"id": "x", "prompt": [1], "output_len": 1, "cache_salt": ""}, 2, "cache_salt"),
    ({"id": 1.5, "prompt": [1], "output_len": 1}, 2, "id"),
])
def test_malformed_lines_name_the_line_and_field(bad, line, field):
    good = {"id": "a", "prompt": [1, 2], "output_len": 1}
    with pytest.raises(TraceError) as info:
        parse_trace(lines(good, bad))
    assert info.value.line == line and info.value.field == field
    assert f"line {line}" in str(info.value)


def test_empty_and_unreadable_traces(tmp_path):
    with pytest.raises(TraceError, match="no request"):
        parse_trace(["", "  "])
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")
