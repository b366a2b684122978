"""A replica's ``/metrics`` text is read from another process: ``from_metrics`` gives a
``ReplicaLoad`` or raises ``LoadError``, whatever the text (its doc). Found by
wirefuzz-r16's fuzzer: a line beginning with ``{`` raised IndexError, one of our series
with a ``{`` and no ``}`` ValueError, and waiting counts summing past the largest float
raised OverflowError (the poller counted both as failed
scrapes, but a direct caller got an untyped error)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.router.load import LoadError, ReplicaLoad, from_metrics

USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"


@pytest.mark.parametrize("text", [
    '{engine="0"} 1\n' + USAGE + " 0.5",
    " \t{x} 1\n" + USAGE + " 0.5",
    "{",
    USAGE + "{",
    USAGE + '{a="b" 0.5',
    WAITING + " 1e308\n" + WAITING + " 1e308\n" + USAGE + " 0.5",
    USAGE + " 1e308\n" + USAGE + " 1e308",
])
def test_odd_lines_are_load_errors_or_ignored(text):
    try:
        load = from_metrics(text)
    except LoadError:
        return
    assert load == ReplicaLoad(0.5)  # (the odd line is another series: ignored)


def test_a_line_of_labels_only_is_another_series():
    assert from_metrics('{engine="0"} 1\n' + USAGE + " 0.25") == ReplicaLoad(0.25)


def test_a_sample_indented_by_blanks_is_read():
    assert from_metrics(" \t" + USAGE + " 0.75") == ReplicaLoad(0.75)


def test_waiting_counts_past_the_largest_float_are_a_load_error():
    with pytest.raises(LoadError):
        from_metrics(WAITING + " 1e308\n" + WAITING + " 1e308\n" + USAGE + " 0.5")


pieces = st.sampled_from([USAGE, WAITING, "{", "}", '{a="}"}', " ", "\t", "#", "1", "0.5",
                          "-1", "1e308", "nan", "inf", "x", "\u2028", "\x85", "\r", "\n"])
texts = st.lists(st.lists(pieces | st.text(max_size=4), max_size=8).map("".join),
                 max_size=8).map("\n".join)


@settings(max_examples=300, deadline=None)
@given(text=texts, num_blocks=st.none() | st.integers(-2, 5))
def test_any_text_is_a_load_or_a_load_error(text, num_blocks):
    try:
        load = from_metrics(text, num_blocks=num_blocks)
    except LoadError:
        return
    assert isinstance(load, ReplicaLoad) and 0 <= load.kv_usage <= 1 and load.num_waiting >= 0


@pytest.mark.parametrize("text", [
    pytest.param((USAGE + " 0.5\n").encode(), id="bytes"),  # (an HTTP body not decoded)
    pytest.param(None, id="None"),
    pytest.param(5, id="int"),
])
def test_metrics_that_are_not_text_are_a_load_error(text):
    """``from_metrics`` raises LoadError, and only LoadError (its doc): the body of an
    HTTP response passed as bytes was a TypeError from ``str.split``, None an
    AttributeError (review-r21)."""
    with pytest.raises(LoadError, match="str"):
        from_metrics(text)
