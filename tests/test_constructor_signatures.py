"""The public managers state their own ``__init__``: a wrong keyword's TypeError names the
class the caller wrote (not the base class that builds it), and mypy checks the keywords
against the stated signature (no ``**kwargs`` hiding them)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from prefixkv import ConfigError, KVCacheManager
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize("keyword", ["foo", "enable_prefix_caching", "hash_fn"])
def test_an_unknown_keyword_of_the_manager_names_the_manager(keyword):
    """``KVCacheManager(16, 4, foo=1)`` raised "Admitter.__init__() got an unexpected
    keyword argument", a base class the caller never wrote."""
    with pytest.raises(TypeError, match=rf"^KVCacheManager\.__init__\(\) got an unexpected "
                                        rf"keyword argument '{keyword}'$"):
        KVCacheManager(16, 4, **{keyword: 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("keyword", ["host_blocks", "store", "enable_prefix_caching", "foo"])
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


def _public_classes() -> list[tuple[str, type]]:
    """Every class docs/api.md documents from the packages (docs/make_api.py's list),
    protocols left out (not built), by the name it is documented under."""
    import importlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_api", SRC.parent / "docs" / "make_api.py")
    assert spec is not None and spec.loader is not None
    make_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_api)
    out = []
    for package in make_api.PACKAGES:
        mod = importlib.import_module(package)
        for name in make_api.public_names(package):
            obj = getattr(mod, name)
            if isinstance(obj, type) and not make_api._is_protocol(obj):
                out.append((f"{package}.{name}", obj))
    return out


def test_every_public_class_names_itself_in_an_unknown_keywords_error():
    """The sweep: each public class built with a keyword it does not take raises a
    TypeError naming that class, before anything is built. Before, three named a base
    class: ``UncachedHybridManager`` (``HybridKVCacheManager.__init__``),
    ``ContentIndex`` (``ContentChains.__init__``) and ``HostSlot`` (``Block.__init__``)."""
    pytest.importorskip("torch")  # (the kernels and the engine are documented too)
    classes = _public_classes()
    assert len(classes) > 100, len(classes)
    wrong = {}
    for qual, cls in classes:
        name = qual.rsplit(".", 1)[1]
        try:
            cls(no_such_keyword=1)
        except TypeError as e:
            if not re.match(rf"^{name}(\.__(init|new)__)?\(\) ", str(e)):
                wrong[qual] = str(e)
        else:
            wrong[qual] = "no error"
    assert not wrong, wrong


def test_content_index_refuses_bad_arguments_naming_itself():
    """``ContentIndex(1, 2, 3)`` raised "'int' object has no attribute 'active'" from
    its base class's constructor; a missing one named ``ContentChains.__init__``."""
    from prefixkv.event_log import NullSink
    from prefixkv.index import ContentIndex, Hasher

    hasher = Hasher(lambda data: b"h", b"root", True)
    with pytest.raises(ConfigError, match=r"^ContentIndex needs a Hasher and an event sink"):
        ContentIndex(1, NullSink(), 4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^ContentIndex needs a Hasher and an event sink"):
        ContentIndex(hasher, None, 4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^block_size must be a positive int, got 0$"):
        ContentIndex(hasher, NullSink(), 0)
    with pytest.raises(TypeError, match=r"^ContentIndex\.__init__\(\) missing 1 required"):
        ContentIndex(hasher, NullSink())  # type: ignore[call-arg]
    assert len(ContentIndex(hasher, NullSink(), 4)) == 0


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
