"""The public managers state their own ``__init__``: a wrong keyword's TypeError names the
class the caller wrote (not the base class that builds it), and mypy checks the keywords
against the stated signature (no ``**kwargs`` hiding them)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from prefixkv import KVCacheManager
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize("keyword", ["foo", "enable_prefix_caching", "hash_fn"])
def test_an_unknown_keyword_of_the_manager_names_the_manager(keyword):
    """``KVCacheManager(16, 4, foo=1)`` raised "Admitter.__init__() got an unexpected
    keyword argument", a base class the caller never wrote."""
    with pytest.raises(TypeError, match=rf"^KVCacheManager\.__init__\(\) got an unexpected "
                                        rf"keyword argument '{keyword}'$"):
        KVCacheManager(16, 4, **{keyword: 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("keyword", ["host_blocks", "store", "enable_caching", "foo"])
def test_an_unknown_keyword_of_the_hybrid_manager_names_the_hybrid_manager(keyword):
    """``HybridKVCacheManager(..., host_blocks=8)`` (a ``KVCacheManager`` keyword it does
    not take) raised a TypeError naming ``GroupParts.__init__`` (badinput-r16's open item)."""
    with pytest.raises(TypeError, match=rf"^HybridKVCacheManager\.__init__\(\) got an "
                                        rf"unexpected keyword argument '{keyword}'$"):
        HybridKVCacheManager([full_attention()], 24, 4, **{keyword: 8})  # type: ignore[arg-type]


def test_a_missing_argument_names_the_class_the_caller_wrote():
    with pytest.raises(TypeError, match=r"^KVCacheManager\.__init__\(\) missing 1 required"):
        KVCacheManager()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^HybridKVCacheManager\.__init__\(\) missing 1 required"):
        HybridKVCacheManager([full_attention()])  # type: ignore[call-arg]


def test_the_stated_defaults_build_the_managers_as_before():
    """The public ``__init__`` passes every argument on: defaults and given values land."""
    m = KVCacheManager(8, enable_events=True, vocab_size=100, max_events=5)
    assert (m.num_blocks, m.block_size, m.enable_caching, m.vocab_size) == (8, 16, True, 100)
    assert m._events.max_events == 5  # type: ignore[attr-defined]
    h = HybridKVCacheManager([full_attention(), sliding_window(8)], 9, 4, vocab_size=50)
    assert (h.num_blocks, h.block_size, h.vocab_size, h.null_block_id) == (9, 4, 50, 0)


CALLER = '''\
from prefixkv import KVCacheManager
from prefixkv.groups import HybridKVCacheManager, full_attention

KVCacheManager(16, 4, host_blokcs=2)
HybridKVCacheManager([full_attention()], 16, 4, host_blocks=2)
KVCacheManager(16, 4, enable_events=True, seed=3)
HybridKVCacheManager([full_attention()], 16, 4, enable_events=True, seed=3)
'''


def test_mypy_checks_the_keywords_callers_pass(tmp_path):
    """mypy (this checkout's source, by MYPYPATH) flags each unknown keyword, naming the
    class, and nothing on the good calls."""
    pytest.importorskip("mypy.api")
    (tmp_path / "caller.py").write_text(CALLER)
    (tmp_path / "mypy.ini").write_text("[mypy]\n")
    env = {**os.environ, "MYPYPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-m", "mypy", "caller.py", "--no-incremental",
                           "--follow-imports=silent", "--config-file", "mypy.ini"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600, env=env)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, done.stdout + done.stderr
    assert 'caller.py:4:' in errors[0] and '"host_blokcs"' in errors[0] \
        and '"KVCacheManager"' in errors[0], errors
    assert 'caller.py:5:' in errors[1] and '"host_blocks"' in errors[1] \
        and '"HybridKVCacheManager"' in errors[1], errors


def test_build_engine_states_the_engine_s_options():
    """``build_engine(**engine_kwargs)`` passed an unknown keyword on to ``Engine``, whose
    TypeError named ``Engine.__init__`` after the model was built; mypy saw ``Any``."""
    pytest.importorskip("torch")
    from prefixkv.engine import build_engine

    with pytest.raises(TypeError, match=r"^build_engine\(\) got an unexpected keyword argument "
                                        r"'max_num_seq'$"):
        build_engine(max_num_seq=4)  # type: ignore[call-arg]


def test_from_sentinel_states_the_constructor_s_options_and_refuses_before_connecting():
    """``RedisStore.from_sentinel(..., **kw)`` asked the sentinels (a connection) before
    the constructor refused an unknown keyword; now the call refuses it at once."""
    pytest.importorskip("redis")
    from prefixkv.store import RedisStore

    with pytest.raises(TypeError, match=r"from_sentinel\(\) got an unexpected keyword "
                                        r"argument 'time_out'$"):
        RedisStore.from_sentinel([("127.0.0.1", 1)], "svc", time_out=0.1)  # type: ignore[call-arg]
