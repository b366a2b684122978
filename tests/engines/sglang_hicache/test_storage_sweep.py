"""The reviewer's sweep over PrefixKVStorage's page calls (SGLang 0.5.23's loader, a real
Redis): each argument of each call replaced by each value of tests/hostile.py. A call
either answers as SGLang's interface says (a bool, a count, a list), or raises a
``PrefixKVError``; either way no untyped error escapes, and a refused call wrote nothing
to host memory and stored nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hostile import HOSTILE
from prefixkv.errors import ConfigError, PrefixKVError

from .test_storage import PAGE, fill, indices, page_hashes, redis, replica, sgl, tokens  # noqa: F401

Call = tuple[tuple[Any, ...], dict[str, Any]]


def _calls(sgl: Any, pool: Any) -> dict[str, Callable[[], Call]]:  # noqa: F811
    keys = page_hashes(sgl, tokens(2 * PAGE, 4100), PAGE)
    return {
        "exists": lambda: ((keys[0],), {}),
        "batch_exists": lambda: ((keys,), {}),
        "get": lambda: ((keys[0],), {}),
        "batch_get": lambda: ((keys,), {}),
        "set": lambda: ((keys[0], pool.get_data_page(0)), {}),
        "batch_set": lambda: ((keys, [pool.get_data_page(0), pool.get_data_page(PAGE)]), {}),
        "batch_get_v1": lambda: ((keys, indices(8, 2)), {}),
        "batch_set_v1": lambda: ((keys, indices(0, 2)), {}),
    }


@pytest.mark.parametrize("name", ["exists", "batch_exists", "get", "batch_get", "set", "batch_set",
                                  "batch_get_v1", "batch_set_v1"])
def test_every_bad_argument_of_a_page_call_is_a_typed_error_or_an_answer(sgl, redis, name):  # noqa: F811
    backend, pool = replica(sgl, redis.url)
    fill(pool, 41)
    calls = _calls(sgl, pool)
    args0, _ = calls[name]()
    problems = []
    for slot in range(len(args0)):
        for label, value in HOSTILE.items():
            args, kw = calls[name]()
            args = args[:slot] + (value(),) + args[slot + 1:]
            before, written = pool.kv_buffer.clone(), backend.pages.written
            try:
                getattr(backend, name)(*args, **kw)
            except PrefixKVError:
                if not torch.equal(pool.kv_buffer, before) or backend.pages.written != written:
                    problems.append(f"{name} {slot}={label}: raised, but wrote")
            except Exception as e:  # noqa: BLE001 (the point: which untyped errors escape)
                problems.append(f"{name} {slot}={label}: {type(e).__name__}: {e}"[:200])
            pool.kv_buffer.copy_(before)
    assert problems == []


@pytest.mark.parametrize("keys", [7, None, "ab", {"a", "b"}, (k for k in "ab")])
def test_page_keys_that_are_not_a_list_are_refused_before_any_read_or_write(sgl, redis, keys):  # noqa: F811
    """What the sweep found: a number, None or a generator raised TypeError (``len``,
    ``iter``) out of every batch call; a str was taken as a list of one-character keys and
    a set as keys in no order, to be matched with host pages in order."""
    backend, pool = replica(sgl, redis.url)
    fill(pool, 43)
    before = pool.kv_buffer.clone()
    for call in (lambda k: backend.batch_exists(k),
                 lambda k: backend.batch_get(k),
                 lambda k: backend.batch_set(k, [pool.get_data_page(0), pool.get_data_page(PAGE)]),
                 lambda k: backend.batch_get_v1(k, indices(8, 2)),
                 lambda k: backend.batch_set_v1(k, indices(0, 2))):
        fresh = (k for k in "ab") if not isinstance(keys, (int, str, set, type(None))) else keys
        with pytest.raises(ConfigError, match="page keys"):
            call(fresh)
    assert torch.equal(pool.kv_buffer, before) and backend.pages.written == 0
